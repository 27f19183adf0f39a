"""Step time under context parallelism (issue 30): the real `vlmcore train` loop (torchrun, random
rows) of a Qwen3-VL-shaped model at each row length and cp size, one table and one JSON file.

    python benchmarks/cp_step.py                  # Qwen3-VL-8B's shape, rows of 32k/64k/128k, cp 1/2/4, every GPU
    python benchmarks/cp_step.py --model 2b       # Qwen3-VL-2B's shape
    python benchmarks/cp_step.py --lengths 131072 --cps 2 4   # part of the table (a command of limited time)
    python benchmarks/cp_step.py --video          # rows as the long-video recipes: one clip each
    python benchmarks/cp_step.py --tiny           # CPU: a tiny Qwen3-VL, rows of 256/512, cp 1/2, 2 gloo processes

Each case is `vlmcore train` for warmup + steps steps on --nproc ranks (default: every GPU of the
node): FSDP over dp_shard = nproc / cp, tp 1, full activation checkpointing, compiled (not
--tiny), bf16 compute over fp32 weights (fp32 on the CPU), module timers off. Each rank of a cp
group holds 1/cp of its row. The rows are `data.kind: random`: a document every ~8k tokens on
average (--doc-tokens; random lengths) and one 512x512 image (256 tokens) in the longest; with
--video, as in config/experiments/qwen3vl-*-128k/256k-*.yaml, one clip filling the row (frame
groups of 26x26 merged patches, as many as fit): each rank of a cp group encodes the frame groups
in its chunk (docs/hpc.md section 15, "Recipes"). Every weight is trained, the vision tower too.

The model is the architecture of benchmarks/recipe_models.py with random weights (normal, std
0.02), written once in bf16 to --cache (17 GB for the 8B) and reused. A case
that runs out of GPU memory is reported as such and the longer rows at that cp are skipped.
Step time and tokens/s per GPU (row tokens, each row counted once) are medians over the steps
after warmup from the run's metrics.jsonl; peak memory is rank 0's torch.cuda.max_memory_allocated
(on the CPU: the process's largest resident set). Prints the table after each case and writes
$OUT/cp_step_<device>_<model>[_video].json (benchmarks/results without $OUT), complete or not.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from common import (
    PRESETS,
    REPO,
    hf_config,
    print_table,
    read_metrics,
    src_env,
    torchrun,
    write_results,
    write_snapshot,
)

REPO_IDS = {"8b": "Qwen/Qwen3-VL-8B-Instruct", "2b": "Qwen/Qwen3-VL-2B-Instruct"}


def model_snapshot(model: str, path: Path) -> None:
    """config.json and random bf16 weights of the model (`tiny`: the tiny preset's Qwen3-VL)."""
    if (path / "config.json").is_file():
        return
    if model == "tiny":
        config = hf_config("qwen3_vl", PRESETS["tiny"])
    else:
        from recipe_models import MODELS

        config = MODELS[REPO_IDS[model]]()
    write_snapshot("qwen3_vl", config, path, on_meta=True, dtype=torch.bfloat16)


def data_config(args, seq_len: int) -> dict:
    if not args.video:
        return {
            "kind": "random",
            "seq_len": seq_len,
            "segments": max(1, seq_len // args.doc_tokens),
            "image_fraction": 1.0,
            "image_side": args.image_side,
        }
    # One clip of as many frame groups as fit: each its merged patches, a timestamp and markers.
    frames = (seq_len - 4) // (args.image_side**2 + 5)
    return {
        "kind": "random",
        "seq_len": seq_len,
        "segments": 1,
        "image_fraction": 0.0,
        "video_fraction": 1.0,
        "image_side": args.image_side,
        "video_frames": frames,
    }


def run_case(args, model_path: Path, seq_len: int, cp: int, gpu: bool) -> dict:
    """One `vlmcore train` run; its medians, or {"status": "out of memory"}."""
    out = args.work / f"run_{seq_len}_cp{cp}{'_video' if args.video else ''}"
    config = {
        "model_path": str(model_path),
        "output_dir": str(out),
        "steps": args.warmup + args.steps,
        "save_final": False,
        "checkpoint": {"enabled": False},
        "metrics": {"tensorboard": False, "module_times": False},
        "micro_batch_size": 1,
        "grad_accum_steps": 1,
        "optimizer": {"lr": 1e-5},
        "trainable": [],
        "parallel": {"cp": cp, "tp": 1, "dp_shard": -1, "activation_checkpointing": "full", "compile": args.compile},
        "precision": {"param_dtype": "bfloat16" if gpu else "float32"},
        "data": data_config(args, seq_len),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    config_file = out.with_suffix(".yaml")
    config_file.write_text(yaml.safe_dump(config))
    cmd = torchrun(args.nproc, "-m", "vlmcore.cli", "train", str(config_file))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=src_env(cpu=not gpu), check=False)
    case = {"seq_len": seq_len, "cp": cp, "dp_shard": args.nproc // cp, "wall_s": round(time.perf_counter() - start, 1)}
    if proc.returncode:
        if "OutOfMemoryError" in proc.stderr or "CUDA out of memory" in proc.stderr:
            return dict(case, status="out of memory")
        raise RuntimeError(f"vlmcore train at {seq_len} tokens, cp {cp} failed:\n{proc.stderr[-4000:]}")
    rows = read_metrics(out)[args.warmup :]
    return dict(
        case,
        status="ok",
        step_s=statistics.median(r["step_time_s"] for r in rows),
        tokens_per_s_per_gpu=statistics.median(r["tokens_per_s_per_device"] for r in rows),
        tflops_per_gpu=statistics.median(r["tflops_per_device"] for r in rows),
        peak_gib=max(r["peak_mem_gb"] for r in rows) * 1e9 / 2**30,
        data_wait_share=statistics.median(r["data_wait_s"] / r["step_time_s"] for r in rows),
    )


def print_cases(cases: list[dict], title: str) -> None:
    print(f"\n{title}")
    columns = [
        ("seq_len", ">8"),
        ("cp", ">4"),
        ("dp_shard", ">9"),
        ("step s", ">9.3f"),
        ("tokens/s/GPU", ">14,.0f"),
        ("TFLOP/s/GPU", ">13.1f"),
        ("peak GiB", ">10.1f"),
    ]
    figures = ("step_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "peak_gib")
    rows = []
    for c in cases:
        layout = [c["seq_len"], c["cp"], c["dp_shard"]]
        rows.append(layout + ([c[key] for key in figures] if c["status"] == "ok" else [f"  {c['status']}"]))
    print_table(columns, rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="CPU test scale: a tiny Qwen3-VL, rows of 256/512, "
        "cp 1/2 on 2 gloo processes, 2 steps after 1 warm-up step, eager",
    )
    parser.add_argument("--model", choices=REPO_IDS, default="8b", help="the published architecture to shape after")
    parser.add_argument("--lengths", type=int, nargs="+", help="row lengths (default: 32768 65536 131072)")
    parser.add_argument(
        "--cps", type=int, nargs="+", help="cp sizes (default: 1 2 4); those not dividing --nproc are left out"
    )
    parser.add_argument("--nproc", type=int, help="ranks (default: the GPUs of the node)")
    parser.add_argument("--steps", type=int, help="timed steps after the warm-up (default 5)")
    parser.add_argument("--warmup", type=int, help="steps before the timed ones: compile and allocator (default 3)")
    parser.add_argument("--doc-tokens", type=int, help="mean document length in a row (default 8192)")
    parser.add_argument(
        "--video", action="store_true", help="rows as the long-video recipes: one clip filling each row"
    )
    parser.add_argument("--eager", action="store_true", help="no torch.compile")
    parser.add_argument(
        "--cache", type=Path, help="where the model snapshot is written once (default: $TMPDIR/vlmcore_cp_step/<model>)"
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "benchmarks" / "results"))
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and not args.tiny
    model = "tiny" if args.tiny else args.model
    if args.tiny:
        scale = {"lengths": [256, 512], "cps": [1, 2], "nproc": 2, "steps": 2, "warmup": 1, "doc_tokens": 128}
    else:
        scale = {
            "lengths": [32768, 65536, 131072],
            "cps": [1, 2, 4],
            "nproc": torch.cuda.device_count(),
            "steps": 5,
            "warmup": 3,
            "doc_tokens": 8192,
        }
    for key, value in scale.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.nproc < 1:
        parser.error("no GPU here: give --nproc, or --tiny for the CPU")
    args.compile = gpu and not args.eager
    # Merged patches per side of the image or of each frame (32 x 32 pixels each): 512x512 images,
    # the recipes' worst-case frames.
    args.image_side = 2 if args.tiny else 26 if args.video else 16
    cps = [cp for cp in args.cps if args.nproc % cp == 0]
    cache = args.cache or Path(os.environ.get("TMPDIR", "/tmp")) / "vlmcore_cp_step" / model
    args.work = cache.parent / f"runs_{model}"
    device = torch.cuda.get_device_name() if gpu else f"CPU ({os.cpu_count()} cores)"
    rows = "one clip a row" if args.video else f"a document every ~{args.doc_tokens} tokens, an image"
    title = (
        f"{model} Qwen3-VL shape, {args.nproc} x {device}, {'compiled' if args.compile else 'eager'}, "
        f"full activation checkpointing, {rows}, median of {args.steps} steps after {args.warmup}"
    )
    started = time.perf_counter()
    model_snapshot(model, cache / "model")
    print(f"model snapshot: {cache / 'model'} ({time.perf_counter() - started:.0f} s)", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    result_file = args.out / f"cp_step_{'cuda' if gpu else 'cpu'}_{model}{'_video' if args.video else ''}.json"
    header = {
        "model": model,
        "device": device,
        "nproc": args.nproc,
        "compile": args.compile,
        "video": args.video,
        "doc_tokens": args.doc_tokens,
        "image_side": args.image_side,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    cases, out_of_memory = [], {}  # cp -> the shortest row that did not fit
    for cp in cps:
        for seq_len in sorted(args.lengths):
            if seq_len >= out_of_memory.get(cp, seq_len + 1):
                cases.append(
                    {
                        "seq_len": seq_len,
                        "cp": cp,
                        "dp_shard": args.nproc // cp,
                        "status": f"skipped ({out_of_memory[cp]} did not fit)",
                    }
                )
                continue
            cases.append(run_case(args, cache / "model", seq_len, cp, gpu))
            if cases[-1]["status"] == "out of memory":
                out_of_memory[cp] = seq_len
            print_cases(cases[-1:], f"{seq_len} tokens, cp {cp} ({cases[-1]['wall_s']:.0f} s)")
            write_results(result_file, dict(header, complete=False, cases=cases))
    cases.sort(key=lambda c: (c["seq_len"], c["cp"]))
    print_cases(cases, title)
    write_results(result_file, dict(header, complete=True, cases=cases))
    print(f"wrote {result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
