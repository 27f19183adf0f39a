"""`vlmcore synth`: write the image or the video demo dataset."""

import argparse
import json

from vlmcore.cli import UsageError, non_negative_int, positive_int
from vlmcore.data.synthetic import image, video

# (min_size, max_size) when not given: image sides, or square video frames.
DEFAULT_SIZES = {"image": (32, 112), "video": (64, 64)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory (raw/)")
    parser.add_argument(
        "--kind",
        choices=["image", "video"],
        default="image",
        help="image: shapes in pictures; video: a shape that moves, changes colour or jumps (vlmcore.data.synthetic.video)",
    )
    parser.add_argument("--num-train", type=positive_int, default=512, help="number of training images or clips")
    parser.add_argument("--num-eval", type=non_negative_int, default=96, help="number of held-out eval questions")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument(
        "--min-size", type=positive_int, help="smallest image or frame side in pixels (default: 32 images, 64 frames)"
    )
    parser.add_argument(
        "--max-size", type=positive_int, help="largest image or frame side in pixels (default: 112 images, 64 frames)"
    )


def run(args: argparse.Namespace) -> int:
    default_min, default_max = DEFAULT_SIZES[args.kind]
    min_size = args.min_size or default_min
    max_size = args.max_size or default_max
    if not 8 <= min_size <= max_size:
        raise UsageError(f"--min-size, --max-size: must satisfy 8 <= min <= max, got {min_size}, {max_size}")
    generate = image.generate if args.kind == "image" else video.generate
    try:
        meta = generate(args.out, args.num_train, args.num_eval, args.seed, min_size, max_size)
    except ValueError as e:
        raise UsageError(f"--min-size, --max-size: {e}") from e
    print(json.dumps(meta))
    return 0
