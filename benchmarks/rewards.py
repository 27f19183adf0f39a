"""What the reward workers cost (docs/post-training.md, "Rewards"): `vlmcore.rewards.RewardWorkers`
against the same rewards called in the trainer's process, on this machine.

    OMP_NUM_THREADS=1 python benchmarks/rewards.py
    OMP_NUM_THREADS=1 python benchmarks/rewards.py --completions 1 64 --repeats 2   # the test's

The rewards are `math` and `format` (weights 1 and 0.1: a typical GRPO recipe's) on completions of
about 500 characters (a reasoning block and a boxed fraction). For each batch size, the best of
--repeats batches: inline (the reward functions called in a loop here), through one worker (the
same work plus the transport: pickling, the socket, the progress writes; its excess over inline is
the overhead) and through two (on more cores than calls' worth of work, the batch's time halves).
Also timed: starting the pool of two and replacing a worker (what a timed-out or dead call costs
beyond its time limit). Prints a table and writes benchmarks/results/rewards.json ($OUT or --out).
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from vlmcore.rewards import REWARDS, RewardSpec, RewardWorkers

SPECS = [RewardSpec("math", 1.0), RewardSpec("format", 0.1)]


def batch(count: int) -> tuple[list[str], list[str], list[dict]]:
    reasoning = "Count the bars, then divide the shaded ones by all of them. " * 8
    completions = [
        f"<think>{reasoning}{i}</think><answer>\\boxed{{\\frac{{{i % 4}}}{{4}}}}</answer>" for i in range(count)
    ]
    answers = ["0.75"] * count
    samples = [{"choices": ["1/4", "1/2", "3/4", "1"], "image_size": [640, 480]}] * count
    return completions, answers, samples


def inline_time(completions: list[str], answers: list[str], samples: list[dict]) -> float:
    start = time.perf_counter()
    for completion, answer, sample in zip(completions, answers, samples):
        for spec in SPECS:
            REWARDS[spec.name](completion, answer, sample)
    return time.perf_counter() - start


def pool_time(pool: RewardWorkers, completions: list[str], answers: list[str], samples: list[dict]) -> float:
    start = time.perf_counter()
    pool.score(completions, answers, samples)
    return time.perf_counter() - start


def measure(sizes: list[int], repeats: int) -> dict:
    start = time.perf_counter()
    two = RewardWorkers(SPECS, workers=2, timeout_s=10.0)
    start_s = time.perf_counter() - start
    one = RewardWorkers(SPECS, workers=1, timeout_s=10.0)
    rows = []
    with one, two:
        for count in sizes:
            data = batch(count)
            inline = min(inline_time(*data) for _ in range(repeats))
            through_one = min(pool_time(one, *data) for _ in range(repeats))
            through_two = min(pool_time(two, *data) for _ in range(repeats))
            rows.append(
                {
                    "completions": count,
                    "inline_s": inline,
                    "one_worker_s": through_one,
                    "two_workers_s": through_two,
                    "overhead_us_per_completion": (through_one - inline) / count * 1e6,
                }
            )
        start = time.perf_counter()
        replacement = one.start_worker()
        one.wait_ready(replacement)
        replace_s = time.perf_counter() - start
        replacement.stop()
    return {"start_two_workers_s": start_s, "replace_worker_s": replace_s, "batches": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, nargs="+", default=[1, 64, 1024, 4096], help="batch sizes")
    parser.add_argument("--repeats", type=int, default=5, help="batches timed per size (the best counts)")
    parser.add_argument("--out", default=os.environ.get("OUT", str(Path(__file__).parent / "results")))
    args = parser.parse_args()
    result = measure(args.completions, args.repeats)
    print(f"reward workers, rewards {[spec.name for spec in SPECS]}, {os.cpu_count()} cores")
    print(f"start 2 workers {result['start_two_workers_s']:.3f} s, replace one {result['replace_worker_s']:.3f} s")
    print(f"{'completions':>12}{'inline ms':>12}{'1 worker ms':>14}{'2 workers ms':>14}{'overhead us/completion':>24}")
    for row in result["batches"]:
        print(
            f"{row['completions']:>12}{row['inline_s'] * 1e3:>12.2f}{row['one_worker_s'] * 1e3:>14.2f}"
            f"{row['two_workers_s'] * 1e3:>14.2f}{row['overhead_us_per_completion']:>24.1f}"
        )
    result.update(
        benchmark="rewards",
        rewards=[spec.name for spec in SPECS],
        python=sys.version.split()[0],
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
    )
    out = Path(args.out) / "rewards.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
