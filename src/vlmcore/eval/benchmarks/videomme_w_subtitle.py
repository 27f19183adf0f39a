"""Video-MME with the subtitles shown at the sampled frames, as lmms-eval 0.7.3's
videomme_w_subtitle: videomme.py's questions, videos and scoring, the prompt led by the lines of
the video's subtitles that its 32 sampled frames show."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING

from vlmcore.data.quality import BadSample
from vlmcore.eval.benchmarks import videomme
from vlmcore.eval.benchmarks.benchmark import Benchmark
from vlmcore.eval.benchmarks.data import MediaFile

if TYPE_CHECKING:
    import datasets


def questions(directory: Path) -> datasets.Dataset:
    return videomme.questions_with_videos(directory, BENCHMARK, subtitles=True)


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
    # Imported when a video is probed: the records are read where torch is not (the workflow's planning).
    from vlmcore.data.media.video import probe

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
    import numpy as np  # here: the records are read where numpy is not needed (the workflow's planning)

    timed = [(int(start * fps), int(end * fps), text) for start, end, text in srt_timed_lines(subtitle.read_text())]
    frames = np.linspace(0, total - 1, frame_count, dtype=int).tolist()
    shown = sorted({i for frame in frames for i, (start, end, _) in enumerate(timed) if start <= frame < end})
    texts = []
    for i in shown:
        match = re.search(r'<font color="white" size=".72c">(.*?)</font>', timed[i][2])
        if match:
            texts.append(match.group(1))
    return "\n".join(texts)


def doc_to_text(doc: dict) -> str:
    subtitles = subtitles_at_frames(doc, videomme.MAX_FRAMES)
    return f"This video's subtitles are listed below: \n{subtitles}\n{videomme.question(doc)}"


BENCHMARK = Benchmark(
    name="videomme_w_subtitle",
    hf_repo="lmms-eval/Video-MME",
    split="test",
    media_files=("videos_chunked_*.zip", "subtitle.zip"),
    modality="video",
    max_frames=videomme.MAX_FRAMES,
    fields=videomme.FIELDS,
    questions=questions,
    doc_to_text=doc_to_text,
    doc_to_visual=videomme.doc_to_visual,
    record=videomme.record,
    scores=videomme.scores,
    metric="videomme_perception_score",
    scale=100.0,
    chance=0.25,
)
