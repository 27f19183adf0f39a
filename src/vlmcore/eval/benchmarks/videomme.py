"""Video-MME without subtitles (short, medium and long videos), as lmms-eval 0.7.3's videomme with
its Qwen3-VL prompt: at most 32 frames a video, the answer's letter by lmms-eval's ranked
extraction, percent correct overall and per duration, domain, sub-category and task type.
videomme_w_subtitle.py is the same benchmark with the subtitles shown."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from vlmcore.eval.benchmarks.answers import ranked_letter
from vlmcore.eval.benchmarks.benchmark import Benchmark
from vlmcore.eval.benchmarks.data import BadBenchmarkData, MissingBenchmarkData, find_media, read_split
from vlmcore.eval.benchmarks.scoring import percent, percent_by

if TYPE_CHECKING:
    import datasets

    from vlmcore.eval.video_decode import VideoClip

DURATIONS = ("short", "medium", "long")
VIDEO_EXTENSIONS = (".mp4", ".MP4", ".mkv")
MAX_FRAMES = 32
FIELDS = (
    "videoID",
    "question_id",
    "duration",
    "domain",
    "sub_category",
    "task_type",
    "question",
    "options",
    "answer",
)


def questions_with_videos(directory: Path, benchmark: Benchmark, subtitles: bool) -> datasets.Dataset:
    """The questions, each with its video (and, with `subtitles`, its .srt when the video has one) as columns."""
    rows = read_split(directory, benchmark)
    videos = []
    subtitle_files = []
    for row in rows:
        if row["duration"] not in DURATIONS:
            raise BadBenchmarkData(
                f"{benchmark.name}: question {row['question_id']}: duration {row['duration']!r} not in {DURATIONS}"
            )
        found = [find_media(directory, row["videoID"] + extension) for extension in VIDEO_EXTENSIONS]
        found = [media for media in found if media is not None]
        if not found:
            raise MissingBenchmarkData(
                f"{benchmark.name}: question {row['question_id']}: no video {row['videoID']}.mp4 "
                f"in the files under {directory}"
            )
        videos.append(found[0])
        subtitle_files.append(find_media(directory, row["videoID"] + ".srt") if subtitles else None)
    rows = rows.add_column("video_path", [media.path for media in videos])
    rows = rows.add_column("video_member", [media.member or "" for media in videos])
    rows = rows.add_column("subtitle_path", [media.path if media else "" for media in subtitle_files])
    return rows.add_column("subtitle_member", [(media.member or "") if media else "" for media in subtitle_files])


def questions(directory: Path) -> datasets.Dataset:
    return questions_with_videos(directory, BENCHMARK, subtitles=False)


def question(doc: dict) -> str:
    """The question and its options ("A. ..." already), and the instruction (the `qwen3_vl` kwargs)."""
    options = "\n".join(doc["options"])
    return f"Question: {doc['question']}\nOptions:\n{options}\nAnswer with the option letter only."


def doc_to_visual(doc: dict) -> list[VideoClip]:
    # Imported when a clip is asked for: the records are read where torch is not (the workflow's planning).
    from vlmcore.eval.video_decode import VideoClip

    return [VideoClip(doc["video_path"], member=doc["video_member"] or None, max_frames=MAX_FRAMES)]


def record(doc: dict, response: str) -> dict:
    """The letter of the answer (ranked extraction among A-D) and the question's duration and categories."""
    letter = ranked_letter(response.strip(), ["A", "B", "C", "D"])
    return {
        "question_id": doc["question_id"],
        "duration": doc["duration"],
        "domain": doc["domain"],
        "sub_category": doc["sub_category"],
        "task_type": doc["task_type"],
        "correct": letter == doc["answer"],
    }


def scores(records: list[dict]) -> dict:
    """Percent correct overall and per duration, domain, sub-category and task type."""
    breakdown = {}
    for key, values in (
        ("duration", DURATIONS),
        ("domain", None),
        ("sub_category", None),
        ("task_type", None),
    ):
        for value, figures in percent_by(records, key, values).items():
            breakdown[f"{key}/{value}"] = figures
    return {"score": percent([one["correct"] for one in records]), "breakdown": breakdown}


BENCHMARK = Benchmark(
    name="videomme",
    hf_repo="lmms-eval/Video-MME",
    split="test",
    media_files=("videos_chunked_*.zip",),
    modality="video",
    max_frames=MAX_FRAMES,
    fields=FIELDS,
    questions=questions,
    doc_to_text=question,
    doc_to_visual=doc_to_visual,
    record=record,
    scores=scores,
    metric="videomme_perception_score",
    scale=100.0,
    chance=0.25,
)
