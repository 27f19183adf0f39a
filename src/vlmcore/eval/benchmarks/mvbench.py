"""MVBench's 20 tasks in one (lmms-eval 0.7.3's mvbench group): the questions of every task file
with their videos, MVBench's comparison of normalized answers, the score the mean of the tasks'
accuracies, each task's in the breakdown."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from vlmcore.eval.benchmarks.answers import mvbench_normal_form, option_letters
from vlmcore.eval.benchmarks.benchmark import Benchmark
from vlmcore.eval.benchmarks.data import (
    BadBenchmarkData,
    MediaFile,
    MissingBenchmarkData,
    check_fields,
    concatenate,
    find_media,
    read_questions,
)
from vlmcore.eval.benchmarks.scoring import mean

if TYPE_CHECKING:
    import datasets

    from vlmcore.eval.video_decode import VideoClip

# MVBench's 20 tasks: the dataset configs of OpenGVLab/MVBench (one JSON file each).
TASKS = (
    "action_sequence",
    "moving_count",
    "action_prediction",
    "episodic_reasoning",
    "action_antonym",
    "action_count",
    "scene_transition",
    "object_shuffle",
    "object_existence",
    "fine_grained_pose",
    "unexpected_action",
    "moving_direction",
    "state_change",
    "object_interaction",
    "character_order",
    "action_localization",
    "counterfactual_inference",
    "fine_grained_action",
    "moving_attribute",
    "egocentric_navigation",
)
# The folder of each task's videos in the repository's video archives (its source dataset).
VIDEO_FOLDERS = {
    "object_interaction": "star/Charades_segment",
    "action_sequence": "star/Charades_segment",
    "action_prediction": "star/Charades_segment",
    "action_localization": "sta/sta_video_segment",
    "moving_count": "clevrer/video_validation",
    "fine_grained_pose": "nturgbd_convert",
    "character_order": "perception/videos",
    "object_shuffle": "perception/videos",
    "egocentric_navigation": "vlnqa",
    "moving_direction": "clevrer/video_validation",
    "episodic_reasoning": "tvqa/video_fps3_hq_segment",
    "fine_grained_action": "Moments_in_Time_Raw/videos",
    "scene_transition": "scene_qa/video",
    "state_change": "perception/videos",
    "moving_attribute": "clevrer/video_validation",
    "action_antonym": "ssv2_video_mp4",
    "unexpected_action": "FunQA_test/test",
    "counterfactual_inference": "clevrer/video_validation",
    "object_existence": "clevrer/video_validation",
    "action_count": "perception/videos",
}
MAX_FRAMES = 32


def require_media(directory: Path, question: str, relative: str, folder: str) -> MediaFile:
    media = find_media(directory, relative, folder)
    if media is None:
        raise MissingBenchmarkData(
            f"mvbench: question {question}: its video {relative} is in none of the files under {directory}"
        )
    return media


def questions(directory: Path) -> datasets.Dataset:
    """The 20 tasks' questions in one table, with their task and video."""
    tables = []
    for task in TASKS:
        try:
            rows = read_questions(directory, BENCHMARK, task)
        except MissingBenchmarkData:
            continue
        check_fields(rows, BENCHMARK, directory)
        media = []
        for number, row in enumerate(rows):
            if row["answer"] not in row["candidates"]:
                raise BadBenchmarkData(
                    f"mvbench: {task} question {number}: answer {row['answer']!r} is not a candidate"
                )
            media.append(require_media(directory, f"{task} {number}", row["video"], VIDEO_FOLDERS[task]))
        rows = rows.add_column("task", [task] * len(rows))
        rows = rows.add_column("video_path", [m.path for m in media])
        tables.append(rows.add_column("video_member", [m.member or "" for m in media]))
    if not tables:
        raise MissingBenchmarkData(f"mvbench: none of its {len(TASKS)} task files under {directory}")
    return concatenate(tables)


def doc_to_text(doc: dict) -> str:
    options = "".join(f"({letter}) {text}\n" for letter, text in zip(option_letters(26), doc["candidates"]))
    return f"Question:{doc['question']}\nOption:\n{options}Only give the best option.\n"


def doc_to_visual(doc: dict) -> list[VideoClip]:
    # Imported when a clip is asked for: the records are read where torch is not (the workflow's planning).
    from vlmcore.eval.video_decode import VideoClip

    return [VideoClip(doc["video_path"], member=doc["video_member"] or None, max_frames=MAX_FRAMES)]


def record(doc: dict, response: str) -> dict:
    """Whether the answer names the right option (MVBench's comparison of normalized answers)."""
    response = response.strip()
    right_letter = option_letters(len(doc["candidates"]))[doc["candidates"].index(doc["answer"])]
    correct = mvbench_normal_form(response) == mvbench_normal_form(right_letter)
    return {"task": doc["task"], "answered": response != "", "correct": correct}


def task_score(records: list[dict]) -> float:
    """Percent correct among the answered questions (an empty answer counts in neither)."""
    answered = [one["correct"] for one in records if one["answered"]]
    return 100 * sum(answered) / len(answered) if answered else 0


def scores(records: list[dict]) -> dict:
    """Per task (MVBench's 20), and their mean: MVBench's average over tasks."""
    by_task = defaultdict(list)
    for one in records:
        by_task[one["task"]].append(one)
    breakdown = {f"task/{task}": (task_score(rows), len(rows)) for task, rows in sorted(by_task.items())}
    return {"score": mean([score for score, _ in breakdown.values()]), "breakdown": breakdown}


BENCHMARK = Benchmark(
    name="mvbench",
    hf_repo="OpenGVLab/MVBench",
    split="train",
    configs=TASKS,
    media_files=("video/*.zip",),
    revision="video",
    modality="video",
    max_frames=MAX_FRAMES,
    fields=("video", "question", "candidates", "answer"),
    questions=questions,
    doc_to_text=doc_to_text,
    doc_to_visual=doc_to_visual,
    record=record,
    scores=scores,
    metric="mvbench_accuracy",
    scale=100.0,
)
