"""Webdataset tar shards: writing them, reading them back safely, and `energon prepare`.

Every sample in a vlmcore shard is a `json` part plus its images as `img<k>.<ext>` parts and its
videos as `vid<k>.<ext>` (a file) or `vid<k>_<j>.<ext>` (frames) parts; the JSON names the image
parts in order under `"images"`, and each video's metadata and parts under `"videos"`. The
prepared dataset and the packed one are both such shards, indexed by `energon prepare`; every
stage reads them through this module.
"""

import bisect
import contextlib
import io
import json
import struct
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import webdataset

from vlmcore.data.quality import BadSample, DataError, safe_relative_path


class ShardWriter:
    """`webdataset.ShardWriter` writing `shard-000000.tar`, ... into `out_dir`."""

    def __init__(self, out_dir: str | Path, shard_size: int) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for old in self.out_dir.glob("shard-*.tar*"):
            old.unlink()
        self.writer = webdataset.ShardWriter(str(self.out_dir / "shard-%06d.tar"), maxcount=shard_size, verbose=0)
        self.count = 0

    def write(self, sample: dict, images: list[tuple[bytes, str]], videos: list[tuple[list, dict]] = ()) -> None:
        """One sample: its json with the part names of its `images` [(bytes, ext)] and, if any, its
        `videos` [([(bytes, ext)], metadata)]: a file as one part, a clip given as frames one part a frame."""
        names = [f"img{k}.{ext}" for k, (_, ext) in enumerate(images)]
        parts = dict(zip(names, (data for data, _ in images)))
        entries = []
        for k, (files, meta) in enumerate(videos):
            if meta["kind"] == "file":
                ((data, ext),) = files
                entries.append({**meta, "part": f"vid{k}.{ext}"})
                parts[entries[-1]["part"]] = data
            else:
                entries.append({**meta, "parts": [f"vid{k}_{j:05d}.{ext}" for j, (_, ext) in enumerate(files)]})
                parts.update(zip(entries[-1]["parts"], (data for data, _ in files)))
        record = {
            "__key__": f"{self.count:09d}",
            "json": json.dumps({**sample, "images": names, **({"videos": entries} if entries else {})}).encode(),
        }
        self.writer.write({**record, **parts})
        self.count += 1

    def close(self) -> list[str]:
        self.writer.close()
        return sorted(p.name for p in self.out_dir.glob("shard-*.tar"))


def video_part_names(video: dict) -> list[str]:
    """The shard parts of one of a sample's videos: its file, or its frames."""
    return [video["part"]] if video["kind"] == "file" else list(video["parts"])


def energon_prepare(dataset_dir: str | Path, workers: int = 1) -> None:
    """Index the shards with `energon prepare`, non-interactively, as a crude dataset."""
    from megatron.energon.tools.prepare import command

    args = [
        str(dataset_dir), "--non-interactive", "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset",
        "--force-overwrite", "--num-workers", str(workers), "--no-progress",
    ]  # fmt: skip
    output = io.StringIO()  # its sample preview goes to stdout; keep it for errors only
    try:
        with contextlib.redirect_stdout(output):
            command.main(args, standalone_mode=False)
    except Exception as e:
        raise RuntimeError(f"energon prepare {dataset_dir} failed: {e}\n{output.getvalue()[-4000:]}") from e


def shard_paths(dataset_dir: str | Path) -> list[Path]:
    """The shards of a prepared dataset, in the order `energon prepare` recorded, each checked to be
    as long as its index says: a missing, empty or truncated shard is refused here, by name, not
    met as a bare tarfile error halfway through a stage."""
    from megatron.energon.flavors.webdataset.itar import TarIndexReader

    dataset_dir = Path(dataset_dir)
    info = dataset_dir / ".nv-meta" / ".info.json"
    if not info.is_file():
        raise DataError(f"{dataset_dir} is not a prepared Energon dataset (no .nv-meta/.info.json)")
    shards = [dataset_dir / name for name in json.loads(info.read_text())["shard_counts"]]
    for shard in shards:
        if not shard.is_file():
            raise DataError(f"{shard}: missing; write the dataset again")
        end = 1  # where the last sample ends: from the index `energon prepare` wrote, else not empty
        if shard.with_suffix(".tar.idx").is_file():
            with TarIndexReader(shard) as offsets:
                end = offsets[len(offsets) - 1] if len(offsets) else 0
        if shard.stat().st_size < end:
            raise DataError(
                f"{shard}: truncated ({shard.stat().st_size} bytes, its samples end at {end}); write the dataset again"
            )
    return shards


