"""What the memory levers cost in step time: `vlmcore train` on random data with FSDP2 as it is,
with `parallel.offload: true` (the shards, gradients and AdamW state in host memory, AdamW on the
CPU) and with `optimizer.moments_dtype: bfloat16`, on the same ranks; the median step time of each
run's metrics.jsonl after its warmup steps, and the peak memory `vlmcore memory` estimates for each
(device and host).

    python benchmarks/memory_levers.py                          # CPU: a small Qwen3, 2 ranks on gloo
    python benchmarks/memory_levers.py --device cuda --nproc 4 --repo-id Qwen/Qwen3-VL-8B-Instruct \\
        --seq-len 8192 --out benchmarks/results/memory_levers_cuda_h100_8b.json     # one GPU node

On CPU the offload's copies are copies within host memory, so the CPU row measures FSDP2's
offload path (its extra copies and the CPU AdamW it runs anyway), not the PCIe or NVLink-C2C
transfers of a GPU node; the GPU command measures those. `--repo-id` builds the published
architecture (benchmarks/recipe_models.py) with random weights. Prints a table and writes
benchmarks/results/memory_levers_<device>.json (or --out).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
CASES = {
    "fsdp": {},
    "offload": {"parallel": {"offload": True, "one_rank_cast": False}},
    "bf16_moments": {"optimizer": {"moments_dtype": "bfloat16"}},
}
TINY = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)


def snapshot(root: Path, repo_id: str | None) -> Path:
    """The model's config.json (no weights: the run starts from random init)."""
    path = root / "model"
    if repo_id:
        from recipe_models import MODELS  # benchmarks/ is on sys.path: this is a script there

        MODELS[repo_id]().save_pretrained(path)
    else:
        import transformers

        transformers.Qwen3Config(**TINY, tie_word_embeddings=False).save_pretrained(path)
        for weights in path.glob("*.safetensors"):
            weights.unlink()
    return path


def stage_config(root: Path, model: Path, name: str, args: argparse.Namespace) -> Path:
    cfg = {
        "model_path": str(model),
        "output_dir": str(root / name),
        "steps": args.warmup + args.steps,
        "micro_batch_size": 1,
        "optimizer": {"lr": 1.0e-4},
        "checkpoint": {"enabled": False},
        "save_final": False,
        "metrics": {"tensorboard": False},
        "data": {"kind": "random", "seq_len": args.seq_len, "segments": 2, "image_fraction": 0.5},
        "precision": {"param_dtype": "bfloat16" if args.device == "cuda" else "float32"},
    }
    for section, values in CASES[name].items():
        cfg.setdefault(section, {}).update(values)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(config: Path, nproc: int) -> None:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run([*launch, "-m", "vlmcore.cli", "train", str(config)], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{config}: vlmcore train failed:\n{proc.stderr[-3000:]}")


def estimate(config: Path, nproc: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-m", "vlmcore.cli", "memory", str(config), "--world-size", str(nproc)]
        proc = subprocess.run([*command, "--json", out.name], capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"{config}: vlmcore memory failed:\n{proc.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--repo-id", help="a published architecture (benchmarks/recipe_models.py); default: a small Qwen3"
    )
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = snapshot(root, args.repo_id)
        for name in CASES:
            config = stage_config(root, model, name, args)
            train(config, args.nproc)
            lines = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
            times = [m["step_time_s"] for m in lines[args.warmup :]]
            peak = estimate(config, args.nproc)
            rows.append(
                {
                    "case": name,
                    "median_step_s": round(statistics.median(times), 4),
                    "device_peak_gib": round(peak["peak_bytes"] / 2**30, 3),
                    "host_gib": round(peak.get("host_bytes", 0) / 2**30, 3),
                }
            )
    base = rows[0]["median_step_s"]
    print(f"{'case':<14}{'step s':>10}{'x fsdp':>8}{'device GiB':>12}{'host GiB':>10}")
    for row in rows:
        row["step_ratio"] = round(row["median_step_s"] / base, 3)
        print(
            f"{row['case']:<14}{row['median_step_s']:>10.4f}{row['step_ratio']:>8.2f}"
            f"{row['device_peak_gib']:>12.3f}{row['host_gib']:>10.3f}"
        )
    machine = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {os.cpu_count()} cores"
    result = {
        "machine": machine,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "nproc": args.nproc,
        "model": args.repo_id or "small Qwen3 (benchmarks/memory_levers.py TINY)",
        "seq_len": args.seq_len,
        "rows": rows,
    }
    out = args.out or REPO / "benchmarks" / "results" / f"memory_levers_{args.device}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
