"""The public benchmarks as lm-eval tasks (their YAML files are in vlmcore/eval/tasks/benchmarks/):
questions read from the staged data, prompts as lmms-eval gives them to Qwen3-VL, answers
scored by vlmcore.eval.benchmarks.scoring.

Prompts (lmms-eval 0.7.3's task YAMLs; the `qwen3_vl` variant where the task has one, as
lmms-eval's Qwen3-VL model uses it): docs/evaluation.md lists them with the generation length,
the frame sampling and the image resolution.
"""

import functools
import re
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

from vlmcore.data.media.video import probe
from vlmcore.data.quality import BadSample
from vlmcore.eval.benchmarks.data import (
    BadBenchmarkData,
    MediaFile,
    MissingBenchmarkData,
    check_fields,
    find_media,
    read_questions,
    staged_dir,
)
from vlmcore.eval.benchmarks.registry import BENCHMARKS, MVBENCH_TASKS
from vlmcore.eval.benchmarks.scoring import (
    SCORERS,
    VIDEOMME_DURATIONS,
    mmbench_options,
    mmmu_options,
    option_letters,
)
from vlmcore.eval.vlm import VideoClip

FIELDS = {
    "mmmu_val": ("id", "question", "options", "answer", "question_type", "image_1"),
    "chartqa": ("question", "answer", "type", "image"),
    "docvqa_val": ("questionId", "question", "answers", "image"),
    "mmbench_en_dev": ("index", "question", "hint", "answer", "A", "B", "C", "D", "category", "L2-category", "image"),
    "videomme": (
        "videoID",
        "question_id",
        "duration",
        "domain",
        "sub_category",
        "task_type",
        "question",
        "options",
        "answer",
    ),
    "mvbench": ("video", "question", "candidates", "answer"),
}
FIELDS["videomme_w_subtitle"] = FIELDS["videomme"]
# The folder of each MVBench task's videos in the repository's video archives (its source dataset).
MVBENCH_VIDEO_FOLDERS = {
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
VIDEO_EXTENSIONS = (".mp4", ".MP4", ".mkv")
# The metrics of the benchmarks whose answers are scored one by one (their records are these metrics).
PER_ANSWER_METRICS = {
    "chartqa": ("relaxed_overall", "relaxed_human_split", "relaxed_augmented_split"),
    "docvqa_val": ("anls",),
}


def require_media(directory: Path, task: str, question: str, relative: str, folder: str = "") -> MediaFile:
    media = find_media(directory, relative, folder)
    if media is None:
        raise MissingBenchmarkData(
            f"{task}: question {question}: its video {relative} is in none of the files under {directory}"
        )
    return media


def videomme_media(rows: datasets.Dataset, directory: Path, task: str) -> datasets.Dataset:
    """Each question's video (and, with subtitles, its .srt when the video has one) as columns."""
    videos = []
    subtitles = []
    for row in rows:
        if row["duration"] not in VIDEOMME_DURATIONS:
            raise BadBenchmarkData(
                f"{task}: question {row['question_id']}: duration {row['duration']!r} not in {VIDEOMME_DURATIONS}"
            )
        found = [find_media(directory, row["videoID"] + extension) for extension in VIDEO_EXTENSIONS]
        found = [media for media in found if media is not None]
        if not found:
            raise MissingBenchmarkData(
                f"{task}: question {row['question_id']}: no video {row['videoID']}.mp4 in the files under {directory}"
            )
        videos.append(found[0])
        subtitle = find_media(directory, row["videoID"] + ".srt") if task == "videomme_w_subtitle" else None
        subtitles.append(subtitle)
    rows = rows.add_column("video_path", [media.path for media in videos])
    rows = rows.add_column("video_member", [media.member or "" for media in videos])
    rows = rows.add_column("subtitle_path", [media.path if media else "" for media in subtitles])
    return rows.add_column("subtitle_member", [(media.member or "") if media else "" for media in subtitles])


def mvbench_questions(directory: Path) -> datasets.Dataset:
    """The 20 tasks' questions in one table, with their task and video."""
    benchmark = BENCHMARKS["mvbench"]
    tables = []
    for task in MVBENCH_TASKS:
        try:
            rows = read_questions(directory, benchmark, task)
        except MissingBenchmarkData:
            continue
        check_fields(rows, FIELDS["mvbench"], "mvbench", directory)
        media = []
        for number, row in enumerate(rows):
            if row["answer"] not in row["candidates"]:
                raise BadBenchmarkData(
                    f"mvbench: {task} question {number}: answer {row['answer']!r} is not a candidate"
                )
            question = f"{task} {number}"
            media.append(require_media(directory, "mvbench", question, row["video"], MVBENCH_VIDEO_FOLDERS[task]))
        rows = rows.add_column("task", [task] * len(rows))
        rows = rows.add_column("video_path", [m.path for m in media])
        tables.append(rows.add_column("video_member", [m.member or "" for m in media]))
    if not tables:
        raise MissingBenchmarkData(f"mvbench: none of its {len(MVBENCH_TASKS)} task files under {directory}")
    return datasets.concatenate_datasets(tables)


def load(benchmark_data: str | None = None, task: str = "", **_metadata: object) -> datasets.DatasetDict:
    """The questions of `task` from `<benchmark_data>/<task>/` (lm-eval's custom_dataset)."""
    directory = staged_dir(benchmark_data, task)
    benchmark = BENCHMARKS[task]
    if task == "mvbench":
        rows = mvbench_questions(directory)
    else:
        rows = read_questions(directory, benchmark, benchmark.configs[0] if benchmark.configs else None)
        check_fields(rows, FIELDS[task], task, directory)
    if task.startswith("videomme"):
        rows = videomme_media(rows, directory, task)
    if len(rows) == 0:
        raise BadBenchmarkData(f"{task}: no questions under {directory}")
    return datasets.DatasetDict({"test": rows})


def mmmu_doc_to_text(doc: dict) -> str:
    """lmms-eval's Qwen3-VL form of MMMU (mmmu_val's `qwen3_vl` kwargs): the question, its
    options lettered, an instruction (an open question lists no options)."""
    options = "\n".join(f"{letter}. {option}" for letter, option in zip(option_letters(99), mmmu_options(doc)))
    if doc["question_type"] == "multiple-choice":
        instruction = "Answer with the option letter only."
    else:
        instruction = "Please select the correct answer from the options above."
    return f"Question: {doc['question']}\nOptions:\n{options}\n{instruction}"


def mmmu_doc_to_image(doc: dict) -> list[Image.Image]:
    """The images the question and its options refer to as `<image N>`, in name order."""
    text = doc["question"] + " " + " ".join(mmmu_options(doc))
    names = sorted({tag.strip("<>").replace(" ", "_") for tag in re.findall(r"<image \d+>", text)})
    return [doc[name].convert("RGB") for name in names]


def image_doc_to_image(doc: dict) -> list[Image.Image]:
    return [doc["image"].convert("RGB")]


def chartqa_doc_to_text(doc: dict) -> str:
    return f"{doc['question']}\nAnswer the question with a single word."


def docvqa_doc_to_text(doc: dict) -> str:
    return f"{doc['question']}\nAnswer the question using a single word or phrase."


def is_shown(value: object) -> bool:
    """MMBench shows a hint or an option unless it is missing or the text "nan"."""
    return value is not None and value == value and value != "nan"


def mmbench_doc_to_text(doc: dict) -> str:
    """MMBench's prompt: the hint (if any), the question, "There are several options:" with the
    options lettered, and the instruction to answer with the letter."""
    options = "\n".join(f"{key}. {text}" for key, text in mmbench_options(doc).items() if is_shown(text))
    query = f"{doc['question']} There are several options:\n{options}"
    if is_shown(doc["hint"]):
        query = f"{doc['hint']} {query}"
    return f"{query}\nAnswer with the option's letter from the given choices directly."


def video_clip(doc: dict, task: str) -> VideoClip:
    return VideoClip(doc["video_path"], member=doc["video_member"] or None, max_frames=BENCHMARKS[task].max_frames)


def videomme_question(doc: dict) -> str:
    """lmms-eval's Qwen3-VL form of Video-MME (its `qwen3_vl` kwargs): the options are "A. ..." already."""
    options = "\n".join(doc["options"])
    return f"Question: {doc['question']}\nOptions:\n{options}\nAnswer with the option letter only."


def videomme_doc_to_video(doc: dict) -> list[VideoClip]:
    return [video_clip(doc, "videomme")]


def srt_timed_lines(text: str) -> list[tuple[float, float, str]]:
    """(start s, end s, text) of each block of an .srt file (a block: number, times, text lines)."""
    blocks = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        if not block.strip() or len(lines) < 3:
            continue
        start, end = (srt_seconds(part) for part in lines[1].split(" --> "))
        blocks.append((start, end, " ".join(lines[2:])))
    return blocks


def srt_seconds(stamp: str) -> float:
    hours, minutes, rest = stamp.split(":")
    seconds, millis = rest.split(",")
    return int(hours) * 3600 + int(minutes) * 60 + int(seconds) + int(millis) / 1000


@functools.lru_cache(maxsize=64)
def video_frames_and_fps(media: MediaFile) -> tuple[int, float]:
    info = probe(media.read_bytes())
    return info.frames, info.fps


def subtitles_at_frames(doc: dict, frame_count: int) -> str:
    """Video-MME's subtitles for a clip: the lines shown at `frame_count` frames spread evenly over
    the video (the frames the model sees), their white-font text one per line. A video that does
    not decode has none: the model's encoding of it fails next, and is counted there."""
    if not doc["subtitle_path"]:
        return "No subtitles available"
    subtitle = MediaFile(doc["subtitle_path"], doc["subtitle_member"] or None)
    try:
        total, fps = video_frames_and_fps(MediaFile(doc["video_path"], doc["video_member"] or None))
    except BadSample:
        return "No subtitles available"
    timed = [(int(start * fps), int(end * fps), text) for start, end, text in srt_timed_lines(subtitle.read_text())]
    frames = np.linspace(0, total - 1, frame_count, dtype=int).tolist()
    shown = sorted({i for frame in frames for i, (start, end, _) in enumerate(timed) if start <= frame < end})
    texts = []
    for i in shown:
        match = re.search(r'<font color="white" size=".72c">(.*?)</font>', timed[i][2])
        if match:
            texts.append(match.group(1))
    return "\n".join(texts)


def videomme_subtitle_doc_to_text(doc: dict) -> str:
    subtitles = subtitles_at_frames(doc, BENCHMARKS["videomme_w_subtitle"].max_frames)
    return f"This video's subtitles are listed below: \n{subtitles}\n{videomme_question(doc)}"


def videomme_subtitle_doc_to_video(doc: dict) -> list[VideoClip]:
    return [video_clip(doc, "videomme_w_subtitle")]


def mvbench_doc_to_text(doc: dict) -> str:
    options = "".join(f"({letter}) {text}\n" for letter, text in zip(option_letters(26), doc["candidates"]))
    return f"Question:{doc['question']}\nOption:\n{options}Only give the best option.\n"


def mvbench_doc_to_video(doc: dict) -> list[VideoClip]:
    return [video_clip(doc, "mvbench")]


def process_results_of(task: str) -> Callable[[dict, list[str]], dict]:
    """lm-eval's process_results of a task: the record of the (first) answer under the headline metric."""
    record_of, _ = SCORERS[task]
    metric = BENCHMARKS[task].metric

    def process_results(doc: dict, results: list[str]) -> dict:
        record = record_of(doc, results[0])
        # ChartQA and DocVQA score each answer on its own: their records are the metrics.
        return record if metric in record else {metric: record}

    return process_results


def aggregation_of(task: str) -> Callable[[list[dict]], float]:
    """lm-eval's aggregation of a task's headline metric: the benchmark's score of all records."""
    _, scores = SCORERS[task]
    return lambda records: scores(records)["score"]


def breakdown(task: str, samples: list[dict]) -> dict:
    """The per-subset scores of a benchmark task from lm-eval's logged samples, in the runner's
    breakdown form: {subset: {metric, value, chance, n}}."""
    benchmark = BENCHMARKS[task]
    _, scores = SCORERS[task]
    records = []
    for sample in samples:
        value = sample[benchmark.metric]
        if isinstance(value, dict):
            records.append(value)
        else:
            # A benchmark scored per answer logs its record's metrics one by one.
            records.append({key: sample[key] for key in PER_ANSWER_METRICS[task] if key in sample})
    figures = scores(records)["breakdown"]
    return {
        subset: {"metric": benchmark.metric, "value": value, "chance": None, "n": n}
        for subset, (value, n) in figures.items()
    }


mmmu_process_results = process_results_of("mmmu_val")
mmmu_aggregate = aggregation_of("mmmu_val")
chartqa_process_results = process_results_of("chartqa")
docvqa_process_results = process_results_of("docvqa_val")
mmbench_process_results = process_results_of("mmbench_en_dev")
mmbench_aggregate = aggregation_of("mmbench_en_dev")
videomme_process_results = process_results_of("videomme")
videomme_aggregate = aggregation_of("videomme")
mvbench_process_results = process_results_of("mvbench")
mvbench_aggregate = aggregation_of("mvbench")
