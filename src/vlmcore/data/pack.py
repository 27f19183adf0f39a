"""`vlmcore pack`: a prepared dataset -> a packed Energon dataset of fixed-budget sequences.

Pass 1 measures every sample as the loader will encode it (vlmcore.data.measure: tokens after
image-token expansion, image patches, the overlong policy; about 75 bytes a sample in memory).
The samples are then packed by best fit decreasing under `seq_len` tokens and `max_patches` image
patches, and the packs saved as arrays (the plan).
Pass 2 copies each pack's samples into one webdataset sample (`json` = the segments, plus the
images), their json and images read back from the input shards by offset; `workers` processes
write an output shard each at a time. Tokenization happens again in the loader (crude samples).

The packed dataset carries a copy of the model's tokenizer/processor files under `model/`, so
the loader encodes exactly as measured here. stats.json reports efficiency, drops and truncations.
Everything is written into `<out>.partial` and renamed to `<out>` at the end, so a killed pack
never leaves a directory that looks finished. A killed pack resumes: each shard's measurements
are kept in `<out>.measured` until the plan is made, the plan in `<out>.partial/plan` until the
pack is done, and an output shard gets its name only once it is complete. The same steps, split
into jobs (`--measure-group`, `--plan-only`, `--write-group`), are the workflow's scatter of a
pack over CPU jobs (docs/hpc.md section 12).
"""

import argparse
import json
import logging
import multiprocessing
import os
import random
import resource
import shutil
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import webdataset
from tqdm import tqdm

from vlmcore.cli import UsageError, existing_dir, fraction, non_negative_int, positive_int
from vlmcore.data.bin_packing import best_fit_decreasing, packing_stats
from vlmcore.data.measure import MODEL_FILES, concatenate, inputs_identity, measure_shards, video_part_names
from vlmcore.data.quality import BadDataLog, DataError, TooMuchBadData, run_stage
from vlmcore.data.shards import energon_prepare, shard_paths
from vlmcore.data.video import VIDEO_KEYS, with_video_settings

logger = logging.getLogger(__name__)

PACK_MODEL_DIR = "model"
MAX_OPEN_SHARDS = 64
PLAN_DIR = "plan"  # in <out>.partial: the packing plan, until the pack is done
PLAN_ARRAYS = ("samples", "images", "keys", "members", "starts")


def save_plan(
    plan_dir: Path, identity: dict, samples: np.ndarray, images: np.ndarray, keys: bytes, bins: list[list[int]]
) -> None:
    """The packs as arrays: pack p holds the samples members[starts[p]:starts[p + 1]], each
    described by its row in `samples`. plan.json, written last, says the plan is complete and
    which inputs and settings it was made from."""
    plan_dir.mkdir(parents=True)
    starts = np.zeros(len(bins) + 1, np.int64)
    np.cumsum([len(b) for b in bins], out=starts[1:])
    members = np.fromiter((i for b in bins for i in b), np.int64, len(samples))
    arrays = dict(samples=samples, images=images, keys=np.frombuffer(keys, np.uint8), members=members, starts=starts)
    for name in PLAN_ARRAYS:
        np.save(plan_dir / f"{name}.npy", arrays[name])
    (plan_dir / "plan.tmp").write_text(json.dumps(identity))
    (plan_dir / "plan.tmp").replace(plan_dir / "plan.json")


def load_plan(plan_dir: Path, identity: dict) -> dict | None:
    """The plan's arrays (memory-mapped: writing processes share them), or None when there is no
    complete plan made from these inputs and settings."""
    stamp = plan_dir / "plan.json"
    if not stamp.is_file() or json.loads(stamp.read_text()) != identity:
        return None
    return {name: np.load(plan_dir / f"{name}.npy", mmap_mode="r") for name in PLAN_ARRAYS}


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
    jobs = [i for i in range(num_shards) if i % n == g and not (out_dir / f"shard-{i:06d}.tar").is_file()]
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


