"""`vlmcore prepare`: raw sources -> webdataset shards of crude samples -> `energon prepare`.

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
Images are paths (relative to `--images`, a directory or a tar file; default: the source's
directory), raw bytes, `data:` URIs, or `{"bytes": raw or base64, "path": ...}` dicts. A video is
the same kind of reference to a video file, or a list of frame images (as some corpora ship
clips; `video_fps` in the row gives their rate). `video` holds one video, `videos` a list.

Shard samples hold the normalised sample as `json` ({"messages"} or {"text"}), the images as
they were (RGB JPEG/PNG) or repaired to PNG, and the video files as they were (no re-encoding)
with the clip's metadata in the json (`vlmcore.data.video.check_video`: frames, fps, duration,
size, codec, read without decoding more than the first frame). Tokenization happens later, in
`vlmcore pack` and the loader, with the model's processor.
"""

import argparse
import base64
import binascii
import json
import logging
import tarfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from vlmcore.cli import existing_path, fraction, positive_int
from vlmcore.data.quality import (
    RESERVED_MARKERS,
    BadDataLog,
    BadSample,
    DataError,
    TooMuchBadData,
    check_image,
    decode_utf8,
    load_json,
    normalise_messages,
    run_stage,
    safe_relative_path,
)
from vlmcore.data.shards import ShardWriter, energon_prepare
from vlmcore.data.video import check_video

logger = logging.getLogger(__name__)

DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
DEFAULT_MAX_VIDEO_SECONDS = 3 * 3600
SOURCE_KINDS = {"captions": ("caption",), "conversations": ("messages", "conversations", "texts"), "text": ("text",)}


def parse_source(spec: str) -> tuple[str | None, Path]:
    """`[KIND:]PATH` -> (kind or None, path)."""
    kind, sep, path = str(spec).partition(":")
    if sep and kind in SOURCE_KINDS:
        return kind, Path(path)
    return None, Path(spec)


class ImageFiles:
    """Images referenced by path: files under a directory, or members of a tar file."""

    def __init__(self, root):
        self.root = Path(root)
        self.tar = None
        self.members = {}
        self.rejected_members = []
        if self.root.is_file():
            try:
                self.tar = tarfile.open(self.root, "r:*")
                for member in self.tar:
                    if not member.isfile():
                        continue
                    try:
                        self.members[safe_relative_path(member.name)] = member
                    except BadSample:
                        self.rejected_members.append(member.name)
            except (tarfile.TarError, OSError, EOFError) as e:  # cut short: the images after the cut count as missing
                logger.warning(
                    "%s: unreadable after %d members (%s); later images count as missing_image",
                    root,
                    len(self.members),
                    e,
                )
            if self.rejected_members:
                logger.warning(
                    "%s: rejected %d tar members leaving the archive: %s",
                    root,
                    len(self.rejected_members),
                    self.rejected_members[:5],
                )

    def read(self, name: str, what: str = "image") -> bytes:
        name = safe_relative_path(name)
        if self.tar is not None:
            if name not in self.members:
                raise BadSample(f"missing_{what}", f"{name} not in {self.root}")
            try:
                return self.tar.extractfile(self.members[name]).read()
            except (tarfile.TarError, OSError, EOFError) as e:
                raise BadSample(f"missing_{what}", f"{name} cut short in {self.root}: {e}") from e
        path = self.root / name
        if not path.is_file():
            raise BadSample(f"missing_{what}", str(path))
        return path.read_bytes()


def read_rows(path: Path, log: BadDataLog):
    """Yield (where, row) for every row of a source; unreadable rows are counted and skipped."""
    if path.is_dir() or path.suffix == ".parquet":
        # Raw Arrow rows: image features arrive undecoded, as {"bytes", "path"} dicts.
        try:
            if path.is_dir():
                import datasets

                batches = datasets.load_from_disk(str(path)).data.table.to_batches(max_chunksize=256)
            else:
                import pyarrow.parquet as pq

                batches = pq.ParquetFile(path).iter_batches(batch_size=256)
        except (OSError, ValueError) as e:  # ArrowInvalid is a ValueError
            raise DataError(
                f"{path}: not a readable {'datasets directory' if path.is_dir() else 'parquet file'}: {e}"
            ) from e
        for i, row in enumerate(row for batch in batches for row in batch.to_pylist()):
            yield f"{path}[{i}]", row
    elif path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    row = load_json(line)
                except BadSample as e:  # not UTF-8, or malformed JSON
                    log.seen += 1
                    log.skip(e.reason, where, e.detail)
                    continue
                yield where, row
    elif path.suffix == ".json":
        try:
            rows = json.loads(decode_utf8(path.read_bytes()))
        except (BadSample, json.JSONDecodeError) as e:
            raise DataError(f"{path}: not a readable UTF-8 JSON file: {e}") from e
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json source must hold a list of rows")
        for i, row in enumerate(rows):
            yield f"{path}[{i}]", row
    else:
        raise DataError(
            f"{path}: unknown source type (expected .jsonl, .json, .parquet or a datasets.save_to_disk directory)"
        )


