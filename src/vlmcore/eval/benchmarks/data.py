"""Reading a staged benchmark: the files of its Hugging Face dataset repository as they are.

The staging rule downloads each benchmark of eval.tasks into `<benchmark data>/<name>/` (the
repository's parquet or JSON files and its media archives); `vlmcore eval --benchmark-data DIR`
points here. Nothing is converted or unpacked: the question tables are read with pyarrow (the
`datasets` features in their metadata decode the images), and the videos are read straight out
of the zip archives they ship in.

`datasets` and pyarrow are imported where a table is read: the benchmark modules import this
one, and the workflow's planning reads their records without reading any table.
"""

from __future__ import annotations

import functools
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

    from vlmcore.eval.benchmarks.benchmark import Benchmark

TABLE_SUFFIXES = (".parquet", ".json", ".jsonl")


class BadBenchmarkData(ValueError):
    """A benchmark's staged data that cannot be evaluated (absent, incomplete, or not the
    benchmark's: a table without a field it reads): `vlmcore eval` prints it as one line, before
    the model loads."""


class MissingBenchmarkData(BadBenchmarkData):
    """A benchmark's staged data is absent or incomplete."""


def staged_dir(benchmark_data: str | Path | None, benchmark: Benchmark) -> Path:
    """`<benchmark data>/<task>`, checked to exist."""
    task = benchmark.name
    if not benchmark_data:
        raise MissingBenchmarkData(
            f"{task}: no benchmark data directory; pass `vlmcore eval --benchmark-data DIR` "
            f"(the directory the benchmark staging rule fills: DIR/{task}/)"
        )
    directory = Path(benchmark_data) / task
    if not directory.is_dir():
        raise MissingBenchmarkData(
            f"{task}: {directory} does not exist; stage the benchmark on the login node first "
            f"(the staging rule downloads {benchmark.hf_repo} there)"
        )
    return directory


def name_matches(path: Path, directory: Path, name: str) -> bool:
    """Whether a repository file belongs to a config or split `name`: a folder of that name, or a
    file name that is the name or starts with it (`validation-00000-of-00001.parquet`)."""
    relative = path.relative_to(directory)
    stem = relative.name.split(".")[0]
    return (
        name in relative.parts[:-1] or stem == name or re.match(rf"{re.escape(name)}[-_.]", relative.name) is not None
    )


def table_files(directory: Path, benchmark: Benchmark, config: str | None) -> list[Path]:
    """The question files of one config and the benchmark's split, in name order."""
    files = sorted(
        path
        for path in directory.rglob("*")
        if path.suffix in TABLE_SUFFIXES and path.is_file() and ".cache" not in path.parts
    )
    if config:
        files = [path for path in files if name_matches(path, directory, config)]
    with_split = [path for path in files if name_matches(path, directory, benchmark.split)]
    # MVBench's files are named by config alone (json/<task>.json): its only split is all of them.
    files = with_split or ([] if len(benchmark.configs) < 2 else files)
    if not files:
        raise MissingBenchmarkData(
            f"{benchmark.name}: no {'/'.join(TABLE_SUFFIXES)} file of split {benchmark.split!r}"
            + (f" and config {config!r}" if config else "")
            + f" under {directory}"
        )
    return files


def read_table(path: Path) -> datasets.Dataset:
    """One question file: parquet with its `datasets` features (images decode to PIL), or JSON rows."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        return datasets.Dataset(pq.read_table(path))
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = json.loads(text)
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise BadBenchmarkData(f"{path}: expected a list of question objects")
    return datasets.Dataset(pa.Table.from_pylist(rows))


def read_questions(directory: Path, benchmark: Benchmark, config: str | None = None) -> datasets.Dataset:
    """All questions of the benchmark's split (of one config when given)."""
    tables = [read_table(path) for path in table_files(directory, benchmark, config)]
    return concatenate(tables)


def concatenate(tables: list[datasets.Dataset]) -> datasets.Dataset:
    import datasets

    return tables[0] if len(tables) == 1 else datasets.concatenate_datasets(tables)


def check_fields(rows: datasets.Dataset, benchmark: Benchmark, where: Path) -> None:
    """Raises BadBenchmarkData naming the task and the fields its questions under `where` lack."""
    missing = [name for name in benchmark.fields if name not in rows.column_names]
    if missing:
        raise BadBenchmarkData(
            f"{benchmark.name}: the questions under {where} have no field {', '.join(missing)} "
            f"(they have {', '.join(rows.column_names)}); is this the {benchmark.hf_repo} data?"
        )


def read_split(directory: Path, benchmark: Benchmark) -> datasets.Dataset:
    """A benchmark's questions: the table of its split (of its first config), its fields checked."""
    rows = read_questions(directory, benchmark, benchmark.configs[0] if benchmark.configs else None)
    check_fields(rows, benchmark, directory)
    return rows


@dataclass(frozen=True)
class MediaFile:
    """A file the questions refer to: a plain file, or a member of a zip archive."""

    path: str
    member: str | None = None

    def read_bytes(self) -> bytes:
        if self.member is None:
            return Path(self.path).read_bytes()
        with zipfile.ZipFile(self.path) as archive:
            return archive.read(self.member)

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")


@functools.lru_cache(maxsize=8)
def media_index(directory: Path) -> dict[str, list[MediaFile]]:
    """Every media file under a staged benchmark, plain or in a zip, by its file name (a name may
    occur in several folders: MVBench's sources reuse names)."""
    index = {}
    for path in sorted(directory.rglob("*")):
        if not path.is_file() or ".cache" in path.parts or path.suffix in TABLE_SUFFIXES:
            continue
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                members = [name for name in archive.namelist() if not name.endswith("/")]
            for member in members:
                index.setdefault(Path(member).name, []).append(MediaFile(str(path), member))
        else:
            index.setdefault(path.name, []).append(MediaFile(str(path)))
    return index


def find_media(directory: Path, relative: str, folder: str = "") -> MediaFile | None:
    """The media file whose path ends with `folder/relative` (or just `relative`), else None."""
    candidates = media_index(directory).get(Path(relative).name, [])
    for suffix in (f"{folder}/{relative}".strip("/"), relative):
        for media in candidates:
            if (media.member or media.path).endswith(suffix):
                return media
    return None