def write_shard(index: int) -> float:
    """Output shard `index`: its packs, each sample's json and images read back by offset. Written
    to a .tmp file that is renamed once its bytes are on disk: a shard under its final name is
    complete, and a rerun after a kill writes only the others."""
    start = time.process_time()
    samples, images, keys = _writing["samples"], _writing["images"], _writing["keys"]
    members, starts = _writing["members"], _writing["starts"]
    open_shards = OrderedDict()  # the most recently read MAX_OPEN_SHARDS input shards

    def read(shard: int, offset: int, size: int) -> bytes:
        if shard in open_shards:
            open_shards.move_to_end(shard)
        else:
            if len(open_shards) == MAX_OPEN_SHARDS:
                open_shards.popitem(last=False)[1].close()
            open_shards[shard] = open(_writing["shards"][shard], "rb")
        f = open_shards[shard]
        f.seek(offset)
        return f.read(size)

    path = _writing["out_dir"] / f"shard-{index:06d}.tar"
    first_pack = index * _writing["shard_size"]
    with open(path.with_name(path.name + ".tmp"), "wb") as f:
        # mtime 0: the same packs give the same bytes, whenever and by whichever job they are written
        with webdataset.TarWriter(f, mtime=0) as writer:
            for pack_index in range(first_pack, min(first_pack + _writing["shard_size"], len(starts) - 1)):
                record = {"__key__": f"{pack_index:09d}"}
                segments = []
                for s, i in enumerate(members[starts[pack_index] : starts[pack_index + 1]].tolist()):
                    (
                        shard,
                        json_offset,
                        json_size,
                        key_offset,
                        key_size,
                        first,
                        num,
                        kept,
                        tokens,
                        _,
                        _,
                        kept_videos,
                        max_frames,
                        _,
                    ) = samples[i].tolist()
                    sample = json.loads(read(shard, json_offset, json_size))
                    image_names = sample.pop("images", [])
                    names = [f"s{s}_img{k}.{name.rsplit('.', 1)[-1]}" for k, name in enumerate(image_names[:kept])]
                    for name, (offset, size, _, _) in zip(names, images[first : first + kept].tolist()):
                        record[name] = read(shard, offset, size)
                    # Every video's metadata (the text holds all their tags; truncation drops the
                    # later ones again in the loader), the parts of the kept ones, which follow
                    # the images' rows.
                    videos, part = [], first + num
                    for k, video in enumerate(sample.pop("videos", [])):
                        old = video_part_names(video)
                        video = {key: value for key, value in video.items() if key not in ("part", "parts")}
                        if k < kept_videos:
                            new = [f"s{s}_vid{k}_{j:05d}.{name.rsplit('.', 1)[-1]}" for j, name in enumerate(old)]
                            for name, (offset, size, _, _) in zip(new, images[part : part + len(old)].tolist()):
                                record[name] = read(shard, offset, size)
                            video.update({"part": new[0]} if video["kind"] == "file" else {"parts": new})
                        videos.append(video)
                        part += len(old)
                    segments.append(
                        {
                            "key": keys[key_offset : key_offset + key_size].tobytes().decode(),
                            "sample": sample,
                            "image_sizes": [(w, h) for _, _, w, h in images[first : first + num].tolist()],
                            "images": names,
                            **({"videos": videos, "max_frames": max_frames or None} if videos else {}),
                            "num_tokens": tokens,
                        }
                    )
                record["json"] = json.dumps({"segments": segments}).encode()
                writer.write(record)
        f.flush()
        os.fsync(f.fileno())
    path.with_name(path.name + ".tmp").replace(path)
    for f in open_shards.values():
        f.close()
    return time.process_time() - start