@dataclass
class Part:
    offset: int
    size: int


@dataclass
class ShardSample:
    shard: Path
    key: str
    parts: dict[str, Part]
    data: dict[str, bytes]
    unsafe_names: list[str]


def split_member_name(name: str) -> tuple[str, str]:
    """Webdataset naming: `dir/key.part.ext` -> (`dir/key`, `part.ext`)."""
    head, _, base = name.rpartition("/")
    key, _, part = base.partition(".")
    return (f"{head}/{key}" if head else key), part


def iter_shard_samples(shard: Path) -> Iterator[ShardSample]:
    """Yield the samples of one tar in order, with their parts read into memory.

    Member names that are absolute or climb out of the dataset directory are recorded in
    `unsafe_names`; callers reject such samples. Nothing is ever extracted to disk. A tar that
    cannot be read on (damaged, cut short) raises DataError naming the shard.
    """
    read = 0
    try:
        with tarfile.open(shard, "r:") as tar:
            sample = None
            for member in tar:
                if not member.isfile():
                    continue
                key, part = split_member_name(member.name)
                if sample is None or key != sample.key:
                    if sample is not None:
                        yield sample
                        read += 1
                    sample = ShardSample(shard, key, {}, {}, [])
                try:
                    safe_relative_path(member.name)
                except BadSample:
                    sample.unsafe_names.append(member.name)
                sample.parts[part] = Part(member.offset_data, member.size)
                sample.data[part] = tar.extractfile(member).read()
            if sample is not None:
                yield sample
                read += 1
            tar.fileobj.seek(tar.offset)  # tarfile ends quietly at a bad header: the end must be zeros
            if tar.fileobj.read(tarfile.BLOCKSIZE).strip(b"\0"):
                raise tarfile.ReadError(f"no valid tar header at byte {tar.offset}")
    except (tarfile.TarError, OSError) as e:
        raise DataError(
            f"{shard}: unreadable after {read} samples ({type(e).__name__}: {e}); "
            "the shard is damaged or cut short, write it again"
        ) from e


class IndexedShards:
    """Random access to the samples of a prepared dataset by their index (shard after shard, in
    the order `energon prepare` recorded), through the `.tar.idx` offsets it wrote: a sample costs
    one 16-byte index read and one read of its own bytes, whatever its position."""

    def __init__(self, dataset_dir: str | Path) -> None:
        self.dataset_dir = Path(dataset_dir)
        self.shards = shard_paths(self.dataset_dir)
        counts = json.loads((self.dataset_dir / ".nv-meta" / ".info.json").read_text())["shard_counts"]
        self.starts = [0]
        for shard in self.shards:
            self.starts.append(self.starts[-1] + counts[shard.name])
        self._open = {}  # shard -> (index file, tar file), per process

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict:  # loader workers open their own files
        return {**self.__dict__, "_open": {}}

    def read(self, i: int) -> dict:
        """Sample i as a crude dict: `__key__` and its parts' bytes by part name (`json`, `img0.png`...)."""
        if not 0 <= i < len(self):
            raise IndexError(f"{self.dataset_dir}: sample {i} of {len(self)}")
        s = bisect.bisect_right(self.starts, i) - 1
        if s not in self._open:
            shard = self.shards[s]
            self._open[s] = (open(shard.with_suffix(".tar.idx"), "rb"), open(shard, "rb"))
        index, tar = self._open[s]
        index.seek(8 * (i - self.starts[s]))
        start, end = struct.unpack("<QQ", index.read(16))
        tar.seek(start)
        sample = {}
        try:
            with tarfile.open(fileobj=io.BytesIO(tar.read(end - start)), mode="r:") as members:
                for member in members:
                    if member.isfile():
                        sample["__key__"], part = split_member_name(member.name)
                        sample[part] = members.extractfile(member).read()
        except tarfile.TarError as e:
            raise DataError(
                f"{self.shards[s]}: sample {i - self.starts[s]} unreadable ({e}); the shard is damaged, write it again"
            ) from e
        if "__key__" not in sample:
            raise DataError(f"{self.shards[s]}: sample {i - self.starts[s]} is empty; the shard is damaged")
        return sample
