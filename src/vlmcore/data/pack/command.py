"""`vlmcore pack`: the command line of `vlmcore.data.pack.dataset.pack`."""

import argparse
import json
import logging
import os
from pathlib import Path

from vlmcore.cli import UsageError, existing_dir, fraction, non_negative_int, positive_int
from vlmcore.data.media.video import VIDEO_KEYS
from vlmcore.data.pack.dataset import pack
from vlmcore.data.quality import run_stage

logger = logging.getLogger(__name__)


def job_group(text: str) -> tuple[int, int]:
    """`G/N` with 0 <= G < N."""
    g, sep, n = text.partition("/")
    if not (sep and g.isdigit() and n.isdigit() and int(g) < int(n)):
        raise argparse.ArgumentTypeError(f"must be G/N with 0 <= G < N, got {text!r}")
    return int(g), int(n)


def video_settings(args: argparse.Namespace) -> dict | None:
    """The `--video-*` settings given, by the video processor's names."""
    given = {key: getattr(args, f"video_{key}") for key in VIDEO_KEYS}
    return {key: value for key, value in given.items() if value is not None} or None


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
    add_step_arguments(parser)
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=os.cpu_count(),
        help="measuring, writing and indexing processes (measuring: at most one per shard)",
    )
    add_video_arguments(parser)


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The workflow's split of a pack into jobs; none of them: the whole pack."""
    step = parser.add_mutually_exclusive_group()
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


def add_video_arguments(parser: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
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
