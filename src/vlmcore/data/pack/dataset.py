"""`vlmcore pack`: a prepared dataset -> a packed Energon dataset of fixed-budget sequences.

Pass 1 measures every sample as the loader will encode it (vlmcore.data.pack.measure: tokens after
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

import json
import logging
import random
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from vlmcore.data.pack.bin_packing import best_fit_decreasing, packing_stats
from vlmcore.data.pack.format import STATS_FILE, PackConfig
from vlmcore.data.pack.measure import MeasuredShard, concatenate, inputs_identity, measure_shards
from vlmcore.data.pack.plan import PLAN_DIR, load_plan, save_plan
from vlmcore.data.pack.writer import copy_model_files, write_packs
from vlmcore.data.quality import BadDataLog, DataError, TooMuchBadData
from vlmcore.data.shards import energon_prepare, shard_paths

logger = logging.getLogger(__name__)

MEASURE_COUNTS = ("truncated", "dropped_overlong", "fewer_video_frames")


@dataclass
class PackJob:
    """The inputs, settings and working directories of one pack."""

    data_dir: Path
    model_dir: Path
    out_dir: Path
    seq_len: int
    max_patches: int
    overlong: str
    shard_size: int
    seed: int
    max_bad_fraction: float
    workers: int
    video: dict | None

    def __post_init__(self) -> None:
        self.shards = shard_paths(self.data_dir)
        # What the measurements depend on, and what the plan depends on besides.
        self.identity = inputs_identity(
            self.shards, self.model_dir, self.seq_len, self.max_patches, self.overlong, self.video
        )
        self.plan_identity = {**self.identity, "plan": [self.seed, self.shard_size, self.max_bad_fraction]}
        self.cache = self.out_dir.with_name(self.out_dir.name + ".measured")
        self.partial = self.out_dir.with_name(self.out_dir.name + ".partial")

    def measure(self, group: tuple[int, int] = (0, 1)) -> list[MeasuredShard]:
        return measure_shards(
            self.shards,
            self.model_dir,
            self.seq_len,
            self.max_patches,
            self.overlong,
            self.workers,
            self.cache,
            self.identity,
            group,
            self.video,
        )


def cpu_seconds() -> float:
    """CPU time of this process and of its finished child processes."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pack(
    data_dir: str | Path,
    model_dir: str | Path,
    out_dir: str | Path,
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
    job = PackJob(
        Path(data_dir),
        Path(model_dir),
        Path(out_dir),
        seq_len,
        max_patches,
        overlong,
        shard_size,
        seed,
        max_bad_fraction,
        max(1, workers),
        video,
    )
    if measure_group[1] > 1:
        start = time.perf_counter()
        job.measure(measure_group)
        logger.info("measure group %d of %d: done in %.1f s", *measure_group, time.perf_counter() - start)
        return {"measure_group": list(measure_group)}

    plan = load_plan(job.partial / PLAN_DIR, job.plan_identity)
    if plan is None:
        if write_group[1] > 1:
            raise DataError(
                f"{job.partial / PLAN_DIR}: no packing plan of these inputs and settings; "
                "make it first with vlmcore pack --plan-only"
            )
        make_plan(job)
        plan = load_plan(job.partial / PLAN_DIR, job.plan_identity)
    stats = json.loads((job.partial / STATS_FILE).read_text())
    if plan_only:
        return stats

    start = time.perf_counter()
    written, cpu = write_packs(job.partial, plan, job.shards, shard_size, job.workers, write_group)
    logger.info(
        "write: %d shards in %.1f s (%.1f CPU s in %d workers)", written, time.perf_counter() - start, cpu, job.workers
    )
    if write_group[1] > 1:
        return {"write_group": list(write_group)}
    del plan
    finish(job, stats)
    return stats


def make_plan(job: PackJob) -> None:
    """Measure every shard (what is not measured yet), pack the samples by best fit decreasing and
    save the plan and stats.json in `<out>.partial`; a pack with too much bad data keeps only its
    stats.json, under the output's name, and raises TooMuchBadData."""
    start = time.perf_counter()
    measured = job.measure()
    log = BadDataLog("pack", job.max_bad_fraction)
    for m in measured:
        log.seen += m.seen
        for bad in m.bad:
            log.skip(*bad)
    counts = {k: sum(m.counts[k] for m in measured) for k in MEASURE_COUNTS}
    samples, images, keys = concatenate(measured)
    logger.info(
        "measure: %d samples kept of %d in %.1f s (%.1f CPU s in %d workers), state %d bytes",
        len(samples),
        log.seen,
        time.perf_counter() - start,
        sum(m.cpu_seconds for m in measured),
        job.workers,
        samples.nbytes + images.nbytes + len(keys),
    )
    del measured

    shutil.rmtree(job.partial, ignore_errors=True)
    job.partial.mkdir(parents=True)
    tokens = samples["tokens"]
    patches = samples["patches"]
    start = time.perf_counter()
    cpu = time.process_time()
    bins = best_fit_decreasing(tokens, patches, job.seq_len, job.max_patches)
    logger.info(
        "best fit: %d packs in %.1f s (%.1f CPU s)", len(bins), time.perf_counter() - start, time.process_time() - cpu
    )
    # Packs leave BFD largest-first; shuffle so the stream does not start with all the long ones.
    random.Random(job.seed).shuffle(bins)
    stats = {
        "data": str(job.data_dir),
        "model": str(job.model_dir),
        "seq_len": job.seq_len,
        "max_patches": job.max_patches,
        "overlong": job.overlong,
        **packing_stats(bins, tokens, patches, job.seq_len, job.max_patches),
        **counts,
        "videos": int(samples["kept_videos"].sum()),
        # The longest clip's frame groups: `vlmcore memory` estimates a stage with a video that long.
        "video_groups": int(samples["video_groups"].max(initial=0)),
        # Preference pairs (DPO), each one of `samples` and two segments: `vlmcore train` refuses a DPO stage without.
        "pairs": int((samples["rejected_tokens"] > 0).sum()),
        "bad": log.as_dict(),
    }
    (job.partial / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    try:
        log.check()
        if not len(samples):
            raise TooMuchBadData(f"pack: no usable samples in {job.data_dir}")
    except TooMuchBadData:
        replace_dir(
            job.partial, job.out_dir
        )  # only stats.json, to explain the failure: no reader takes it for a dataset
        shutil.rmtree(job.cache)
        raise
    save_plan(job.partial / PLAN_DIR, job.plan_identity, samples, images, keys, bins)
    shutil.rmtree(job.cache)  # the plan holds all it needs


def finish(job: PackJob, stats: dict) -> None:
    """The written packs made a dataset: the model files and pack_config.json beside them, the
    shards indexed, `<out>.partial` renamed to the output and the working files removed."""
    for leftover in job.partial.glob("shard-*.tar.tmp"):  # of a writer killed before the rerun that wrote its shard
        leftover.unlink()
    copy_model_files(job.model_dir, job.partial, job.video)
    PackConfig(job.seq_len, job.max_patches, job.video, stats["video_groups"]).write(job.partial)
    start = time.perf_counter()
    cpu = cpu_seconds()
    energon_prepare(job.partial, job.workers)
    logger.info(
        "index: %d packs in %.1f s (%.1f CPU s)", stats["packs"], time.perf_counter() - start, cpu_seconds() - cpu
    )
    shutil.rmtree(job.partial / PLAN_DIR)
    replace_dir(job.partial, job.out_dir)
    shutil.rmtree(job.cache, ignore_errors=True)  # of measure jobs rerun after the plan was made


def replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an old `target` is moved aside first and deleted after."""
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)