def cpu_seconds() -> float:
    """CPU time of this process and of its finished child processes."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def copy_model_files(model_dir: Path, out_dir: Path, video: dict | None = None) -> None:
    """The files the loader encodes with, the video sampling settings of the pack in them."""
    target = out_dir / PACK_MODEL_DIR
    target.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, target / name)
    video_config = target / "video_preprocessor_config.json"
    if video and video_config.is_file():
        video_config.write_text(
            json.dumps(with_video_settings(json.loads(video_config.read_text()), video), indent=2) + "\n"
        )


def pack(
    data_dir,
    model_dir,
    out_dir,
    seq_len: int,
    max_patches: int,
    overlong: str = "truncate",
    shard_size: int = 1000,
    seed: int = 0,
    max_bad_fraction: float = 0.05,
    workers: int = 1,
    measure_group: tuple[int, int] = (0, 1),
    plan_only: bool = False,
    write_group: tuple[int, int] = (0, 1),
    video: dict | None = None,
) -> dict:
    """Packs the prepared dataset `data_dir` into `out_dir`, in steps that the workflow runs as
    separate jobs; each resumes where a killed one stopped, and any split gives the same bytes:

    - measure: with `measure_group` (g, n), n > 1, only that share of the shards, into
      `<out_dir>.measured` (see `measure_shards`), then return;
    - plan: all measurements packed at once (best fit) into `<out_dir>.partial/plan`, unless a plan
      of the same inputs and settings is there; with `plan_only`, return its stats;
    - write: the plan's output shards not written yet; with `write_group` (g, n), n > 1, only those
      whose index is g modulo n, then return;
    - finish: index the output and rename `<out_dir>.partial` to `out_dir`."""
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    data_dir, model_dir, out_dir = Path(data_dir), Path(model_dir), Path(out_dir)
    shards = shard_paths(data_dir)
    workers = max(1, workers)
    identity = inputs_identity(shards, model_dir, seq_len, max_patches, overlong, video)
    plan_identity = {**identity, "plan": [seed, shard_size, max_bad_fraction]}
    cache = out_dir.with_name(out_dir.name + ".measured")
    partial = out_dir.with_name(out_dir.name + ".partial")
    start = time.perf_counter()
    if measure_group[1] > 1:
        measure_shards(
            shards, model_dir, seq_len, max_patches, overlong, workers, cache, identity, measure_group, video
        )
        logger.info("measure group %d of %d: done in %.1f s", *measure_group, time.perf_counter() - start)
        return {"measure_group": list(measure_group)}

    plan = load_plan(partial / PLAN_DIR, plan_identity)
    if plan is None:
        if write_group[1] > 1:
            raise DataError(
                f"{partial / PLAN_DIR}: no packing plan of these inputs and settings; "
                "make it first with vlmcore pack --plan-only"
            )
        measured = measure_shards(
            shards, model_dir, seq_len, max_patches, overlong, workers, cache, identity, video=video
        )
        log = BadDataLog("pack", max_bad_fraction)
        for m in measured:
            log.seen += m.seen
            for bad in m.bad:
                log.skip(*bad)
        counts = {
            k: sum(m.counts[k] for m in measured) for k in ("truncated", "dropped_overlong", "fewer_video_frames")
        }
        samples, images, keys = concatenate(measured)
        logger.info(
            "measure: %d samples kept of %d in %.1f s (%.1f CPU s in %d workers), state %d bytes",
            len(samples),
            log.seen,
            time.perf_counter() - start,
            sum(m.cpu_seconds for m in measured),
            workers,
            samples.nbytes + images.nbytes + len(keys),
        )
        del measured

        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        tokens, patches = samples["tokens"], samples["patches"]
        start, cpu = time.perf_counter(), time.process_time()
        bins = best_fit_decreasing(tokens, patches, seq_len, max_patches)
        logger.info(
            "best fit: %d packs in %.1f s (%.1f CPU s)",
            len(bins),
            time.perf_counter() - start,
            time.process_time() - cpu,
        )
        # Packs leave BFD largest-first; shuffle so the stream does not start with all the long ones.
        random.Random(seed).shuffle(bins)
        stats = {
            "data": str(data_dir),
            "model": str(model_dir),
            "seq_len": seq_len,
            "max_patches": max_patches,
            "overlong": overlong,
            **packing_stats(bins, tokens, patches, seq_len, max_patches),
            **counts,
            "videos": int(samples["kept_videos"].sum()),
            # The longest clip's frame groups: `vlmcore memory` estimates a stage with a video that long.
            "video_groups": int(samples["video_groups"].max(initial=0)),
            "bad": log.as_dict(),
        }
        (partial / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        try:
            log.check()
            if not len(samples):
                raise TooMuchBadData(f"pack: no usable samples in {data_dir}")
        except TooMuchBadData:
            replace_dir(partial, out_dir)  # only stats.json, to explain the failure: no reader takes it for a dataset
            shutil.rmtree(cache)
            raise
        save_plan(partial / PLAN_DIR, plan_identity, samples, images, keys, bins)
        del samples, images, keys, bins, tokens, patches
        shutil.rmtree(cache)  # the plan holds all it needs
        plan = load_plan(partial / PLAN_DIR, plan_identity)
    stats = json.loads((partial / "stats.json").read_text())
    if plan_only:
        return stats

    start = time.perf_counter()
    written, cpu = write_packs(partial, plan, shards, shard_size, workers, write_group)
    logger.info(
        "write: %d shards in %.1f s (%.1f CPU s in %d workers)", written, time.perf_counter() - start, cpu, workers
    )
    if write_group[1] > 1:
        return {"write_group": list(write_group)}
    del plan
    for leftover in partial.glob("shard-*.tar.tmp"):  # of a writer killed before the rerun that wrote its shard
        leftover.unlink()
    copy_model_files(model_dir, partial, video)
    (partial / "pack_config.json").write_text(
        json.dumps(
            {
                "seq_len": seq_len,
                "max_patches": max_patches,
                **({"video": video} if video else {}),
                **({"video_groups": stats["video_groups"]} if stats["video_groups"] else {}),
            }
        )
        + "\n"
    )
    start, cpu = time.perf_counter(), cpu_seconds()
    energon_prepare(partial, workers)
    logger.info(
        "index: %d packs in %.1f s (%.1f CPU s)", stats["packs"], time.perf_counter() - start, cpu_seconds() - cpu
    )
    shutil.rmtree(partial / PLAN_DIR)
    replace_dir(partial, out_dir)
    shutil.rmtree(cache, ignore_errors=True)  # of measure jobs rerun after the plan was made
    return stats


def replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an old `target` is moved aside first and deleted after."""
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def job_group(text: str) -> tuple[int, int]:
    """`G/N` with 0 <= G < N."""
    g, sep, n = text.partition("/")
    if not (sep and g.isdigit() and n.isdigit() and int(g) < int(n)):
        raise argparse.ArgumentTypeError(f"must be G/N with 0 <= G < N, got {text!r}")
    return int(g), int(n)


