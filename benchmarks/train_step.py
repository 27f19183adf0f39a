"""Training-step throughput: vlmcore's engine vs transformers, same model, same packed batch,
same AdamW, one device; and vlmcore's real training loop (`vlmcore train` on random data).

    python benchmarks/train_step.py --preset tiny --family qwen3_vl       # CPU
    python benchmarks/train_step.py --preset 2b --family qwen3_vl --compile   # one GPU, bf16
    python benchmarks/train_step.py --preset 2b --all    # the whole table: Qwen3-VL and Qwen3,
                                                         # eager and compiled, bare step, real loop
    python benchmarks/train_step.py --preset tiny --family qwen3_vl_moe   # mixture of experts, CPU
    python benchmarks/train_step.py --preset 30b-a3b --all   # Qwen3-VL-30B-A3B's shape, 4 layers, one GPU

vlmcore runs its real step (`vlmcore.train.step`: on GPU over one rank the bf16 compute copies of
`vlmcore.parallel.fsdp.OneRankMixedPrecision`, or FSDP2's units with `--one-rank-fsdp2`; on CPU
in fp32 a plain module; chunked cross-entropy, gradient clipping at norm 1, AdamW, one host
read); transformers runs `model(**batch, labels=...)` + `loss.backward()` + clipping at norm 1
(HF Trainer's default) + the same AdamW (fused, CPU included), in bf16 autocast over fp32
weights on GPU. The real loop runs
`vlmcore train` for warmup + steps steps and takes the median step time of its metrics.jsonl.
Prints a table and writes benchmarks/results/train_step_<device>_<preset>_<family>.json
(`--all`: train_step_<device>_<preset>_all[_<family>].json, one row per case, for the next run to
compare). `--all` prints and writes each case as it finishes, compiled cases first, so a run cut
short keeps what it measured ("complete": false); `--all --family F` runs one family's part, to
split the table over shorter runs. One snapshot per family; `vlmcore memory`'s estimate of each
case (compiled or eager, as the case) runs on the CPU beside the GPU cases, one at a time. On a
GPU machine: `pip install --no-deps -e .` over its CUDA torch (docs/performance.md).
"""

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, wait
from pathlib import Path

import torch
from common import (
    DENSE,
    MOE,
    PRESETS,
    hf_config,
    read_metrics,
    release_device_memory,
    train_config,
    write_results,
    write_snapshot,
)


