"""Loading the video demo's held-out questions for lm-eval: rows checked, clip paths made absolute."""

import zlib

from vlmcore.eval.tasks.demo_vqa.utils import load_rows
from vlmcore.eval.vlm import VideoClip


def load_video_qa_jsonl(vqa_data=None, **_metadata):
    """`{"id", "video" (relative to the file's directory), "question", "choices", "answer"}` per line."""
    return load_rows(vqa_data, "video", "demo_video_qa")


def doc_to_video(doc) -> list:
    return [VideoClip(doc["video_path"])]


def doc_to_shuffled_video(doc) -> list:
    return [VideoClip(doc["video_path"], shuffle_seed=zlib.crc32(doc["id"].encode()))]
