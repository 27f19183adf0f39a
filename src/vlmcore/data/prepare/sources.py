"""The sources `vlmcore prepare` reads: their rows (JSONL, a JSON list, parquet, a
`datasets.save_to_disk` directory) and the images and videos the rows refer to (files under a
directory or in a tar file, raw bytes, base64, `data:` URIs)."""

import base64
import binascii
import json
import logging
import tarfile
from collections.abc import Iterator
from pathlib import Path

from vlmcore.data.quality import BadDataLog, BadSample, DataError, decode_utf8, load_json, safe_relative_path

logger = logging.getLogger(__name__)

SOURCE_KINDS = {
    "captions": ("caption",),
    "conversations": ("messages", "conversations", "texts"),
    "text": ("text",),
    "preference": ("chosen", "rejected"),  # vlmcore.data.prepare.preference
    "prompts": ("question", "prompt"),  # online RL: vlmcore.data.prepare.prompts
}


def parse_source(spec: str) -> tuple[str | None, Path]:
    """`[KIND:]PATH` -> (kind or None, path)."""
    kind, sep, path = str(spec).partition(":")
    if sep and kind in SOURCE_KINDS:
        return kind, Path(path)
    return None, Path(spec)


class ImageFiles:
    """Images referenced by path: files under a directory, or members of a tar file."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.tar = None
        self.members = {}
        self.rejected_members = []
        if self.root.is_file():
            self.open_tar()

    def open_tar(self) -> None:
        """Index the tar file's members; a file cut short keeps the members before the cut."""
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
                self.root,
                len(self.members),
                e,
            )
        if self.rejected_members:
            logger.warning(
                "%s: rejected %d tar members leaving the archive: %s",
                self.root,
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


def read_rows(path: Path, log: BadDataLog) -> Iterator[tuple[str, object]]:
    """Yield (where, row) for every row of a source; unreadable rows are counted and skipped."""
    if path.is_dir() or path.suffix == ".parquet":
        return arrow_rows(path)
    if path.suffix == ".jsonl":
        return jsonl_rows(path, log)
    if path.suffix == ".json":
        return json_rows(path)
    raise DataError(
        f"{path}: unknown source type (expected .jsonl, .json, .parquet or a datasets.save_to_disk directory)"
    )


def arrow_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """The rows of a parquet file or a `datasets.save_to_disk` directory, as raw Arrow rows: image
    features arrive undecoded, as {"bytes", "path"} dicts."""
    try:
        if path.is_dir():
            import datasets

            batches = datasets.load_from_disk(str(path)).data.table.to_batches(max_chunksize=256)
        else:
            import pyarrow.parquet as pq

            batches = pq.ParquetFile(path).iter_batches(batch_size=256)
    except (OSError, ValueError) as e:  # ArrowInvalid is a ValueError
        what = "datasets directory" if path.is_dir() else "parquet file"
        raise DataError(f"{path}: not a readable {what}: {e}") from e
    rows = (row for batch in batches for row in batch.to_pylist())
    for i, row in enumerate(rows):
        yield f"{path}[{i}]", row


def jsonl_rows(path: Path, log: BadDataLog) -> Iterator[tuple[str, object]]:
    """The rows of a JSONL file; a line that is not UTF-8 JSON is counted as bad and skipped."""
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


def json_rows(path: Path) -> Iterator[tuple[str, object]]:
    """The rows of a .json file holding one list of rows."""
    try:
        rows = json.loads(decode_utf8(path.read_bytes()))
    except (BadSample, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a readable UTF-8 JSON file: {e}") from e
    if not isinstance(rows, list):
        raise DataError(f"{path}: a .json source must hold a list of rows")
    for i, row in enumerate(rows):
        yield f"{path}[{i}]", row


def decode_base64(text: str, bad_reason: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as e:
        raise BadSample(bad_reason, f"bad base64: {e}") from e


def image_bytes(ref: object, files: ImageFiles, what: str = "image") -> bytes:
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
        if ref.startswith("data:"):
            return decode_base64(ref.split(",", 1)[-1], bad)
        return files.read(ref, what)
    raise BadSample(f"missing_{what}", f"unsupported {what} reference {type(ref).__name__}")
