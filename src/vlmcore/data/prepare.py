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
Images are paths (relative to `--images`, a directory or a tar file; default: the source's
directory), raw bytes, `data:` URIs, or `{"bytes": raw or base64, "path": ...}` dicts.
Rows with a video (a `video`/`videos` field or a `<video>` tag) are not read yet: each is
skipped and counted as `video_not_supported`, never kept as text without its video.

Shard samples hold the normalised sample as `json` ({"messages"} or {"text"}) and the images
as they were (RGB JPEG/PNG) or repaired to PNG. Tokenization happens later, in `vlmcore pack`
and the loader, with the model's processor.
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
    normalise_messages,
    safe_relative_path,
)
from vlmcore.data.shards import ShardWriter, energon_prepare

logger = logging.getLogger(__name__)

DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
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
                logger.warning("%s: unreadable after %d members (%s); later images count as missing_image", root, len(self.members), e)
            if self.rejected_members:
                logger.warning("%s: rejected %d tar members leaving the archive: %s", root, len(self.rejected_members), self.rejected_members[:5])

    def read(self, name: str) -> bytes:
        name = safe_relative_path(name)
        if self.tar is not None:
            if name not in self.members:
                raise BadSample("missing_image", f"{name} not in {self.root}")
            try:
                return self.tar.extractfile(self.members[name]).read()
            except (tarfile.TarError, OSError, EOFError) as e:
                raise BadSample("missing_image", f"{name} cut short in {self.root}: {e}") from e
        path = self.root / name
        if not path.is_file():
            raise BadSample("missing_image", str(path))
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
            raise DataError(f"{path}: not a readable {'datasets directory' if path.is_dir() else 'parquet file'}: {e}") from e
        i = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{path}[{i}]", row
                i += 1
    elif path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    row = json.loads(decode_utf8(line))
                except BadSample as e:
                    log.seen += 1
                    log.skip(e.reason, where, e.detail)
                    continue
                except json.JSONDecodeError as e:
                    log.seen += 1
                    log.skip("malformed_json", where, str(e))
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
        raise DataError(f"{path}: unknown source type (expected .jsonl, .json, .parquet or a datasets.save_to_disk directory)")


def decode_base64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as e:
        raise BadSample("corrupt_image", f"bad base64: {e}") from e


def image_bytes(ref, files: ImageFiles) -> bytes:
    """Bytes of one image reference: a path, raw bytes, a `data:` URI, or {"bytes" (raw or base64), "path"}."""
    if isinstance(ref, bytes):
        return ref
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            return ref["bytes"] if isinstance(ref["bytes"], bytes) else decode_base64(ref["bytes"])
        if ref.get("path"):
            return files.read(ref["path"])
        raise BadSample("missing_image", "image entry has neither bytes nor path")
    if isinstance(ref, str):
        return decode_base64(ref.split(",", 1)[-1]) if ref.startswith("data:") else files.read(ref)
    raise BadSample("missing_image", f"unsupported image reference {type(ref).__name__}")


def row_images(row: dict) -> list:
    images = row.get("images")
    if images is None:
        images = [row["image"]] if row.get("image") is not None else []
    if not isinstance(images, list):
        images = [images]
    return [im for im in images if im is not None]


def video_in_row(row: dict) -> str | None:
    """What makes a row a video sample (a `video`/`videos` field, a `<video>` tag), or None."""
    for key in ("video", "videos"):
        if row.get(key) not in (None, [], ""):
            return f"a {key!r} field"
    turns = row.get("messages", row.get("conversations", row.get("texts")))
    texts = [row.get("text"), row.get("caption")]
    if isinstance(turns, list):
        texts += [v for turn in turns if isinstance(turn, dict) for v in turn.values()]
    if any(isinstance(t, str) and "<video>" in t for t in texts):
        return "a <video> tag"
    return None


