"""The write step of `vlmcore pack`: each pack of the plan as one webdataset sample (the format
of `vlmcore.data.pack.format`), its samples' json and images read back from the input shards by
offset; `workers` processes write an output shard each at a time."""

import json
import multiprocessing
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import webdataset
from tqdm import tqdm

from vlmcore.data.media.video import with_video_settings
from vlmcore.data.pack.format import (
    MODEL_FILES,
    PACK_MODEL_DIR,
    Segment,
    encode_pack,
    image_part_name,
    pack_key,
    shard_name,
    video_part_name,
)
from vlmcore.data.pack.measure import SAMPLE
from vlmcore.data.prepare.preference import preference_sides
from vlmcore.data.shards import video_part_names

MAX_OPEN_SHARDS = 64

_writing = {}  # what the writing processes read: set before they fork, so nothing is copied to them


def write_packs(
    out_dir: Path, plan: dict, shards: list[Path], shard_size: int, workers: int, group: tuple[int, int] = (0, 1)
) -> tuple[int, float]:
    """Each pack of the plan as one webdataset sample in `shard_size`-pack tar shards, written by
    `workers` processes; returns how many shards were written and their CPU seconds. Shards
    already written are skipped; `group` (g, n): only the shards whose index is g modulo n."""
    _writing.update(out_dir=out_dir, shards=shards, shard_size=shard_size, **plan)
    num_shards = (len(plan["starts"]) - 1 + shard_size - 1) // shard_size
    g, n = group
    jobs = [i for i in range(num_shards) if i % n == g and not (out_dir / shard_name(i)).is_file()]
    workers = min(workers, max(len(jobs), 1))
    mine = len(range(g, num_shards, n))
    progress = tqdm(desc=f"write ({workers} workers)", unit="shard", total=mine, initial=mine - len(jobs))
    cpu = 0.0
    try:
        if workers <= 1:
            for i in jobs:
                cpu += write_shard(i)
                progress.update()
        else:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                for shard_cpu in pool.imap_unordered(write_shard, jobs):
                    cpu += shard_cpu
                    progress.update()
    finally:
        progress.close()
        _writing.clear()
    return len(jobs), cpu


class InputShards:
    """Reads byte ranges of the input shards, keeping the most recently read MAX_OPEN_SHARDS open."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.open_files: OrderedDict[int, BinaryIO] = OrderedDict()

    def read(self, shard: int, offset: int, size: int) -> bytes:
        if shard in self.open_files:
            self.open_files.move_to_end(shard)
        else:
            if len(self.open_files) == MAX_OPEN_SHARDS:
                _, oldest = self.open_files.popitem(last=False)
                oldest.close()
            self.open_files[shard] = open(self.paths[shard], "rb")
        f = self.open_files[shard]
        f.seek(offset)
        return f.read(size)

    def close(self) -> None:
        for f in self.open_files.values():
            f.close()


def write_shard(index: int) -> float:
    """Output shard `index`: its packs, each sample's json and images read back by offset. Written
    to a .tmp file that is renamed once its bytes are on disk: a shard under its final name is
    complete, and a rerun after a kill writes only the others. Returns its CPU seconds."""
    start = time.process_time()
    shard_size = _writing["shard_size"]
    num_packs = len(_writing["starts"]) - 1
    first_pack = index * shard_size
    last_pack = min(first_pack + shard_size, num_packs)
    path = _writing["out_dir"] / shard_name(index)
    partial = path.with_name(path.name + ".tmp")
    inputs = InputShards(_writing["shards"])
    with open(partial, "wb") as f:
        # mtime 0: the same packs give the same bytes, whenever and by whichever job they are written
        with webdataset.TarWriter(f, mtime=0) as writer:
            for pack_index in range(first_pack, last_pack):
                writer.write(pack_record(pack_index, inputs))
        f.flush()
        os.fsync(f.fileno())
    partial.replace(path)
    inputs.close()
    return time.process_time() - start


def pack_record(pack_index: int, inputs: InputShards) -> dict:
    """The webdataset sample of one pack: its segments' parts, then its `json`."""
    starts = _writing["starts"]
    members = _writing["members"][starts[pack_index] : starts[pack_index + 1]].tolist()
    record = {"__key__": pack_key(pack_index)}
    segments = []
    for s, i in enumerate(members):
        segments += pair_segments(copy_segment(s, i, inputs, record), int(_writing["samples"][i]["rejected_tokens"]))
    record["json"] = encode_pack(segments)
    return record