def video_settings(args) -> dict | None:
    """The `--video-*` settings given, by the video processor's names."""
    return {
        key: getattr(args, f"video_{key}") for key in VIDEO_KEYS if getattr(args, f"video_{key}") is not None
    } or None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, type=existing_dir, help="prepared Energon dataset (data/<dataset>)")
    parser.add_argument(
        "--model",
        required=True,
        type=existing_dir,
        help="model snapshot directory (tokenizer, chat template, processor)",
    )
    parser.add_argument("--out", required=True, help="output packed dataset directory (packed/<dataset>)")
    parser.add_argument("--seq-len", type=positive_int, required=True, help="tokens per packed sequence")
    parser.add_argument(
        "--max-patches",
        type=non_negative_int,
        required=True,
        help="image patches per packed sequence (vision tower budget)",
    )
    parser.add_argument(
        "--overlong",
        choices=["truncate", "drop"],
        default="truncate",
        help="what to do with samples longer than --seq-len",
    )
    parser.add_argument("--shard-size", type=positive_int, default=1000, help="packs per tar shard")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the pack order")
    parser.add_argument("--max-bad-fraction", type=fraction, default=0.05, help="fail when more of the samples are bad")
    step = parser.add_mutually_exclusive_group()  # the workflow's split of a pack into jobs; none: the whole pack
    step.add_argument(
        "--measure-group",
        type=job_group,
        default=(0, 1),
        metavar="G/N",
        help="only measure the shards whose index is G modulo N into <out>.measured, for a later pack "
        "(the workflow's scatter of the measure pass over N jobs)",
    )
    step.add_argument(
        "--plan-only",
        action="store_true",
        help="only measure what is left and pack all samples into the plan in <out>.partial/plan",
    )
    step.add_argument(
        "--write-group",
        type=job_group,
        default=(0, 1),
        metavar="G/N",
        help="only write the plan's output shards whose index is G modulo N into <out>.partial "
        "(the workflow's scatter of the writing over N jobs; a plain pack then finishes)",
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=os.cpu_count(),
        help="measuring, writing and indexing processes (measuring: at most one per shard)",
    )
    video = parser.add_argument_group("video sampling (default: the model's video processor settings)")
    video.add_argument("--video-fps", type=float, help="frames sampled per second of video")
    video.add_argument("--video-min-frames", type=positive_int, help="frames sampled at least")
    video.add_argument(
        "--video-max-frames", type=positive_int, help="frames sampled at most (a clip too long for a row gets fewer)"
    )
    video.add_argument(
        "--video-min-pixels", type=positive_int, help="pixels of all sampled frames of a clip together, at least"
    )
    video.add_argument(
        "--video-max-pixels", type=positive_int, help="pixels of all sampled frames of a clip together, at most"
    )


def run(args) -> int:
    if Path(args.out).resolve() == Path(args.data).resolve():
        raise UsageError("--out: must not be --data (its shards would be replaced)")
    stats = run_stage(
        lambda: pack(
            args.data,
            args.model,
            args.out,
            args.seq_len,
            args.max_patches,
            args.overlong,
            args.shard_size,
            args.seed,
            args.max_bad_fraction,
            args.workers,
            args.measure_group,
            args.plan_only,
            args.write_group,
            video_settings(args),
        ),
        args.out,
        logger,
    )
    if stats is None:
        return 1
    if "measure_group" not in stats and "write_group" not in stats:
        stats = {k: stats[k] for k in ("packs", "samples", "efficiency", "truncated", "dropped_overlong")}
    print(json.dumps(stats))
    return 0