def decode_base64(text: str, bad_reason: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as e:
        raise BadSample(bad_reason, f"bad base64: {e}") from e


def image_bytes(ref, files: ImageFiles, what: str = "image") -> bytes:
    """Bytes of one image (or video) reference: a path, raw bytes, a `data:` URI, or {"bytes" (raw or base64), "path"}."""
    bad = "corrupt_image" if what == "image" else "unreadable_video"
    if isinstance(ref, bytes):
        return ref
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            return ref["bytes"] if isinstance(ref["bytes"], bytes) else decode_base64(ref["bytes"], bad)
        if ref.get("path"):
            return files.read(ref["path"], what)
        raise BadSample(f"missing_{what}", f"{what} entry has neither bytes nor path")
    if isinstance(ref, str):
        return decode_base64(ref.split(",", 1)[-1], bad) if ref.startswith("data:") else files.read(ref, what)
    raise BadSample(f"missing_{what}", f"unsupported {what} reference {type(ref).__name__}")


def row_refs(row: dict, kind: str, empty: tuple = (None,)) -> list:
    """The row's image (video) references: `images` (a list, or one), or `image` (one; a list
    there is one video clip's frames); values in `empty` left out."""
    refs = row.get(f"{kind}s")
    if refs is None:
        refs = [row[kind]] if row.get(kind) not in empty else []
    return [ref for ref in (refs if isinstance(refs, list) else [refs]) if ref not in empty]


def video_entry(ref, row: dict, files: ImageFiles, max_pixels: int, max_seconds: float) -> tuple[list, dict]:
    """One video of a row -> ([(bytes, ext)], metadata): the file as it is, or a clip given as frames."""
    if not isinstance(ref, list):
        data = image_bytes(ref, files, "video")
        info = check_video(data, max_pixels, max_seconds)
        return [(data, info.container)], {"kind": "file", **info.as_dict()}
    frames = []
    for frame in ref:
        try:
            data, ext, size, _ = check_image(image_bytes(frame, files), max_pixels)
        except BadSample as e:
            raise BadSample("bad_video_frame", f"{e.reason}: {e.detail}") from e
        frames.append((data, ext, size))
    if len({size for _, _, size in frames}) > 1:
        raise BadSample("bad_video_frame", f"frames of different sizes {sorted({size for _, _, size in frames})}")
    fps = row.get("video_fps")
    if fps is not None and (not isinstance(fps, (int, float)) or fps <= 0):
        raise BadSample("malformed_row", f"video_fps {fps!r}")
    (width, height) = frames[0][2]
    meta = {"kind": "frames", "frames": len(frames), "fps": fps, "width": width, "height": height}
    if fps and len(frames) / fps > max_seconds:
        raise BadSample("video_too_long", f"{len(frames) / fps:.1f} s > {max_seconds} s")
    return [(data, ext) for data, ext, _ in frames], meta


def row_to_sample(
    row,
    files: ImageFiles,
    max_image_pixels: int,
    log: BadDataLog,
    where: str,
    max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS,
):
    """One source row -> (sample json, [(image bytes, ext)], [([(video bytes, ext)], metadata)]); raises BadSample."""
    if not isinstance(row, dict):
        raise BadSample("malformed_row", f"row is {type(row).__name__}")
    refs, video_refs = row_refs(row, "image"), row_refs(row, "video", (None, "", []))
    if "messages" in row or "conversations" in row:
        messages = row.get("messages", row.get("conversations"))
    elif "texts" in row:
        if not isinstance(row["texts"], list):
            raise BadSample("malformed_conversation", "texts is not a list")
        messages = []
        for turn in row["texts"]:
            if not isinstance(turn, dict):
                raise BadSample("malformed_conversation", f"turn is {type(turn).__name__}")
            messages += [
                {"role": "user", "content": turn.get("user")},
                {"role": "assistant", "content": turn.get("assistant")},
            ]
    elif "caption" in row:
        if not isinstance(row["caption"], str) or not row["caption"].strip():
            raise BadSample("empty_text", "empty caption")
        if not refs and not video_refs:  # trained on, it would teach describing an image that is not there
            raise BadSample("missing_image", "a caption row needs an image or a video")
        messages = [
            {"role": "user", "content": "<video>" * len(video_refs) + "<image>" * len(refs)},
            {"role": "assistant", "content": row["caption"]},
        ]
    elif "text" in row:
        text = row["text"]
        if not isinstance(text, str) or not text.strip():
            raise BadSample("empty_text")
        if any(marker in text for marker in RESERVED_MARKERS):
            raise BadSample("special_token_in_text")
        if refs:
            raise BadSample("image_tag_mismatch", "a text document cannot carry images")
        if video_refs:
            raise BadSample("video_tag_mismatch", "a text document cannot carry videos")
        return {"text": text}, [], []
    else:
        raise BadSample("malformed_row", f"no text/caption/messages/conversations/texts field in keys {sorted(row)}")

    messages, repairs = normalise_messages(messages, len(refs), len(video_refs))
    videos = [video_entry(ref, row, files, max_image_pixels, max_video_seconds) for ref in video_refs]
    for repair in repairs:
        log.repair(repair, where)
    images = []
    for ref in refs:
        data, ext, _, image_repair = check_image(image_bytes(ref, files), max_image_pixels)
        if image_repair:
            log.repair(image_repair, where)
        images.append((data, ext))
    return {"messages": messages}, images, videos


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


def prepare(
    sources,
    out_dir,
    images=None,
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
    text_chars, images_per_sample, video_seconds, kinds, rejected_members = (
        [],
        [],
        [],
        {"conversation": 0, "text": 0},
        0,
    )
    for kind, source in map(parse_source, sources):
        files = ImageFiles(images if images is not None else (source if source.is_dir() else source.parent))
        rejected_members += len(files.rejected_members)
        for where, row in tqdm(read_rows(source, log), desc=f"prepare {source.name}", unit="sample"):
            log.seen += 1
            try:
                if kind and not (isinstance(row, dict) and any(field in row for field in SOURCE_KINDS[kind])):
                    raise BadSample("malformed_row", f"a {kind} source row needs one of {SOURCE_KINDS[kind]}")
                sample, sample_images, videos = row_to_sample(
                    row, files, max_image_pixels, log, where, max_video_seconds
                )
            except BadSample as e:
                log.skip(e.reason, where, e.detail)
                continue
            writer.write(sample, sample_images, videos)
            video_seconds += [meta.get("duration_s") or meta["frames"] / (meta["fps"] or 1) for _, meta in videos]
            kinds["text" if "text" in sample else "conversation"] += 1
            text_chars.append(
                len(sample["text"]) if "text" in sample else sum(len(m["content"]) for m in sample["messages"])
            )
            images_per_sample.append(len(sample_images))
    shards = writer.close()
    stats = {
        "sources": [str(s) for s in sources],
        "samples": writer.count,
        "samples_by_kind": kinds,
        "images": int(sum(images_per_sample)),
        "images_per_sample": summary(images_per_sample),
        "videos": len(video_seconds),
        "video_seconds": summary(video_seconds),
        "text_chars": summary(text_chars),
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


def source_arg(spec: str) -> str:
    existing_path(str(parse_source(spec)[1]))
    return spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source",
        action="append",
        required=True,
        type=source_arg,
        help="[KIND:]PATH of a source file or save_to_disk directory (repeatable); KIND: captions, conversations, text",
    )
    parser.add_argument("--out", required=True, help="output dataset directory (data/<dataset>)")
    parser.add_argument(
        "--images",
        type=existing_path,
        help="directory or tar file that relative image paths refer to (default: next to each source)",
    )
    parser.add_argument("--shard-size", type=positive_int, default=1000, help="samples per tar shard")
    parser.add_argument("--max-bad-fraction", type=fraction, default=0.05, help="fail when more of the samples are bad")
    parser.add_argument(
        "--workers", type=positive_int, default=1, help="processes for indexing the shards (energon prepare)"
    )
    parser.add_argument(
        "--max-image-pixels",
        type=positive_int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help="larger images (and video frames) are skipped (decompression bombs)",
    )
    parser.add_argument(
        "--max-video-seconds", type=positive_int, default=DEFAULT_MAX_VIDEO_SECONDS, help="longer videos are skipped"
    )


def run(args) -> int:
    stats = run_stage(
        lambda: prepare(
            args.source,
            args.out,
            args.images,
            args.shard_size,
            args.max_bad_fraction,
            args.max_image_pixels,
            args.workers,
            args.max_video_seconds,
        ),
        args.out,
        logger,
    )
    if stats is None:
        return 1
    print(
        json.dumps(
            {k: stats[k] for k in ("samples", "images", "videos", "shards")} | {"skipped": stats["bad"]["skipped"]}
        )
    )
    return 0
