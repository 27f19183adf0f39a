"""The cost of naming stragglers (docs/hpc.md section 6): `vlmcore.train.resilience.StragglerWatch`'s
gather, one all_gather of 2 floats per rank every resilience.straggler_interval steps, timed on
gloo ranks of this machine.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/straggler_gather.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/straggler_gather.py --gathers 20  # the test's

Each repetition is one gather step (interval 1: every call gathers), after a barrier so that the
ranks start together: the time is the collective's own, not a wait for a late rank. Prints a
table (median and 90th percentile per gather, and per step at intervals 1, 10 and 100) and writes
benchmarks/results/straggler_gather_<n>ranks.json ($OUT or --out).
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vlmcore.config import ResilienceConfig
from vlmcore.train.resilience import StragglerWatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gathers", type=int, default=500, help="timed gathers")
    parser.add_argument("--out", default=os.environ.get("OUT", str(Path(__file__).parent / "results")))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    watch = StragglerWatch(ResilienceConfig(straggler_interval=1, collective_timeout_s=600))
    times = []
    for step in range(1, args.gathers + 11):
        dist.barrier()
        start = time.perf_counter()
        watch.after_step(step, step_s=0.5, wait_s=0.1)
        if step > 10:  # the first gathers warm the connections up
            times.append(time.perf_counter() - start)
    mine = torch.tensor(times)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    if dist.get_rank() == 0:
        slowest = torch.stack(gathered).max(dim=0).values.tolist()  # a gather costs the step its slowest rank's time
        median = statistics.median(slowest)
        p90 = statistics.quantiles(slowest, n=10)[-1]
        print(
            f"straggler gather, {dist.get_world_size()} gloo ranks, {len(slowest)} gathers, torch {torch.__version__}"
        )
        print(f"{'':24}{'median':>12}{'p90':>12}")
        print(f"{'one gather (us)':24}{median * 1e6:12.0f}{p90 * 1e6:12.0f}")
        for interval in (1, 10, 100):
            print(
                f"{f'per step, interval {interval} (us)':24}{median * 1e6 / interval:12.1f}{p90 * 1e6 / interval:12.1f}"
            )
        result = {
            "benchmark": "straggler_gather",
            "world_size": dist.get_world_size(),
            "backend": "gloo",
            "gathers": len(slowest),
            "median_s": median,
            "p90_s": p90,
            "torch": torch.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        }
        out = Path(args.out) / f"straggler_gather_{dist.get_world_size()}ranks.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
