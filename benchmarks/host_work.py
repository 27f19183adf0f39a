"""Host work of the training step on CPU, by source (issue 43, item 1): operators, copies, host time.

Per step, the operators dispatched outside compiled regions, the copies and fills among them, and
their host time, by source (FSDP's all-gather and reduce-scatter, the optimizer, the gradient norm
and clipping, the loss, the module timer, the data and its transfer, the forward/backward compute),
for the 2B and 8B presets' structure at a width small enough for 2 cores.

    OMP_NUM_THREADS=1 python benchmarks/host_work.py --structure 2b   # Qwen3-VL 2B and Qwen3 2B
    OMP_NUM_THREADS=1 python benchmarks/host_work.py --structure 8b   # Qwen3-VL 8B
    OMP_NUM_THREADS=1 python benchmarks/host_work.py --structure 30b-a3b --bare --nproc 1   # the MoE step
    OMP_NUM_THREADS=1 python benchmarks/host_work.py --structure tiny # 2 layers: the test's setting (also tiny-moe)

Each case is the real training loop's step (`vlmcore.train.loop.Trainer.train_step`, built by
vlmcore.train.build as `vlmcore train` builds it), or with --bare the step alone as
benchmarks/train_step.py times it, under torchrun on --nproc gloo ranks (default 2), with the GPU's
bf16 mixed-precision policy (bf16 compute and all-gather, fp32 weights, gradients reduced in fp32):
FSDP2 over 2 ranks or more, on one rank the weights' and gradients' casts of
vlmcore.parallel.fsdp.OneRankMixedPrecision (counted in the FSDP rows, whose work they do there);
fused AdamW, clipping at norm 1, the module timer on (the loop), random packed rows with one image,
512 tokens in 4 loss chunks (8,192 in chunks of 2,048 on the GPU), eager. One document a row: the
GPU's varlen attention is one call a layer however many documents a row packs, the CPU's one call
per document. The number of operators, copies and FSDP groups depends on the structure (layers,
parameter tensors, FSDP units, loss chunks), not on the width, so the counts stand for the
full-width model; host times are those of this machine's CPU at a tiny width.

How it counts: torch.profiler over the timed steps, with a record_function range around each part
of the step that has none of its own (FSDP and the optimizer name theirs). Every operator is given
to the innermost range around it. "ops" are the outermost operators (one dispatch from Python or
from the autograd engine each); "kernels" the innermost operators that do work (views and
allocations left out), with a copy, cat, FSDP's chunk_cat and split copy, and each foreach or fused
call counted as one, as a GPU launches them (the CPU runs these tensor by tensor); "copies" the
copy kernels (casts included), "fills" the zero_/fill_ kernels (a GPU memcpy and memset each);
"DTensor" the operators DTensor dispatches in Python (the profiler's PythonSubclass ranges). Host ms
is the time of the source's own ranges and operators, less what nests inside them from other
sources ("loop (other)" holds the step's loss all-reduce and host read, where a rank waits for the
other). A profiler, not a TorchDispatchMode counter: it sees the operators that C++ dispatches
(the autograd engine's backward, DTensor's fast path, the fused optimizer's per-group calls)
without adding Python to each one, and its ranges give each source's host time, which a counting
mode would inflate.

--src runs another copy of the vlmcore package (an older commit's src/, unpacked with git archive),
to compare the host work of two commits (with --bare: older code has no Trainer).

Prints one table per case and writes benchmarks/results/host_work_cpu_<structure>[_<family>][_bare]
[_<n>ranks][_<tag>].json ($OUT or --out), rank 0's figures (the ranks' counts agree but for rank 0's metrics line).
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import yaml
from common import REPO, hf_config, src_env, torchrun, write_results, write_snapshot

# The structure of each preset at a width a 2-core machine steps through in seconds: layers, vision
# blocks, DeepStack taps and tied embeddings as the real models, every matrix 64 wide.
# 2b: the 2b preset (benchmarks/common.py), the one the H200 profile measured (DeepStack at block 0);
# 8b: Qwen3-VL-8B's published architecture (benchmarks/recipe_models.py).
STRUCTURES = {
    "tiny": dict(layers=2, vision_depth=2, deepstack=[0], tied=True, families=("qwen3_vl",)),
    "tiny-moe": dict(
        layers=2,
        vision_depth=2,
        deepstack=[0],
        tied=False,
        families=("qwen3_vl_moe",),
        experts=8,
        experts_per_token=2,
    ),
    "2b": dict(layers=28, vision_depth=24, deepstack=[0], tied=True, families=("qwen3_vl", "qwen3")),
    "8b": dict(layers=36, vision_depth=27, deepstack=[8, 16, 24], tied=False, families=("qwen3_vl",)),
    # Qwen3-VL-30B-A3B (benchmarks/recipe_models.py): 48 MoE layers of 128 experts, 8 a token. Its
    # experts run the GPU's grouped GEMM here too (torch._grouped_mm has a CPU kernel in bf16), not
    # the CPU's loop over the experts, so that the MoE block's operators are those a GPU launches.
    "30b-a3b": dict(
        layers=48,
        vision_depth=27,
        deepstack=[8, 16, 24],
        tied=False,
        families=("qwen3_vl_moe",),
        experts=128,
        experts_per_token=8,
    ),
}
SEQ_LEN = 512
# One document a row: the GPU's varlen attention is one call a layer however many documents a row
# packs (16 in the H200 batch), the CPU's one call per document.
SEGMENTS = 1
LOSS_CHUNK_TOKENS = 128  # 4 chunks a row, as 8,192 tokens in chunks of 2,048

SOURCES = (
    "FSDP all-gather",
    "FSDP reduce-scatter",
    "optimizer",
    "zero_grad",
    "grad norm",
    "clipping",
    "loss",
    "module timer",
    "data",
    "data transfer",
    "forward/backward compute",
    "MoE routing",
    "MoE experts",
    "MoE dispatch and combine",
    "loop (other)",
)
# Our ranges (installed by `install_ranges`), by name.
RANGE_SOURCES = {
    "host_work::grad_norm": "grad norm",
    "host_work::clip_grads": "clipping",
    "host_work::loss": "loss",
    "host_work::module_timer": "module timer",
    "host_work::data": "data",
    "host_work::to_device": "data transfer",
    "host_work::forward_backward": "forward/backward compute",
    "host_work::step": "loop (other)",
    # An MoE block's forward by part (its backward stays in the compute's row): the router, the
    # experts' grouped GEMMs with their padding, and the rest of the block (the sort by expert, the
    # gather of the rows, the weighted scatter back).
    "host_work::moe_routing": "MoE routing",
    "host_work::moe_experts": "MoE experts",
    "host_work::moe_block": "MoE dispatch and combine",
    # On one rank with a compute dtype no FSDP: the weights' and the gradients' casts
    # (vlmcore.parallel.fsdp.OneRankMixedPrecision) stand where FSDP2's gather and reduce were.
    "OneRankMixedPrecision::cast_weights": "FSDP all-gather",
    "OneRankMixedPrecision::cast_grads": "FSDP reduce-scatter",
}
# FSDP's own ranges: what gathers the weights, and what reduces the gradients.
FSDP_REDUCE = ("FSDP::post_backward", "FSDP::root_post_backward")
COPY_OPS = {
    "aten::copy_",
    "aten::cat",
    "aten::_chunk_cat",
    "aten::split_with_sizes_copy",
    "aten::_foreach_copy_",
}
FILL_OPS = {"aten::zero_", "aten::fill_", "aten::_foreach_zero_"}
# Operators that only describe or allocate memory: no kernel on a GPU.
NO_KERNEL_OPS = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::view",
    "aten::_unsafe_view",
    "aten::as_strided",
    "aten::_reshape_alias",
    "aten::reshape",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::expand",
    "aten::slice",
    "aten::select",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::detach",
    "aten::detach_",
    "aten::alias",
    "aten::split",
    "aten::split_with_sizes",
    "aten::unbind",
    "aten::narrow",
    "aten::chunk",
    "aten::resize_",
    "aten::set_",
    "aten::lift_fresh",
    "aten::view_as",
    "aten::unflatten",
    "aten::flatten",
    "aten::result_type",
    "aten::contiguous",
    "aten::_has_compatible_shallow_copy_type",
    "aten::is_same_size",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::promote_types",
    "aten::as_strided_",
    # A `to` that changes nothing returns its input; one that casts or moves has its copy below it,
    # counted there.
    "aten::to",
}
# The profiler's range around an operator that a tensor subclass (DTensor) dispatches in Python.
DTENSOR_DISPATCH = "PythonSubclass"
OP_PREFIXES = ("aten::", "c10d::", "_c10d_functional::", "fsdp::", "prims::", "vlmcore::")
# Operators that the CPU runs as several but a GPU as one kernel: the copies FSDP makes in one call,
# and the multi-tensor (foreach, fused) ops, which the CPU runs tensor by tensor and a GPU in one
# launch per chunk of tensors (counted as one: a lower bound).
# The grouped GEMM too: the CPU's kernel multiplies expert by expert (an `aten::mm` each), a GPU's
# is one launch.
ONE_KERNEL_OPS = {"aten::_chunk_cat", "aten::cat", "aten::copy_", "aten::split_with_sizes_copy", "aten::_grouped_mm"}
MULTI_TENSOR_PREFIXES = ("aten::_foreach_", "aten::_fused_")


# What the H200 profile reports per step (benchmarks/results/profile_cuda_2b_qwen3_vl_compile_h200.txt:
# the compiled Qwen3-VL 2B bare step on one GPU, 2 steps traced), beside where this run has it:
# (label, H200 figure, where in the case's figures, the name there).
H200 = (
    ("aten::mm calls", 800, "ops_by_name", "aten::mm"),
    ("aten::_chunk_cat calls (reduce-scatter copy-in)", 30, "ops_by_name", "aten::_chunk_cat"),
    ("aten::_fused_adamw_ calls", 12, "ops_by_name", "aten::_fused_adamw_"),
    # Copies inside the compiled blocks are Triton kernels there, not aten::copy_ calls.
    ("aten::copy_ calls (copies outside the compute here)", 2064, "sources", "copies"),
    ("optimizer step, host ms", 20.0, "range_ms", "Optimizer.step"),
    ("gradient norm, host ms", 8.0, "range_ms", "host_work::grad_norm"),
    ("FSDP root post-backward, host ms", 14.0, "range_ms", "FSDP::root_post_backward_callback"),
)


def figure(case: dict, where: str, name: str) -> float:
    """A figure of the case by name; a range by the start of its name (the optimizer's names its class);
    from the sources, the sum of all but the forward/backward compute's."""
    if where == "sources":
        return sum(row[name] for source, row in case["sources"].items() if source != "forward/backward compute")
    return sum(v for k, v in case[where].items() if k == name or (where == "range_ms" and k.startswith(name)))


def model_config(family: str, structure: dict):
    """The transformers config of the family at the structure's depth, 64 wide."""
    preset = dict(
        text=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=structure["layers"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
        vision=dict(
            depth=structure["vision_depth"],
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            deepstack_visual_indexes=structure["deepstack"],
        ),
    )
    if "experts" in structure:
        preset["moe"] = dict(
            num_experts=structure["experts"],
            num_experts_per_tok=structure["experts_per_token"],
            moe_intermediate_size=32,
        )
    config = hf_config(family, preset)
    config.tie_word_embeddings = structure["tied"]
    if hasattr(config, "text_config"):
        config.text_config.tie_word_embeddings = structure["tied"]
    return config


def train_config(snapshot: Path, out: Path, warmup: int, steps: int) -> dict:
    return {
        "model_path": str(snapshot),
        "output_dir": str(out),
        "steps": warmup + steps,
        "save_final": False,
        "checkpoint": {"enabled": False},
        "metrics": {"tensorboard": False, "module_times": True},
        "micro_batch_size": 1,
        "grad_accum_steps": 1,
        "loss_chunk_tokens": LOSS_CHUNK_TOKENS,
        "max_grad_norm": 1.0,
        "optimizer": {"lr": 1e-4},
        "parallel": {"dp_shard": -1, "compile": False, "activation_checkpointing": "none"},
        "precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
        "data": {"kind": "random", "seq_len": SEQ_LEN, "segments": SEGMENTS, "image_fraction": 1.0, "image_side": 2},
    }


# ---- in each torchrun rank -------------------------------------------------------------------


def ranged(name: str, fn):
    """`fn` inside a profiler range named `name`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return wrapper


class RangedBatches:
    """The loop's batch iterator, each batch taken inside the "data" range."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __iter__(self):
        return self

    def __next__(self):
        with torch.profiler.record_function("host_work::data"):
            return next(self.batches)


def wrap_in_range(owner: object, name: str, range_name: str) -> None:
    """`owner.name` (a module's function, a class's method) inside the range; older code without it
    (`--src`) is left as it is."""
    if hasattr(owner, name):
        setattr(owner, name, ranged(range_name, getattr(owner, name)))


def install_ranges() -> None:
    """Ranges around the parts of the step that torch does not name, by wrapping the functions the
    step and the loop call through their modules' globals (the code that runs is unchanged)."""
    from vlmcore.models import moe
    from vlmcore.train import loop, step
    from vlmcore.train.module_timer import ModuleTimer

    try:  # SFT's objective calls the chunked loss; older code (`--src`) has no objective module
        from vlmcore.train import objective
    except ImportError:
        objective = None

    wrap_in_range(step, "grad_norm", "host_work::grad_norm")
    wrap_in_range(step, "clip_grads", "host_work::clip_grads")
    wrap_in_range(step, "chunked_cross_entropy", "host_work::loss")  # older code (`--src`): the step called it
    wrap_in_range(objective, "chunked_cross_entropy", "host_work::loss")
    wrap_in_range(step, "forward_backward", "host_work::forward_backward")
    wrap_in_range(loop, "to_device", "host_work::to_device")
    # The timer's hooks are bound at construction: wrap them on the class, before the Trainer.
    for name in ("_mark", "_model_start", "_vision_start", "_vision_end", "_model_end", "read"):
        wrap_in_range(ModuleTimer, name, "host_work::module_timer")
    wrap_in_range(moe.SparseMoeBlock, "forward", "host_work::moe_block")
    wrap_in_range(moe.TopKRouter, "forward", "host_work::moe_routing")
    wrap_in_range(moe.GroupedExperts, "forward", "host_work::moe_experts")


def source_of_range(name: str) -> str | None:
    if name.startswith("FSDP::"):
        return "FSDP reduce-scatter" if name.startswith(FSDP_REDUCE) else "FSDP all-gather"
    if name.startswith("Optimizer.step#"):
        return "optimizer"
    if name.startswith("Optimizer.zero_grad#"):
        return "zero_grad"
    return RANGE_SOURCES.get(name)


def is_op(event) -> bool:
    return event.name.startswith(OP_PREFIXES)


def is_kernel(event, work_below: dict) -> bool:
    """An operator that does work (not a view or an allocation) with no such operator inside it."""
    if not is_op(event) or event.name in NO_KERNEL_OPS:
        return False
    one_kernel = event.name in ONE_KERNEL_OPS or event.name.startswith(MULTI_TENSOR_PREFIXES)
    return one_kernel or not work_below[event.id]


def mark_work_below(step_events: list) -> dict:
    """event id -> whether an operator that does work runs inside the event."""
    work_below = {}

    def visit(event) -> bool:
        below = False
        for child in event.cpu_children:
            child_works = visit(child)
            below = below or child_works or (is_op(child) and child.name not in NO_KERNEL_OPS)
        work_below[event.id] = below
        return below

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for event in step_events:
        visit(event)
    return work_below


def count_events(step_events: list) -> dict:
    """Per-source counts and host time of the events under the step ranges `step_events`."""
    table = {s: {"ops": 0, "kernels": 0, "copies": 0, "fills": 0, "dtensor": 0, "host_ms": 0.0} for s in SOURCES}
    ops = {s: defaultdict(int) for s in SOURCES}  # every operator call by name, nested ones too
    kernels = defaultdict(int)  # the kernels by name, all sources
    range_ms = defaultdict(float)  # the outermost occurrences of each named range
    work_below = mark_work_below(step_events)
    # (event, its source, inside an operator, inside a kernel, the ranges open around it)
    stack = [(e, "loop (other)", False, False, frozenset()) for e in step_events]
    while stack:
        event, source, under_op, under_kernel, open_ranges = stack.pop()
        source = source_of_range(event.name) or source
        row = table[source]
        row["host_ms"] += event.self_cpu_time_total / 1000
        row["dtensor"] += event.name == DTENSOR_DISPATCH
        op = is_op(event)
        if op:
            ops[source][event.name] += 1
            row["ops"] += not under_op
        kernel = not under_kernel and is_kernel(event, work_below)
        if kernel:
            kernels[event.name] += 1
            row["kernels"] += 1
            row["copies"] += event.name in COPY_OPS
            row["fills"] += event.name in FILL_OPS
        if not op:
            key = range_key(event.name)
            if key not in open_ranges:
                range_ms[key] += event.cpu_time_total / 1000
            open_ranges = open_ranges | {key}
        under = (under_op or op, under_kernel or kernel, open_ranges)
        stack.extend((c, source, *under) for c in event.cpu_children)
    return {"sources": table, "ops_by_source": ops, "kernels_by_name": kernels, "range_ms": dict(range_ms)}


def range_key(name: str) -> str:
    """A range's name without FSDP's module name: 'FSDP::pre_forward (model.layers.0)' -> 'FSDP::pre_forward'."""
    return name.split(" (")[0]


def by_count(counts: dict, steps: int) -> dict:
    """Per step, largest first."""
    return {k: v / steps for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def per_step(counts: dict, steps: int) -> dict:
    sources = {s: {k: v / steps for k, v in row.items()} for s, row in counts["sources"].items()}
    every_op = defaultdict(int)
    for names in counts["ops_by_source"].values():
        for name, n in names.items():
            every_op[name] += n
    return {
        "sources": sources,
        "ops_by_name": by_count(every_op, steps),  # the profiler's "# of Calls": nested calls too
        "ops_by_source": {s: by_count(names, steps) for s, names in counts["ops_by_source"].items()},
        "kernels_by_name": by_count(counts["kernels_by_name"], steps),
        "range_ms": by_count(counts["range_ms"], steps),
    }


def fsdp_groups(model: torch.nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def loop_steps(cfg, device: torch.device):
    """The real loop's step (`Trainer.train_step`: data, transfer, step, module timer, metrics);
    returns (one step, the model, what closes the run)."""
    from vlmcore.train.loop import Trainer, _StopSignal

    trainer = Trainer(cfg, Path(cfg.output_dir), device, _StopSignal())
    trainer._start_steps()  # the metrics' sinks and the data stream, as `Trainer.train` starts them
    trainer.batches = RangedBatches(trainer.batches)
    return trainer.train_step, trainer.run.model, trainer._close


def bare_steps(cfg, device: torch.device):
    """The bare step as benchmarks/train_step.py times it (the H200 profile's): `Run.step` on one
    batch already on the device, built as that benchmark builds it at every commit since the H200
    measurements (so that `--src` can run older code); returns (one step, the model, None)."""
    import torch.distributed as dist

    from vlmcore.models import load_hf_config
    from vlmcore.parallel.checks import check_run
    from vlmcore.train.build import build_run, check_kernels
    from vlmcore.train.random_data import RandomBatches

    check_kernels(cfg, device)
    run = build_run(cfg, check_run(cfg, dist.get_world_size(), load_hf_config(cfg.model_path)), device)
    run.model.train()
    host_batch = RandomBatches(
        run.model.config,
        seq_len=SEQ_LEN,
        segments=SEGMENTS,
        image_fraction=1.0,
        micro_batch_size=1,
        dp_rank=dist.get_rank(),
        dp_world=dist.get_world_size(),
        grad_accum_steps=1,
        seed=0,
        image_side=2,
    ).batch(0)
    batch = host_batch.to(device)
    labels = host_batch.label_tokens

    def step() -> None:
        run.step([batch], labels, set_lr=lambda optimizer: None)

    return step, run.model, None


def profile_steps(step, warmup: int, steps: int) -> dict:
    """`steps` steps profiled after `warmup`: the per-step figures of `count_events`."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("host_work::step"):
                step()
    profiled_s = time.perf_counter() - started
    events = [e for e in prof.events() if e.name == "host_work::step"]
    figures = per_step(count_events(events), steps)
    figures["step_ms"] = sum(e.cpu_time_total for e in events) / 1000 / steps
    figures["wall_ms_profiled"] = profiled_s * 1000 / steps
    return figures


def grouped_gemm_on_cpu() -> None:
    """MoE experts run the GPU's grouped GEMM (vlmcore.models.moe.grouped_mm) on CPU too."""
    from vlmcore.models.moe import grouped_mm

    grouped_mm.set(torch._grouped_mm, force=True)


def worker(args) -> None:
    """One rank: `args.steps` steps profiled after `args.warmup`; rank 0 writes `args.result`."""
    import torch.distributed as dist

    from vlmcore.config import load_config
    from vlmcore.parallel.mesh import device_for_rank, init_distributed

    cfg = load_config(args.worker, paths_must_exist=True)
    device = device_for_rank()
    init_distributed(device)
    install_ranges()
    grouped_gemm_on_cpu()
    step, model, close = bare_steps(cfg, device) if args.bare else loop_steps(cfg, device)
    figures = profile_steps(step, args.warmup, args.steps)
    figures["parameter_tensors"] = sum(1 for _ in model.parameters())
    figures["fsdp_groups"] = fsdp_groups(model)
    if dist.get_rank() == 0:
        write_results(args.result, figures)
    if close is not None:
        close()
    dist.destroy_process_group()


# ---- the driver ------------------------------------------------------------------------------


def run_case(family: str, structure_name: str, work: Path, args) -> dict:
    structure = STRUCTURES[structure_name]
    snapshot = work / f"{family}_{structure_name}" / "model"
    write_snapshot(family, model_config(family, structure), snapshot)
    config_file = snapshot.parent / "train.yaml"
    config_file.write_text(yaml.safe_dump(train_config(snapshot, snapshot.parent / "out", args.warmup, args.steps)))
    result = snapshot.parent / "rank0.json"
    cmd = torchrun(
        args.nproc,
        str(Path(__file__).resolve()),
        "--worker",
        str(config_file),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--result",
        str(result),
        *(["--bare"] if args.bare else []),
    )
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=src_env(args.src), check=False)
    if proc.returncode:
        raise RuntimeError(f"{family} {structure_name}: the profiled run failed:\n{proc.stderr[-4000:]}")
    figures = json.loads(result.read_text())
    return {
        "family": family,
        "structure": structure_name,
        "layers": structure["layers"],
        "vision_depth": structure["vision_depth"] if family.startswith("qwen3_vl") else 0,
        "wall_s": round(time.perf_counter() - started, 1),
        **figures,
    }


def totals(sources: dict) -> dict:
    keys = ("ops", "kernels", "copies", "fills", "dtensor", "host_ms")
    return {k: sum(row[k] for row in sources.values()) for k in keys}


def print_case(case: dict) -> None:
    print(
        f"\n{case['family']}, {case['structure']} structure ({case['layers']} layers, {case['vision_depth']} vision "
        f"blocks, {case['parameter_tensors']} parameter tensors, {case['fsdp_groups']} FSDP groups), per step "
        f"(step {case['step_ms']:.0f} ms under the profiler)"
    )
    print(f"{'source':<26}{'ops':>9}{'kernels':>9}{'copies':>9}{'fills':>8}{'DTensor':>9}{'host ms':>10}")
    rows = dict(case["sources"], total=totals(case["sources"]))
    for source, row in rows.items():
        print(
            f"{source:<26}{row['ops']:>9.0f}{row['kernels']:>9.0f}{row['copies']:>9.0f}{row['fills']:>8.0f}"
            f"{row['dtensor']:>9.0f}{row['host_ms']:>10.1f}"
        )
    print("against the H200 profile (compiled Qwen3-VL 2B bare step, one GPU), per step:")
    for label, h200, where, name in H200:
        print(f"  {label:<50}{figure(case, where, name):>9.1f}   H200 {h200}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--structure",
        choices=STRUCTURES,
        default="2b",
        help="the preset whose layers, vision blocks and FSDP groups are counted (tiny: 2 layers, the test's)",
    )
    parser.add_argument(
        "--family", choices=("qwen3_vl", "qwen3", "qwen3_vl_moe"), help="one of the structure's families only"
    )
    parser.add_argument("--steps", type=int, default=2, help="profiled steps (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before them (default 2)")
    parser.add_argument(
        "--nproc", type=int, default=2, help="gloo ranks (default 2): FSDP over them, or on 1 the one-rank cast"
    )
    parser.add_argument(
        "--bare",
        action="store_true",
        help="the bare step (`Run.step` on one batch on the device, as benchmarks/train_step.py times "
        "it and the H200 profile traced it) instead of the loop's",
    )
    parser.add_argument(
        "--src",
        type=Path,
        default=REPO / "src",
        help="the vlmcore package's source to run (default: this checkout's), e.g. an older commit's, "
        "unpacked by `git archive COMMIT src | tar -x -C DIR` (with --bare: older code has no Trainer)",
    )
    parser.add_argument("--tag", default="", help="added to the results file's name")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "benchmarks" / "results"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a torchrun rank's run config
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.worker:
        worker(args)
        return 0
    families = [args.family] if args.family else STRUCTURES[args.structure]["families"]
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.family}" if args.family else ""
    suffix += "_bare" if args.bare else ""
    suffix += f"_{args.nproc}ranks" if args.nproc != 2 else ""
    suffix += f"_{args.tag}" if args.tag else ""
    result_file = args.out / f"host_work_cpu_{args.structure}{suffix}.json"
    header = {
        "structure": args.structure,
        "device": f"CPU ({os.cpu_count()} cores), {args.nproc} gloo ranks",
        "step": "bare" if args.bare else "loop",
        "src": str(args.src),
        "steps": args.steps,
        "warmup": args.warmup,
        "seq_len": SEQ_LEN,
        "segments": SEGMENTS,
        "loss_chunk_tokens": LOSS_CHUNK_TOKENS,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    cases = []
    with tempfile.TemporaryDirectory() as work:
        for family in families:
            cases.append(run_case(family, args.structure, Path(work), args))
            print_case(cases[-1])
            write_results(result_file, dict(header, complete=False, cases=cases))
    write_results(result_file, dict(header, complete=True, cases=cases))
    print(f"\nwrote {result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
