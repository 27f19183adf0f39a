"""`vlmcore prepare`: the command line of `vlmcore.data.prepare.dataset.prepare`."""

import argparse
import json
import logging

from vlmcore.cli import existing_path, fraction, positive_int
from vlmcore.data.prepare.dataset import DEFAULT_MAX_IMAGE_PIXELS, prepare
from vlmcore.data.prepare.samples import DEFAULT_MAX_VIDEO_SECONDS
from vlmcore.data.prepare.sources import parse_source
from vlmcore.data.quality import run_stage

logger = logging.getLogger(__name__)


def source_arg(spec: str) -> str:
    existing_path(str(parse_source(spec)[1]))
    return spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source",
        action="append",
        required=True,
        type=source_arg,
        help="[KIND:]PATH of a source file or save_to_disk directory (repeatable); KIND: captions, conversations, text, preference, prompts",
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


def run(args: argparse.Namespace) -> int:
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
    printed = {k: stats[k] for k in ("samples", "images", "videos", "shards")}
    printed["skipped"] = stats["bad"]["skipped"]
    print(json.dumps(printed))
    return 0