def time_steps(step_fn, warmup: int, steps: int, device: torch.device) -> float:
    """Median seconds per step (robust to a shared, noisy machine). On CPU the clock is the
    process's CPU time, which other jobs on a shared machine do not inflate (with
    OMP_NUM_THREADS=1 it is the compute time); on CUDA it is wall time between synchronizations."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    for _ in range(warmup):
        step_fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = clock()
        step_fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(clock() - start)
    return statistics.median(times)


def peak_memory_gib(device: torch.device) -> float | None:
    """What the tensors held at most (bytes counted as `vlmcore memory` counts them)."""
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def case_tag(family: str, args) -> str:
    return f"{family}{'_compile' if args.compile else ''}"


def bench_vlmcore(cfg, host_batch, device, args, family: str):
    import torch.distributed as dist

    from vlmcore.models import load_hf_config
    from vlmcore.parallel.checks import check_run
    from vlmcore.parallel.mesh import init_distributed
    from vlmcore.train.build import build_run, check_kernels
    from vlmcore.train.metrics_log import batch_flops
    from vlmcore.train.step import to_device

    init_distributed(device)
    check_kernels(cfg, device)
    run = build_run(cfg, check_run(cfg, dist.get_world_size(), load_hf_config(cfg.model_path)), device)
    flops = sum(batch_flops(run.model.config, host_batch))
    labels = host_batch.label_tokens
    batch = to_device(host_batch, device, run.context)

    def step():
        run.step([batch], labels, set_lr=lambda optimizer: None)

    seconds = time_steps(step, args.warmup, args.steps, device)
    result = {"step_s": seconds, "peak_mem_gib": peak_memory_gib(device), "flops_per_step": flops}
    if args.profile:  # two more steps, traced as the loop's metrics.profile_steps traces them
        from vlmcore.train.profiling import StepProfiler

        profiler = StepProfiler([1, 2], args.out / f"profile_bare_{case_tag(family, args)}", 0, device)
        for n in (1, 2):
            profiler.step_starts(n)
            step()
            profiler.step_ended(n)
    run = None  # frees the model before the process group goes
    dist.destroy_process_group()
    return result


def bench_loop(cfg, device, args, seq_len: int, image_side: int, family: str) -> dict:
    """`vlmcore train` on random batches like the bare step's: median step time after warmup."""
    import shutil
    import subprocess

    import yaml

    out = Path(cfg.output_dir).parent / f"loop_{family}_{int(args.compile)}"
    config = {
        "model_path": cfg.model_path,
        "output_dir": str(out),
        "steps": args.warmup + args.steps,
        "save_final": False,
        "checkpoint": {"enabled": False},
        "metrics": {"tensorboard": False},
        "loss_chunk_tokens": cfg.loss_chunk_tokens,
        "max_grad_norm": cfg.max_grad_norm,
        "optimizer": {"lr": cfg.optimizer.lr},
        "parallel": {
            "compile": args.compile,
            "activation_checkpointing": args.activation_checkpointing,
            "one_rank_cast": not args.one_rank_fsdp2,
        },
        "precision": {"param_dtype": cfg.precision.param_dtype},
        # The random rows are made by loader workers and pinned, as the packed loader's are: the
        # loop's data wait is then the loader's, not the time to draw random pixels.
        "num_workers": 2,
        "data": {
            "kind": "random",
            "seq_len": seq_len,
            "segments": max(1, seq_len // 512),
            "image_fraction": 1.0,
            "image_side": image_side,
        },
    }
    if args.profile:  # the (at most two) steps after the warmup
        config["metrics"]["profile_steps"] = [args.warmup + 1, args.warmup + min(2, args.steps)]
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.yaml").write_text(yaml.safe_dump(config))
    overrides = [a for setting in args.loop_set for a in ("--set", setting)]
    proc = subprocess.run(
        [sys.executable, "-m", "vlmcore.cli", "train", str(out.parent / f"{out.name}.yaml"), *overrides],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(f"vlmcore train failed:\n{proc.stderr[-3000:]}")
    if args.profile:
        shutil.copytree(out / "profile", args.out / f"profile_loop_{case_tag(family, args)}", dirs_exist_ok=True)
    rows = read_metrics(out)[args.warmup :]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in rows),
        "peak_mem_gib": max(r["peak_mem_gb"] for r in rows) * 1e9 / 2**30 if device.type == "cuda" else None,
        "data_wait_share": statistics.median(r["data_wait_s"] / r["step_time_s"] for r in rows),
    }


def bench_transformers(path, batch, device, args, family: str, image_token_id):
    import transformers

    cls = (
        transformers.AutoModelForCausalLM
        if family in ("qwen3", "qwen3_moe")
        else transformers.AutoModelForImageTextToText
    )
    model = cls.from_pretrained(path, dtype=torch.float32).to(device)
    model.train()
    if args.compile:
        model.compile()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    # transformers shifts labels itself: give it the unshifted targets.
    labels = torch.full_like(batch.labels, -100)
    labels[:, 1:] = batch.labels[:, :-1]
    inputs = {"input_ids": batch.input_ids, "labels": labels}
    if family in MOE:  # the load-balancing loss in the loss, as vlmcore's step has it
        inputs["output_router_logits"] = True
    if batch.images is not None:
        inputs.update(
            pixel_values=batch.images.pixel_values,
            image_grid_thw=batch.images.grid_thw,
            mm_token_type_ids=(batch.input_ids == image_token_id).int(),
        )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)  # as HF Trainer (max_grad_norm) and vlmcore
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = time_steps(step, args.warmup, args.steps, device)
    result = {"step_s": seconds, "peak_mem_gib": peak_memory_gib(device)}
    model = optimizer = None  # frees them before the next case
    return result


def step_config(args, path: Path, output_dir: Path, device: torch.device):
    cfg = train_config(path, output_dir, device, args.compile)
    cfg.parallel.activation_checkpointing = args.activation_checkpointing
    cfg.parallel.one_rank_cast = not args.one_rank_fsdp2
    return cfg


def case_args(args: argparse.Namespace, compiled: bool) -> argparse.Namespace:
    """The arguments of one case of the table: the command's, with its compile setting."""
    return argparse.Namespace(**dict(vars(args), compile=compiled))


