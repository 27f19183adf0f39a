"""A prepared dataset: raw sources -> webdataset shards of crude samples -> `energon prepare`.

Sources (`--source [KIND:]PATH`), recognised by file type and by the fields of each row; an
optional KIND (captions, conversations, text) makes rows of any other shape count as bad:
  *.jsonl / *.json      rows, or one JSON list of rows
  *.parquet             rows (FineVision-style embedded images included)
  a directory written by `datasets.save_to_disk`
Rows:
  {"text": ...}                                      text-only document
  {"image": ..., "caption": ...}                     image-caption pair
  {"images"|"image": ..., "messages"|"conversations": [{"role"|"from", "content"|"value"}]}
                                                     LLaVA / OpenAI-style conversation, `<image>` tags
  {"images": [...], "texts": [{"user", "assistant"}]}  FineVision
  any of these but text with `video`/`videos` and `<video>` tags  LLaVA-Video / ShareGPT4Video style
  {"prompt"?, "chosen", "rejected", "images"?, "videos"?}  a preference pair (DPO: data/prepare/preference.py)
  {"question"|"prompt", "answer", "images"?, "videos"?, ...}  an RL prompt with its reference answer
                                                     (data/prepare/prompts.py)
Images are paths (relative to `--images`, a directory or a tar file; default: the source's
directory), raw bytes, `data:` URIs, or `{"bytes": raw or base64, "path": ...}` dicts. A video is
the same kind of reference to a video file, or a list of frame images (as some corpora ship
clips; `video_fps` in the row gives their rate). `video` holds one video, `videos` a list.

Shard samples hold the normalised sample as `json` ({"messages"} or {"text"}), the images as
they were (RGB JPEG/PNG) or repaired to PNG, and the video files as they were (no re-encoding)
with the clip's metadata in the json (`vlmcore.data.media.video.check_video`: frames, fps,
duration, size, codec, read without decoding more than the first frame). Tokenization happens
later, in `vlmcore pack` and the loader, with the model's processor.
"""

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from vlmcore.data.prepare.preference import is_preference_row, preference_messages
from vlmcore.data.prepare.prompts import is_prompt_row, prompt_sample
from vlmcore.data.prepare.samples import DEFAULT_MAX_VIDEO_SECONDS, row_to_sample, sample_with_media
from vlmcore.data.prepare.sources import SOURCE_KINDS, ImageFiles, parse_source, read_rows
from vlmcore.data.quality import BadDataLog, BadSample, DataError, TooMuchBadData
from vlmcore.data.shards import ShardWriter, energon_prepare

DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192


def summary(values: list[int]) -> dict:
    if not values:
        return {"count": 0}
    array = np.asarray(values)
    return {
        "count": len(values),
        "mean": float(array.mean()),
        "p50": float(np.percentile(array, 50)),
        "p95": float(np.percentile(array, 95)),
        "max": int(array.max()),
    }


class SampleCounts:
    """What the prepared samples hold, for stats.json."""

    def __init__(self) -> None:
        self.text_chars = []
        self.images_per_sample = []
        self.video_seconds = []
        self.kinds = {"conversation": 0, "text": 0}

    def add(self, sample: dict, images: list, videos: list) -> None:
        self.video_seconds += [meta.get("duration_s") or meta["frames"] / (meta["fps"] or 1) for _, meta in videos]
        if "text" in sample:
            self.kinds["text"] += 1
            self.text_chars.append(len(sample["text"]))
        elif "rejected" in sample:  # a preference pair (counted only where there are some)
            self.kinds["preference"] = self.kinds.get("preference", 0) + 1
            self.text_chars.append(sum(len(m["content"]) for m in sample["messages"] + sample["rejected"]))
        elif "answer" in sample:  # an RL prompt (counted only where there are some)
            self.kinds["prompt"] = self.kinds.get("prompt", 0) + 1
            self.text_chars.append(sum(len(m["content"]) for m in sample["messages"]))
        else:
            self.kinds["conversation"] += 1
            self.text_chars.append(sum(len(m["content"]) for m in sample["messages"]))
        self.images_per_sample.append(len(images))


def prepare(
    sources: Sequence[str],
    out_dir: str | Path,
    images: str | Path | None = None,
    shard_size: int = 1000,
    max_bad_fraction: float = 0.05,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    workers: int = 1,
    max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS,
) -> dict:
    """Write the shards of all `sources` ([KIND:]PATH) into `out_dir`, index them with Energon, return the stats."""
    out_dir = Path(out_dir)
    log = BadDataLog("prepare", max_bad_fraction)
    missing = [str(source) for _, source in map(parse_source, sources) if not source.exists()]
    if missing:  # before anything is written
        raise DataError(f"sources not found: {', '.join(missing)}")
    writer = ShardWriter(out_dir, shard_size)
    counts = SampleCounts()
    rejected_members = 0
    for kind, source in map(parse_source, sources):
        files = ImageFiles(images if images is not None else (source if source.is_dir() else source.parent))
        rejected_members += len(files.rejected_members)
        for where, row in tqdm(read_rows(source, log), desc=f"prepare {source.name}", unit="sample"):
            log.seen += 1
            try:
                check_source_kind(row, kind)
                sample_of = None  # a conversation, a caption or a text document: row_to_sample
                if kind == "prompts" or (kind is None and is_prompt_row(row)):
                    sample_of = prompt_sample
                elif is_preference_row(row):
                    sample_of = preference_messages
                media_args = (files, max_image_pixels, log, where, max_video_seconds)
                if sample_of is None:
                    sample, sample_images, videos = row_to_sample(row, *media_args)
                else:
                    sample, sample_images, videos = sample_with_media(sample_of, row, *media_args)
            except BadSample as e:
                log.skip(e.reason, where, e.detail)
                continue
            writer.write(sample, sample_images, videos)
            counts.add(sample, sample_images, videos)
    shards = writer.close()
    stats = {
        "sources": [str(s) for s in sources],
        "samples": writer.count,
        "samples_by_kind": counts.kinds,
        "images": int(sum(counts.images_per_sample)),
        "images_per_sample": summary(counts.images_per_sample),
        "videos": len(counts.video_seconds),
        "video_seconds": summary(counts.video_seconds),
        "text_chars": summary(counts.text_chars),
        "shards": len(shards),
        "shard_size": shard_size,
        "rejected_tar_members": rejected_members,
        "bad": log.as_dict(),
    }
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    log.check()
    if writer.count == 0:
        raise TooMuchBadData(f"prepare: no usable samples in {[str(s) for s in sources]}")
    energon_prepare(out_dir, workers)
    return stats


def check_source_kind(row: object, kind: str | None) -> None:
    """A row of a source given as KIND must have one of that kind's fields."""
    if kind and not (isinstance(row, dict) and any(field in row for field in SOURCE_KINDS[kind])):
        raise BadSample("malformed_row", f"a {kind} source row needs one of {SOURCE_KINDS[kind]}")
