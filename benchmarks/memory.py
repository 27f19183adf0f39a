"""Peak memory per device of the 2B-class training configs, estimated without a GPU.

    python benchmarks/memory.py        # writes benchmarks/results/memory_2b.json

Each row is `vlmcore memory` (vlmcore.train.memory): a training step of the model of the `2b` preset
(benchmarks/common.py, as benchmarks/train_step.py runs it), holding the optimizer state from its
start, parallelized for the given world size, run on fake tensors, with torch's FSDP2 memory tracker
counting every live tensor on rank 0. The batch is the one train_step.py measures on a GPU: one row
of 8,192 packed tokens, 16 samples, for Qwen3-VL one 512x512 image (1,024 patches); bf16 compute
over fp32 weights and AdamW state. On one rank each configuration twice: with the one-rank cast
(`parallel.one_rank_cast`, the default: no FSDP units, bf16 copies of all weights held through the
step) and with FSDP2's units over the one rank (one block's copy at a time).
"""

import argparse
import sys
import tempfile
from pathlib import Path

from common import PRESETS, hf_config, write_results

from vlmcore.config import TrainConfig
from vlmcore.train.memory import estimate_memory

ROWS = [  # family, world size, activation checkpointing, compiled blocks
    ("qwen3", 1, "none", False),
    ("qwen3", 1, "none", True),
    ("qwen3", 1, "selective", False),
    ("qwen3", 1, "full", False),
    ("qwen3_vl", 1, "none", False),
    ("qwen3_vl", 1, "none", True),
    ("qwen3_vl", 1, "selective", False),
    ("qwen3_vl", 1, "full", False),
    ("qwen3_vl", 8, "none", False),
    ("qwen3_vl", 8, "selective", False),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "memory_2b.json")
    args = parser.parse_args()
    preset = PRESETS["2b"]
    results = []
    print(
        f"{'family':<10}{'ranks':>6}{'AC':>11}{'compiled':>9}{'one rank':>10}{'params':>9}{'gathered':>10}"
        f"{'grads':>8}{'optim':>8}{'activ.':>8}{'other':>8}{'peak GiB':>10}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for (family, world, ac, compiled), one_rank_cast in (
            (row, cast) for row in ROWS for cast in ((True, False) if row[1] == 1 else (True,))
        ):
            path = Path(tmp) / family
            hf_config(family, preset).save_pretrained(path)  # the config is all it needs: no weights
            cfg = TrainConfig(model_path=str(path), loss_chunk_tokens=2048)
            cfg.precision.param_dtype = "bfloat16"
            cfg.parallel.activation_checkpointing = ac
            cfg.parallel.compile = compiled
            cfg.parallel.one_rank_cast = one_rank_cast
            cfg.data.segments = preset["seq_len"] // 512
            r = estimate_memory(cfg, world, preset["seq_len"], preset["image_side"])
            one_rank = ("cast" if one_rank_cast else "fsdp2") if world == 1 else "-"
            results.append(dict(r, family=family, one_rank=one_rank))
            kinds = dict(r["peak_bytes_by_kind"])

            def gib(*names, kinds=kinds):
                return sum(kinds.pop(n, 0) for n in names) / 2**30

            cols = [
                gib("Sharded Param"),
                gib("Unsharded Param", "All Gather"),
                gib("Sharded Grad", "Unsharded Grad", "Reduce Scatter"),
                gib("OptState"),
                gib("Activation"),
            ]
            cols.append(sum(kinds.values()) / 2**30)
            print(
                f"{family:<10}{world:>6}{ac:>11}{'yes' if compiled else 'no':>9}{one_rank:>10}"
                + "".join(f"{c:>{w}.1f}" for c, w in zip(cols, (9, 10, 8, 8, 8, 8)))
                + f"{r['peak_bytes'] / 2**30:>10.1f}",
                flush=True,
            )
    write_results(args.out, {"preset": "2b", "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