def row_to_sample(row, files: ImageFiles, max_image_pixels: int, log: BadDataLog, where: str):
    """One source row -> (sample json, [(image bytes, ext)], image sizes); raises BadSample."""
    if not isinstance(row, dict):
        raise BadSample("malformed_row", f"row is {type(row).__name__}")
    # Kept as text, the video would be dropped without a word and its tag trained as text.
    if (video := video_in_row(row)) is not None:
        raise BadSample("video_not_supported", f"{video}: `vlmcore prepare` does not read videos yet")
    refs = row_images(row)
    if "messages" in row or "conversations" in row:
        messages = row.get("messages", row.get("conversations"))
    elif "texts" in row:
        if not isinstance(row["texts"], list):
            raise BadSample("malformed_conversation", "texts is not a list")
        messages = []
        for turn in row["texts"]:
            if not isinstance(turn, dict):
                raise BadSample("malformed_conversation", f"turn is {type(turn).__name__}")
            messages += [{"role": "user", "content": turn.get("user")}, {"role": "assistant", "content": turn.get("assistant")}]
    elif "caption" in row:
        if not isinstance(row["caption"], str) or not row["caption"].strip():
            raise BadSample("empty_text", "empty caption")
        if not refs:  # trained on, it would teach describing an image that is not there
            raise BadSample("missing_image", "a caption row needs an image")
        messages = [{"role": "user", "content": "<image>" * len(refs)}, {"role": "assistant", "content": row["caption"]}]
    elif "text" in row:
        text = row["text"]
        if not isinstance(text, str) or not text.strip():
            raise BadSample("empty_text")
        if any(marker in text for marker in RESERVED_MARKERS):
            raise BadSample("special_token_in_text")
        if refs:
            raise BadSample("image_tag_mismatch", "a text document cannot carry images")
        return {"text": text}, [], []
    else:
        raise BadSample("malformed_row", f"no text/caption/messages/conversations/texts field in keys {sorted(row)}")

    messages, repair = normalise_messages(messages, len(refs))
    if repair:
        log.repair(repair, where)
    images, sizes = [], []
    for ref in refs:
        data, ext, size, image_repair = check_image(image_bytes(ref, files), max_image_pixels)
        if image_repair:
            log.repair(image_repair, where)
        images.append((data, ext))
        sizes.append(size)
    return {"messages": messages}, images, sizes


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


def prepare(sources, out_dir, images=None, shard_size: int = 1000, max_bad_fraction: float = 0.05,
            max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, workers: int = 1) -> dict:
    """Write the shards of all `sources` ([KIND:]PATH) into `out_dir`, index them with Energon, return the stats."""
    out_dir = Path(out_dir)
    log = BadDataLog("prepare", max_bad_fraction)
    missing = [str(source) for _, source in map(parse_source, sources) if not source.exists()]
    if missing:  # before anything is written
        raise DataError(f"sources not found: {', '.join(missing)}")
    writer = ShardWriter(out_dir, shard_size)
    text_chars, images_per_sample, kinds, rejected_members = [], [], {"conversation": 0, "text": 0}, 0
    for kind, source in map(parse_source, sources):
        files = ImageFiles(images if images is not None else (source if source.is_dir() else source.parent))
        rejected_members += len(files.rejected_members)
        for where, row in tqdm(read_rows(source, log), desc=f"prepare {source.name}", unit="sample"):
            log.seen += 1
            try:
                if kind and not (isinstance(row, dict) and any(field in row for field in SOURCE_KINDS[kind])):
                    raise BadSample("malformed_row", f"a {kind} source row needs one of {SOURCE_KINDS[kind]}")
                sample, sample_images, _ = row_to_sample(row, files, max_image_pixels, log, where)
            except BadSample as e:
                log.skip(e.reason, where, e.detail)
                continue
            writer.write(sample, sample_images)
            kinds["text" if "text" in sample else "conversation"] += 1
            text_chars.append(len(sample["text"]) if "text" in sample else sum(len(m["content"]) for m in sample["messages"]))
            images_per_sample.append(len(sample_images))
    shards = writer.close()
    stats = {
        "sources": [str(s) for s in sources],
        "samples": writer.count,
        "samples_by_kind": kinds,
        "images": int(sum(images_per_sample)),
        "images_per_sample": summary(images_per_sample),
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
    parser.add_argument("--source", action="append", required=True, type=source_arg,
                        help="[KIND:]PATH of a source file or save_to_disk directory (repeatable); KIND: captions, conversations, text")
    parser.add_argument("--out", required=True, help="output dataset directory (data/<dataset>)")
    parser.add_argument("--images", type=existing_path, help="directory or tar file that relative image paths refer to (default: next to each source)")
    parser.add_argument("--shard-size", type=positive_int, default=1000, help="samples per tar shard")
    parser.add_argument("--max-bad-fraction", type=fraction, default=0.05, help="fail when more of the samples are bad")
    parser.add_argument("--workers", type=positive_int, default=1, help="processes for indexing the shards (energon prepare)")
    parser.add_argument("--max-image-pixels", type=positive_int, default=DEFAULT_MAX_IMAGE_PIXELS, help="larger images are skipped (decompression bombs)")


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        stats = prepare(args.source, args.out, args.images, args.shard_size, args.max_bad_fraction,
                        args.max_image_pixels, args.workers)
    except TooMuchBadData as e:
        logger.error("%s (details in %s/stats.json)", e, args.out)
        return 1
    except DataError as e:
        logger.error("%s", e)
        return 1
    print(json.dumps({k: stats[k] for k in ("samples", "images", "shards")} | {"skipped": stats["bad"]["skipped"]}))
    return 0