def pair_segments(segment: Segment, rejected_tokens: int) -> list[Segment]:
    """A preference pair's stored sample (`rejected_tokens` > 0) as its two segments, chosen then
    rejected, with the same image and video parts; any other sample as it is."""
    if not rejected_tokens:
        return [segment]
    chosen, rejected = preference_sides(segment.sample)
    return [
        replace(segment, sample=chosen, num_tokens=segment.num_tokens - rejected_tokens, preference="chosen"),
        replace(segment, sample=rejected, num_tokens=rejected_tokens, preference="rejected"),
    ]


def copy_segment(s: int, i: int, inputs: InputShards, record: dict) -> Segment:
    """Segment `s` of a pack, the plan's sample `i`: its kept images' and videos' bytes copied into
    `record`, its json read back from its input shard."""
    measured = dict(zip(SAMPLE.names, _writing["samples"][i].tolist()))
    shard = measured["shard"]
    images = _writing["images"]
    first = measured["first_image"]
    kept = measured["kept_images"]
    sample = json.loads(inputs.read(shard, measured["json_offset"], measured["json_size"]))
    image_names = sample.pop("images", [])
    names = [image_part_name(s, k, name) for k, name in enumerate(image_names[:kept])]
    for name, (offset, size, _, _) in zip(names, images[first : first + kept].tolist()):
        record[name] = inputs.read(shard, offset, size)
    videos = copy_videos(s, sample.pop("videos", []), measured, inputs, record)
    key_offset = measured["key_offset"]
    key = _writing["keys"][key_offset : key_offset + measured["key_size"]].tobytes().decode()
    return Segment(
        key=key,
        sample=sample,
        image_sizes=[(w, h) for _, _, w, h in images[first : first + measured["num_images"]].tolist()],
        images=names,
        num_tokens=measured["tokens"],
        videos=videos,
        max_frames=measured["max_frames"] or None,
    )


def copy_videos(s: int, videos: list[dict], measured: dict, inputs: InputShards, record: dict) -> list[dict]:
    """Every video's metadata of segment `s`; the parts of the kept ones (they follow the images'
    rows in the plan) copied into `record` and named in their metadata."""
    images = _writing["images"]
    part = measured["first_image"] + measured["num_images"]
    out = []
    for k, video in enumerate(videos):
        old_names = video_part_names(video)
        entry = {key: value for key, value in video.items() if key not in ("part", "parts")}
        if k < measured["kept_videos"]:
            new_names = [video_part_name(s, k, j, name) for j, name in enumerate(old_names)]
            for name, (offset, size, _, _) in zip(new_names, images[part : part + len(old_names)].tolist()):
                record[name] = inputs.read(measured["shard"], offset, size)
            if entry["kind"] == "file":
                entry["part"] = new_names[0]
            else:
                entry["parts"] = new_names
        out.append(entry)
        part += len(old_names)
    return out


def copy_model_files(model_dir: Path, out_dir: Path, video: dict | None = None) -> None:
    """The files the loader encodes with, the video sampling settings of the pack in them."""
    target = out_dir / PACK_MODEL_DIR
    target.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, target / name)
    video_config = target / "video_preprocessor_config.json"
    if video and video_config.is_file():
        config = with_video_settings(json.loads(video_config.read_text()), video)
        video_config.write_text(json.dumps(config, indent=2) + "\n")