def estimate_peak_gib(args, family: str, path: Path, device_type: str) -> float | None:
    """`vlmcore memory`'s estimate of the bare step's peak (its blocks compiled with --compile). The MoE
    estimate is of the experts' bf16 grouped GEMM: none for an fp32 (CPU) MoE run."""
    from vlmcore.train.memory import estimate_memory

    if device_type != "cuda" and family in MOE:
        return None
    if device_type == "cuda":  # beside the timed GPU cases: leave their process half the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    preset = PRESETS[args.preset]
    seq_len = args.seq_len or preset["seq_len"]
    cfg = step_config(args, path, path.parent / "estimate", torch.device(device_type))
    estimate = estimate_memory(cfg, 1, seq_len, preset["image_side"], segments=max(1, seq_len // 512))
    return estimate["peak_bytes"] / 2**30


def run_case(args, family: str, path: Path, device: torch.device) -> dict:
    """Bare step (vlmcore, transformers) and the real loop of one family, on one batch."""
    import transformers

    from vlmcore.train.random_data import RandomBatches

    preset = PRESETS[args.preset]
    seq_len = args.seq_len or preset["seq_len"]
    started = time.perf_counter()
    cfg = step_config(args, path, path.parent / f"out_{family}_{int(args.compile)}", device)
    model_config = transformers.AutoConfig.from_pretrained(path)
    batch = RandomBatches(
        model_config,
        seq_len=seq_len,
        segments=max(1, seq_len // 512),
        image_fraction=1.0,
        micro_batch_size=1,
        dp_rank=0,
        dp_world=1,
        grad_accum_steps=1,
        seed=0,
        image_side=preset["image_side"],
    ).batch(0)
    results = {"vlmcore": bench_vlmcore(cfg, batch, device, args, family)}
    print(f"{family} bare step: {json.dumps(results['vlmcore'])}", flush=True)
    release_device_memory(device)
    flops = results["vlmcore"]["flops_per_step"]
    if not args.skip_transformers:
        device_batch = batch.map_tensors(lambda t: t.to(device))
        results["transformers"] = bench_transformers(
            path, device_batch, device, args, family, getattr(model_config, "image_token_id", None)
        )
        del device_batch
        release_device_memory(device)
    if not args.skip_loop:
        results["vlmcore train"] = bench_loop(cfg, device, args, seq_len, preset["image_side"], family)
    from vlmcore.train.metrics_log import peak_tflops

    peak = peak_tflops(device, None)
    tokens = batch.tokens
    for r in results.values():
        r["tokens_per_s"] = tokens / r["step_s"]
        r["tflops"] = flops / r["step_s"] / 1e12
        r["mfu"] = 100 * r["tflops"] / peak if peak else None
    return {
        "family": family,
        "compile": args.compile,
        "tokens": tokens,
        "flops_per_step": flops,
        "results": results,
        "wall_s": time.perf_counter() - started,
    }


def print_rows(cases: list[dict], name: str, preset: str) -> None:
    print(f"{preset} preset, {name}, torch {torch.__version__}")
    print(
        f"{'family':<13}{'compile':>8}  {'engine':<15}{'step s':>9}{'tokens/s':>11}{'TFLOPS':>9}{'MFU %':>7}"
        f"{'peak GiB':>9}{'est GiB':>8}{'vs HF':>7}"
    )
    for case in cases:
        hf = case["results"].get("transformers")
        for engine, r in case["results"].items():
            fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
            ratio = fmt(hf["step_s"] / r["step_s"], ".2f") + "x" if hf and engine != "transformers" else "-"
            print(
                f"{case['family']:<13}{str(case['compile']):>8}  {engine:<15}{r['step_s']:>9.3f}"
                f"{r['tokens_per_s']:>11.0f}{r['tflops']:>9.2f}{fmt(r['mfu'], '.1f'):>7}"
                f"{fmt(r.get('peak_mem_gib'), '.1f'):>9}{fmt(r.get('estimated_peak_gib'), '.1f'):>8}{ratio:>7}"
            )
        loop, bare = case["results"].get("vlmcore train"), case["results"]["vlmcore"]
        if loop:
            print(
                f"{'':<23}real loop / bare step time: {loop['step_s'] / bare['step_s']:.3f}, "
                f"data wait {100 * loop['data_wait_share']:.1f}% of the loop's step"
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument(
        "--family",
        choices=DENSE + MOE,
        default=None,
        help="default: the preset's first (qwen3_vl, or qwen3_vl_moe for 30b-a3b); with --all, "
        "that family's part of the table only",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="every family of the preset, compiled and eager, with "
        "the real loop and the memory estimate: the whole table",
    )
    parser.add_argument("--seq-len", type=int, default=None, help="packed tokens per step (default: preset's)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--activation-checkpointing", default="none", choices=("none", "selective", "full"))
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--one-rank-fsdp2",
        action="store_true",
        help="FSDP2's units over the one GPU (parallel.one_rank_cast: false) instead of the one-rank "
        "cast, for the two side by side (issue 43 item 3)",
    )
    parser.add_argument("--skip-loop", action="store_true", help="no `vlmcore train` run")
    parser.add_argument("--memory-estimate", action="store_true", help="also `vlmcore memory`'s estimate")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="trace two bare steps and two steps of the real loop (torch.profiler): a summary and a "
        "trace each, in --out's profile_bare_* and profile_loop_* folders",
    )
    parser.add_argument(
        "--loop-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a `vlmcore train --set` for the real loop (repeatable), e.g. metrics.module_times=false",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    families = PRESETS[args.preset]["families"]
    family_given = args.family is not None
    args.family = args.family or families[0]
    if args.family not in families:
        parser.error(f"--family {args.family}: the {args.preset} preset has {', '.join(families)}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = device.type == "cuda"
    name = torch.cuda.get_device_name() if bf16 else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    if args.all:
        args.memory_estimate = True
        # Compiled first: the targets are on the compiled step, and a run cut short keeps those.
        runs = [
            (family, compiled) for family in ([args.family] if family_given else families) for compiled in (True, False)
        ]
        tag = f"{'cuda' if bf16 else 'cpu'}_{args.preset}_all{'_' + args.family if family_given else ''}"
    else:
        runs = [(args.family, args.compile)]
        tag = f"{'cuda' if bf16 else 'cpu'}_{args.preset}_{args.family}{'_compile' if args.compile else ''}"
    if args.one_rank_fsdp2:
        tag += "_one_rank_fsdp2"
    args.out.mkdir(parents=True, exist_ok=True)
    result_file = args.out / f"train_step_{tag}.json"
    header = {"device": name, "preset": args.preset, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}

    cases = []
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        snapshots = {}
        for family in dict.fromkeys(family for family, _ in runs):  # one snapshot per family, in order
            snapshots[family] = Path(tmp) / family / "model"
            preset = PRESETS[args.preset]
            on_meta = preset is not PRESETS["tiny"]  # the big presets: not initialised on the CPU
            write_snapshot(family, hf_config(family, preset), snapshots[family], on_meta=on_meta)
        # The estimates run on the CPU: beside the GPU cases, one at a time in a process of their
        # own; on a CPU run before them, so that they do not share the cores the step is timed on.
        # One per case, each with its own copy of the arguments: the compiled estimate differs
        # from the eager one, and the loop below sets args.compile while the pool may still be
        # reading them.
        estimates = (
            {
                (family, compiled): pool.submit(
                    estimate_peak_gib, case_args(args, compiled), family, snapshots[family], device.type
                )
                for family, compiled in runs
            }
            if args.memory_estimate
            else {}
        )
        if not bf16:
            wait(estimates.values())
        for family, compiled in runs:
            cases.append(run_case(case_args(args, compiled), family, snapshots[family], device))
            print_rows(cases[-1:], name, args.preset)
            print(f"({cases[-1]['wall_s']:.0f} s)", flush=True)
            # After every case, so that a run stopped part way keeps what it measured.
            write_results(result_file, dict(header, complete=False, cases=cases))
        for case in cases:
            key = (case["family"], case["compile"])
            if key not in estimates:
                continue
            try:
                estimate = estimates[key].result()
            except Exception as e:  # the measured figures stand without it
                print(f"memory estimate of {case['family']} failed: {e!r}", file=sys.stderr)
                estimate = None
            if estimate is not None:
                case["results"]["vlmcore"]["estimated_peak_gib"] = estimate
    print()
    print_rows(cases, name, args.preset)
    write_results(result_file, dict(header, complete=True, cases=cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
