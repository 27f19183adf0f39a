"""`vlmcore memory CONFIG --world-size N`: peak memory per device of a training stage,
estimated on any machine, without a GPU, the other ranks or the weights.

It runs a real training step of the stage (the model from `model_path`'s config.json,
frozen, parallelized and sharded as the config says for a world of N ranks, the same
forward/backward, gradient norm and AdamW as `vlmcore train`) on fake tensors (shapes and
dtypes, no data) over a fake process group, and counts the bytes of every live tensor with
torch's FSDP2 memory tracker: the peak is what rank 0 holds at its fullest moment, by kind.
The step holds the optimizer state from its start, as every step after a run's first does.
A DPO stage's step includes its reference's forward and, with `dpo.reference: copy`, the
reference's weights (sharded as the policy's, counted as sharded parameters). A GRPO stage's
step is estimated so on rows of rollout completions, and its rollout beside it (`rollout_memory`:
the states kept between steps, the weights gathered for the rollout, the generation cache of
the rank's prompts x group_size rows, the prefill); the stage's peak is the larger of the two.

It counts tensor bytes, what `torch.cuda.max_memory_allocated` reports: not the caching
allocator's reserve, the CUDA context or kernel workspaces. It runs AdamW one weight at a
time, and the CPU paths of attention and Gated DeltaNet (SDPA per packed segment, the chunked
pure-torch delta rule), which keep more for backward than the fused GPU kernels do. With
`parallel.compile` the blocks run as AOTAutograd partitions them, keeping for backward what a
compiled block keeps (`_compile_blocks`); blocks with a graph break stay eager.
"""

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from vlmcore.blend import read_blend
from vlmcore.config import ConfigError, TrainConfig, load_config
from vlmcore.data.load.batch import Batch
from vlmcore.families import family
from vlmcore.models import load_hf_config
from vlmcore.models.moe import grouped_mm
from vlmcore.parallel.checks import check_run
from vlmcore.parallel.compile import apply_compile
from vlmcore.parallel.layout import RunLayout
from vlmcore.train.build import Run, build_meta_run, pairs_in_rows, rollout_in_rows, use_objective
from vlmcore.train.random_data import RandomBatches
from vlmcore.train.step import to_device

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from vlmcore.train.peak_tracker import PeakTracker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vlmcore.cli import existing_file, positive_int

    parser.add_argument(
        "config", type=existing_file, help="YAML run config of a training stage (as for `vlmcore train`)"
    )
    parser.add_argument("--world-size", type=positive_int, required=True, help="ranks the stage would run on")
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        help="tokens per packed row (default: the packed dataset's pack_config.json, else data.seq_len)",
    )
    parser.add_argument(
        "--image-side",
        type=positive_int,
        help="VL models: merged patches per side of the one image "
        "in each row (default: as large as the dataset's max_patches allows, else data.image_side)",
    )
    parser.add_argument(
        "--video-frames",
        type=positive_int,
        help="VL models: rows hold one video of this many "
        "frame groups (temporal_patch_size frames each, image-side x image-side merged patches) "
        "instead of an image",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, dotted keys for sections (repeatable)",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="memory of one GPU: exit 1, saying what to change, "
        f"if the estimate does not fit in it with {HEADROOM * 100:.0f}%% kept free",  # %%: argparse formats help
    )
    parser.add_argument(
        "--host-memory-gib",
        type=float,
        help="host memory a GPU's rank may use (the node's memory over its GPUs): exit 1 if what the "
        f"estimate keeps in host memory (parallel.offload, checkpoint.async) does not fit with {HEADROOM * 100:.0f}%% kept free",
    )
    parser.add_argument(
        "--generation-rows",
        type=positive_int,
        help="also the generation cache (vlmcore.generate: KV cache, Gated DeltaNet state) of this many rows "
        "(prompts x samples) on one rank of the stage's tensor parallelism",
    )
    parser.add_argument(
        "--generation-tokens",
        type=positive_int,
        help="tokens each generation row holds, its prompt and max_new_tokens (default: the row length)",
    )
    parser.add_argument("--json", type=Path, help="also write the estimate here")


# Kept free on the GPU for what the estimate does not count: the CUDA context, NCCL's buffers and
# the caching allocator's fragmentation (reserved minus allocated). A rule of thumb, not measured here.
HEADROOM = 0.10


def run(args: argparse.Namespace) -> int:
    try:
        for flag, value in (("--gpu-memory-gib", args.gpu_memory_gib), ("--host-memory-gib", args.host_memory_gib)):
            if value is not None and value <= 0:
                raise ConfigError(f"{flag}: must be positive, got {value}")
        if args.host_memory_gib and not args.gpu_memory_gib:
            raise ConfigError("--host-memory-gib: checked beside --gpu-memory-gib, which is not given")
        cfg = load_config(args.config, args.set)
        result = estimate_stage(cfg, args.world_size, args.seq_len, args.image_side, args.video_frames or 0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.generation_rows:
        result["generation_cache"] = generation_cache(cfg, args.generation_rows, args.generation_tokens or result)
        g = result["generation_cache"]
        print(
            f"generation cache: {g['bytes'] / 2**30:.2f} GiB per rank for {g['rows']} rows of {g['tokens']} tokens "
            f"(tp {g['tp']}, {g['dtype']})"
        )
    problem = None
    if args.gpu_memory_gib:
        problem = check_fit(result, args.gpu_memory_gib, host_memory_gib=args.host_memory_gib)
        print(
            f"{'fits' if result['peak_bytes'] <= result['usable_bytes'] else 'DOES NOT FIT'}: "
            f"{result['peak_bytes'] / 2**30:.1f} GiB of the "
            f"{result['usable_bytes'] / 2**30:.1f} GiB usable on a {result['gpu_memory_gib']:g} GiB GPU"
        )
        if args.host_memory_gib:
            print(
                f"{'host memory fits' if result['host_fits'] else 'HOST MEMORY DOES NOT FIT'}: "
                f"{result['host_bytes'] / 2**30:.1f} GiB of the {result['usable_host_bytes'] / 2**30:.1f} GiB "
                f"usable of {result['host_memory_gib']:g} GiB a GPU"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if problem:
        print(f"error: {args.config}: {problem}", file=sys.stderr)
        return 1
    return 0


def generation_cache(cfg: TrainConfig, rows: int, tokens: int | dict) -> dict:
    """The bytes of a generation cache of `rows` rows of `tokens` tokens (a dict: the estimate's
    row length) on one rank: vlmcore.generate.cache.cache_bytes in the stage's compute dtype."""
    from vlmcore.generate.cache import cache_bytes
    from vlmcore.models import load_hf_config

    if isinstance(tokens, dict):
        tokens = tokens["seq_len"]
    text_config = load_hf_config(cfg.model_path).get_text_config()
    dtype = getattr(torch, cfg.precision.param_dtype)
    total = cache_bytes(text_config, rows, tokens, dtype, tp=cfg.parallel.tp)
    return dict(rows=rows, tokens=tokens, tp=cfg.parallel.tp, dtype=cfg.precision.param_dtype, bytes=total)


def estimate_stage(
    cfg: TrainConfig, world_size: int, seq_len: int | None = None, image_side: int | None = None, video_frames: int = 0
) -> dict:
    """`estimate_memory` of a stage config at its worst-case row: a packed row is one sample (DPO:
    one pair of two segments) holding the largest image the dataset allows (or a video of
    `video_frames` frame groups of that size: by default, for a packed dataset with videos, its
    longest clip's); random rows are estimated as configured."""
    video_frames = video_frames or packed_limits(cfg).get("video_groups", 0)
    seq_len, image_side = batch_shape(cfg, seq_len, image_side, video_frames)
    segments = cfg.data.segments if cfg.data.kind == "random" else 1
    if pairs_in_rows(cfg):  # a row of pairs holds at least one pair, both sides
        segments = max(segments, 2)
    result = estimate_memory(cfg, world_size, seq_len, image_side, segments=segments, video_frames=video_frames)
    if cfg.objective == "grpo":
        result["rollout"] = rollout_memory(cfg, result)
        result["step_peak_bytes"] = result["peak_bytes"]
        result["peak_bytes"] = max(result["peak_bytes"], result["rollout"]["peak_bytes"])
    return result


# Kept between steps, and so beside a rollout: the weights' shards (a frozen reference's too), the
# buffers and the optimizer state. Gradients are freed by the step's zero_grad.
RESIDENT = ("Sharded Param", "Parameter", "Buffer", "OptState")


def rollout_memory(cfg: TrainConfig, step: dict) -> dict:
    """A GRPO stage's rollout on one rank (train/rollout.py), from its step's estimate `step`:
    - resident: what the step keeps between steps (RESIDENT);
    - gathered_weights: under FSDP2 (dp_shard > 1) the policy's weights gathered once for the whole
      rollout, in the compute dtype, each rank's tensor-parallel share;
    - cache: the generation cache (`generation_cache`) of the rank's rows, its share
      of grpo.prompts_per_step times grpo.group_size, each of data.seq_len tokens at most (a prompt
      and grpo.max_new_tokens);
    - prefill: the forward of the rank's prompts without gradients (their packed tokens, each prompt
      up to data.seq_len - max_new_tokens), bounded by the step's saved activations per token: what
      a forward keeps for its backward, every layer's (or with full checkpointing every layer's
      input), against one layer's at a time without gradients. The step's temporaries (its
      loss's logits chunks, the CPU attention's scores) are not the prefill's;
    - decode: one decoding step's fp32 logits over the vocabulary, the sampling's copies of them.
    The peak is resident + gathered_weights + cache + the larger of prefill and decode."""
    from vlmcore.models import build_model

    grpo = cfg.grpo
    data_parallel = step["dp_replicate"] * step["dp_shard"]
    prompts = math.ceil(grpo.prompts_per_step / data_parallel)
    rows = prompts * grpo.group_size
    dtype = getattr(torch, cfg.precision.param_dtype)
    size = torch.empty((), dtype=dtype).element_size()
    text_config = load_hf_config(cfg.model_path).get_text_config()
    kinds = step["peak_bytes_by_kind"]
    resident = sum(kinds.get(kind, 0) for kind in RESIDENT)
    gathered = 0
    if step["dp_shard"] > 1:
        weights = sum(p.numel() for p in build_model(cfg.model_path, device="meta").parameters())
        gathered = weights * size // step["tp"]
    cache = generation_cache(cfg, rows, cfg.data.seq_len)["bytes"]
    step_tokens = step["micro_batch_size"] * step["seq_len"]
    prompt_tokens = prompts * (cfg.data.seq_len - grpo.max_new_tokens)
    prefill = math.ceil(kinds.get("Activation", 0) * prompt_tokens / step_tokens)
    decode = 3 * rows * text_config.vocab_size * 4
    return dict(
        prompts=prompts,
        rows=rows,
        tokens=cfg.data.seq_len,
        resident_bytes=resident,
        gathered_weights_bytes=gathered,
        cache_bytes=cache,
        prefill_bytes=prefill,
        decode_bytes=decode,
        peak_bytes=resident + gathered + cache + max(prefill, decode),
    )


def check_fit(
    result: dict, gpu_memory_gib: float, headroom: float = HEADROOM, host_memory_gib: float | None = None
) -> str | None:
    """Adds `gpu_memory_gib`, `usable_bytes` and `fits` to `result` (with `host_memory_gib`, the host
    memory one GPU's rank may use, also `usable_host_bytes` and `host_fits`); None if the peak fits in
    the GPU, and what the host holds in its share of host memory, each with `headroom` kept free;
    else what does not fit and what would shrink it."""
    usable = int(gpu_memory_gib * 2**30 * (1 - headroom))
    result.update(gpu_memory_gib=gpu_memory_gib, usable_bytes=usable)
    host_problem = None
    if host_memory_gib:
        usable_host = int(host_memory_gib * 2**30 * (1 - headroom))
        host = result.get("host_bytes", 0)
        result.update(host_memory_gib=host_memory_gib, usable_host_bytes=usable_host, host_fits=host <= usable_host)
        if not result["host_fits"]:
            host_problem = (
                f"estimated host memory {host / 2**30:.1f} GiB per GPU does not fit in {usable_host / 2**30:.1f} GiB "
                f"({host_memory_gib:g} GiB a GPU, {headroom:.0%} kept free): "
                + ", ".join(f"{k} {n / 2**30:.1f} GiB" for k, n in result.get("host_bytes_by_kind", {}).items())
                + ". Try: more ranks to shard over, optimizer.moments_dtype: bfloat16, checkpoint.async: false"
            )
    result["fits"] = result["peak_bytes"] <= usable and host_problem is None
    if result["peak_bytes"] <= usable:
        return host_problem
    rollout = result.get("rollout")
    if rollout and rollout["peak_bytes"] > result["step_peak_bytes"]:
        parts = {
            k.removesuffix("_bytes"): rollout[k] for k in ("gathered_weights_bytes", "cache_bytes", "prefill_bytes")
        }
        return (
            f"estimated rollout peak {rollout['peak_bytes'] / 2**30:.1f} GiB per GPU does not fit in "
            f"{usable / 2**30:.1f} GiB ({gpu_memory_gib:g} GiB GPU, {headroom:.0%} kept free; the train step "
            f"needs {result['step_peak_bytes'] / 2**30:.1f}); largest: "
            + ", ".join(f"{k} {n / 2**30:.1f} GiB" for k, n in sorted(parts.items(), key=lambda kv: -kv[1])[:2])
            + f". Try: fewer rows a rank ({rollout['rows']} now: grpo.prompts_per_step or grpo.group_size), "
            f"shorter rollout rows (data.seq_len {rollout['tokens']}), more data-parallel ranks, or tensor parallel"
            + (f". Also the {host_problem}" if host_problem else "")
        )
    kinds = result["peak_bytes_by_kind"]
    states = sum(kinds.get(k, 0) for k in ("Sharded Param", "Sharded Grad", "OptState"))
    fixes = []
    if kinds.get("Activation", 0) >= states:
        ac = result["activation_checkpointing"]
        if ac != "full":
            fixes.append(f"parallel.activation_checkpointing: {'selective' if ac == 'none' else 'full'} (now {ac})")
        if result["micro_batch_size"] > 1:
            fixes.append(
                f"micro_batch_size: {result['micro_batch_size'] // 2} with twice the grad_accum_steps "
                f"(now {result['micro_batch_size']})"
            )
        fixes.append(
            f"shorter rows (now {result['seq_len']} tokens"
            + (
                f", images up to {result['image_side']}x{result['image_side']} merged patches"
                + (f", videos of {result['video_frames']} frame groups" if result.get("video_frames") else "")
                + ")"
                if result["image_side"]
                else ")"
            )
        )
    fixes.append(
        f"more ranks to shard over, or tensor parallel (now dp_shard {result['dp_shard']} x tp {result['tp']})"
    )
    return (
        f"estimated peak {result['peak_bytes'] / 2**30:.1f} GiB per GPU does not fit in "
        f"{usable / 2**30:.1f} GiB ({gpu_memory_gib:g} GiB GPU, {headroom:.0%} kept free); largest: "
        + ", ".join(f"{k} {n / 2**30:.1f} GiB" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:2] if n)
        + ". Try: "
        + "; ".join(fixes)
        + (f". Also the {host_problem}" if host_problem else "")
    )


def packed_limits(cfg: TrainConfig) -> dict:
    """The packed dataset's pack_config.json (seq_len, max_patches, video_groups), or {}; of a blend
    its first dataset's (all of a blend's are packed alike: vlmcore.data.load.loader)."""
    data = Path(cfg.data_path or "")
    if data.is_file():
        data = read_blend(data).paths[0]
    pack = data / "pack_config.json"
    return json.loads(pack.read_text()) if cfg.data.kind == "packed" and pack.is_file() else {}


def batch_shape(
    cfg: TrainConfig, seq_len: int | None, image_side: int | None, video_frames: int = 0
) -> tuple[int, int]:
    """The row length and image (or video frame) size to estimate with: given, else the packed
    dataset's limits (pack_config.json), else the config's random-data shape."""
    limits = packed_limits(cfg)
    seq_len = seq_len or limits.get("seq_len") or cfg.data.seq_len
    config_file = Path(cfg.model_path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model_path: {config_file} not found (the model's config.json is all it needs)")
    model_config = json.loads(config_file.read_text())
    if "vision_config" not in model_config:
        return seq_len, 0  # a text model: no image
    if image_side is None:
        merge = model_config.get("vision_config", {}).get("spatial_merge_size", 2)
        patches = limits["max_patches"] // max(video_frames, 1) if "max_patches" in limits else 0
        image_side = math.isqrt(patches) // merge if patches else cfg.data.image_side
        image_side = min(image_side, math.isqrt(seq_len - 4))  # the image and its two markers fit the row
        if video_frames:  # each frame group with its timestamp and markers fits the row
            image_side = min(image_side, math.isqrt(max(0, (seq_len - 2) // video_frames - 5)))
    return seq_len, image_side


@contextmanager
def _process_group(world_size: int, fake: bool, rank: int = 0) -> Iterator[None]:
    if dist.is_initialized():
        raise RuntimeError("estimate_memory needs a process of its own: a process group is already initialized")
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def _fake_mode_with_constant_batch(fake: bool) -> Iterator["FakeTensorMode | None"]:
    """Fake tensors whose batch metadata stays readable: the model reads packed-segment bounds
    and image grids as Python numbers, which a fake tensor cannot give. Integer batch tensors
    become fake tensors that keep their real value (FakeTensorMode propagates such constants
    through ops on constants only, and by default only for one-element tensors)."""
    if not fake:
        yield None
        return
    import torch._subclasses.fake_tensor as fake_tensor

    limit = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = 1 << 24
    try:
        with fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = limit


@contextmanager
def _grouped_experts(model: nn.Module, cfg: TrainConfig) -> Iterator[None]:
    """MoE experts run their GPU path (grouped GEMM over a buffer sized without reading the
    routing), in the fake run, which cannot follow the CPU loop (it reads the routing's values),
    and in the real one it is checked against."""
    if not family(model.config).experts:
        yield
        return
    if cfg.precision.param_dtype != "bfloat16":
        raise ConfigError(
            f"precision.param_dtype: the memory estimate of a mixture-of-experts model follows the "
            f"GPU's grouped GEMM, which takes bfloat16 only (got {cfg.precision.param_dtype})"
        )
    previous = grouped_mm.set(torch._grouped_mm, force=True)
    try:
        yield
    finally:
        grouped_mm.set(*previous)


def estimate_memory(
    cfg: TrainConfig,
    world_size: int,
    seq_len: int,
    image_side: int,
    fake: bool = True,
    segments: int | None = None,
    video_frames: int = 0,
) -> dict:
    """Peak bytes per kind of a training step holding the optimizer state from its start (as
    every step after a run's first), each row `segments` packed samples (default:
    data.segments), the longest with the image (`video_frames` > 0: with a video of that many
    frame groups of image_side x image_side merged patches): on rank 0, or under disjoint layouts on the first
    rank of each module (`modules`: each one's estimate; the top level is the larger). `fake=False`
    runs the same step on real tensors (one process only): what the fake run must reproduce."""
    if world_size < 1:
        raise ConfigError(f"--world-size: must be at least 1, got {world_size}")
    if not fake and world_size != 1:
        raise ValueError("a real run is measured in one process only")
    layout = check_run(cfg, world_size, load_hf_config(cfg.model_path))
    # Compiled blocks run as AOTAutograd partitions them, without inductor (no kernels for fake
    # tensors): `_compile_blocks`. The run is built uncompiled, they are compiled once it is.
    compiled = cfg.parallel.compile
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, compile=False))
    segments = segments or cfg.data.segments
    if video_frames and video_frames * (image_side**2 + 5) + 2 > seq_len // segments:
        raise ConfigError(
            f"--video-frames: a video of {video_frames} frame groups of {image_side}x{image_side} merged "
            f"patches ({video_frames * (image_side**2 + 5)} tokens with its timestamps and markers) "
            f"does not fit a segment of {seq_len // segments} tokens"
        )
    ranks = (
        {"vision": layout.vision.ranks.start, "language": layout.language.ranks.start}
        if layout.disjoint
        else {"both": 0}
    )
    peaks = {
        role: _estimate_rank(cfg, layout, rank, seq_len, image_side, segments, fake, video_frames, compiled)
        for role, rank in ranks.items()
    }
    role = max(peaks, key=lambda r: peaks[r]["Total"])
    dims = layout.language.dims
    result = {
        "world_size": world_size,
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "cp": dims.cp,
        "tp": dims.tp,
        "seq_len": seq_len,
        "segments": segments,
        "micro_batch_size": cfg.micro_batch_size,
        "image_side": image_side,
        "video_frames": video_frames,
        "activation_checkpointing": cfg.parallel.activation_checkpointing,
        "compile": compiled,
        "param_dtype": cfg.precision.param_dtype,
        "fake": fake,
        "rank": ranks[role],
        "peak_bytes": peaks[role]["Total"],
        "peak_bytes_by_kind": _kinds(peaks[role]),
        "offload": cfg.parallel.offload,
        "moments_dtype": cfg.optimizer.moments_dtype,
        "host_bytes": sum(_host_kinds(peaks[role]).values()),
        "host_bytes_by_kind": _host_kinds(peaks[role]),
    }
    if layout.disjoint:
        result["modules"] = {
            m: {
                "rank": ranks[m],
                "ranks": [layout.grid(m).ranks.start, layout.grid(m).ranks.stop],
                "peak_bytes": peaks[m]["Total"],
                "peak_bytes_by_kind": _kinds(peaks[m]),
            }
            for m in ("vision", "language")
        }
    return result


def _kinds(peak: dict) -> dict:
    return {kind: n for kind, n in peak.items() if kind != "Total" and not kind.startswith(HOST)}


def _host_kinds(peak: dict) -> dict:
    return {kind.removeprefix(HOST): n for kind, n in peak.items() if kind.startswith(HOST)}


def _estimate_rank(
    cfg: TrainConfig,
    layout: RunLayout,
    rank: int,
    seq_len: int,
    image_side: int,
    segments: int,
    fake: bool,
    video_frames: int = 0,
    compiled: bool = False,
) -> dict:
    """Peak bytes per kind (and "Total") of global rank `rank` of `layout`; `compiled`: its blocks
    compiled as `parallel.compile` compiles them (`_compile_blocks`)."""
    device = torch.device("cpu")
    with _process_group(layout.world_size, fake, rank):
        # The meshes and the meta model are real; the materialized shards, optimizer state and steps
        # are fake.
        run = build_meta_run(cfg, layout, device, rank)
        if compiled:
            _compile_blocks(run.model, cfg.parallel.activation_checkpointing)
        # The rank's micro-batches, every row with an image or a video (an encoder rank: those of its
        # language ranks). Two micro-batches hold as much as more would: from the second on, the
        # unsynced gradients of the first are held too.
        micro_batches = min(layout.grad_accum_steps, 2)
        batches = iter(
            run.data(
                lambda data_rank, data_world: RandomBatches(
                    run.model.config,
                    seq_len=seq_len,
                    segments=segments,
                    image_fraction=0.0 if video_frames else 1.0,
                    micro_batch_size=cfg.micro_batch_size,
                    dp_rank=data_rank,
                    dp_world=data_world,
                    grad_accum_steps=micro_batches,
                    seed=cfg.seed,
                    image_side=image_side,
                    video_fraction=1.0 if video_frames else 0.0,
                    video_frames=video_frames or 1,
                    pairs=pairs_in_rows(cfg),
                    rollout=rollout_in_rows(cfg),
                )
            )
        )
        micro = [next(batches) for _ in range(micro_batches)]
        own = [] if run.role == "vision" else micro
        # What the step divides its loss by (the objective's count) scales the gradients, not their memory.
        label_tokens = float(sum(b.label_tokens for b in own)) * layout.data.dims.dp
        if run.bridge is not None:
            micro = run.bridge.plan_step(micro)
        micro = [to_device(b, device, run.context) for b in micro]  # an encoder rank's may hold no image
        with _fake_mode_with_constant_batch(fake) as mode:
            if mode is not None:
                convert = mode.fake_tensor_converter.from_real_tensor
                micro = [
                    b
                    if b is None
                    else b.map_tensors(lambda v: convert(mode, v, make_constant=not v.is_floating_point()))
                    for b in micro
                ]
            with _grouped_experts(run.model, cfg):
                return _peak_of_a_later_step(run, micro, label_tokens)


def _compile_blocks(model: nn.Module, checkpointing: str) -> None:
    """The blocks that `parallel.compile` compiles, compiled as AOTAutograd partitions them but run
    eagerly (`aot_eager_decomp_partition`): the tensors a compiled block keeps for its backward are
    those of AOTAutograd's partitioner, whose graphs inductor then only fuses, and the ops run on
    fake tensors. A compiled block keeps about 60% of what the eager one does
    (benchmarks/compiled_activations.py: the norms' scaling, SiLU and RoPE are recomputed).
    Blocks with a graph break stay eager, an upper bound: Gated DeltaNet layers, and MoE blocks
    under expert parallelism, whose dispatch reads the all-to-all's split sizes on the host, which
    fake tensors do not hold.
    Dynamo's compiled code is dropped first: the blocks of every model share their checkpoint
    wrapper's code, whose cache keeps 8 graphs (a LoRA stage alone compiles 3, DPO's reference
    forward 2 more), so a process estimating several stages (benchmarks/memory_recipes.py) would
    run the later ones' blocks eagerly, past the limit, not as their own process compiles them."""
    torch._dynamo.reset()
    stacks = [model.decoder_layers()]
    if model.vision_tower() is not None:
        stacks.append(model.vision_layers())
    for stack in stacks:
        apply_compile(stack, checkpointing, backend="aot_eager_decomp_partition", whole_graphs_only=True)


def _peak_tracker(root: nn.Module, optimizer: torch.optim.Optimizer, frozen: list[nn.Module]) -> "FSDPMemTracker":
    """torch's FSDP2 memory tracker of `root`, keeping only the device-wide peak; for a root without
    FSDP units (one rank), one that labels its weights, gradients and compute copies itself."""
    from vlmcore.train.peak_tracker import PeakTracker, PlainPeakTracker

    if isinstance(root, FSDPModule):
        return PeakTracker(root, optimizer, frozen)
    return PlainPeakTracker(root, optimizer, frozen)


def _peak_of_a_later_step(run: Run, micro: list, label_tokens: float) -> dict[str, int]:
    run.materialize(load=False)
    run.model.train()
    run.make_step()
    # One weight at a time: the closest to the fused AdamW, which allocates nothing, but whose
    # in-place outputs fake tensors count as new memory. The multi-tensor (foreach) step would
    # allocate temporaries the size of all the weights.
    for group in run.optimizer.param_groups:
        group["fused"] = group["foreach"] = False
    # The gradient norm one gradient at a time too: on fake sharded gradients (DTensors over more
    # than two ranks) the multi-tensor norm is counted as holding the gradients' whole (unsharded)
    # size, e.g. 2.25 GiB per MoE layer of Qwen3-VL-30B-A3B; no all-gather takes place and the
    # norm's outputs are one scalar per gradient, so this is the fake run's accounting, not memory.
    run.step.norm_foreach = False
    # The stage's objective, its reference (if any) of random init: the reference's forward runs in
    # each step (no gradients: its logits chunks, no saved activations); its weights, sharded as
    # the policy's, count beside the policy's, without gradients or optimizer state.
    frozen = use_objective(run, load=False)
    run.step.objective.compiled = False
    # An encoder rank's FSDP root is its vision tower.
    root = run.model.vision_tower() if run.role == "vision" else run.model
    tracker = _peak_tracker(root, run.optimizer, frozen)
    tracker.host_kinds = OFFLOADED if run.cfg.parallel.offload else ()
    # The micro-batches are on the device for the whole step. Their tensors go to the tracker one by
    # one: it looks for tensors with torch's pytree, which does not look into a Batch, and would
    # count a batch tensor only from the first op that returns a view of it (as an activation), and
    # never one that no op views (the pixels).
    tracker.track_inputs(tuple(_batch_tensors(micro)))
    with tracker, _untracked_sharding_propagation(tracker):
        # The tracker takes a second forward of the root for a bug unless its per-module stats
        # are cleared first (the peak is kept): every micro-batch starts with a clear. Registered
        # here, after the tracker has put its own hooks first.
        hook = root.register_forward_pre_hook(lambda *_: tracker.reset_mod_stats(), prepend=True)
        _first_step_state(run, tracker)
        run.step(micro, label_tokens, set_lr=lambda optimizer: None)
    hook.remove()
    peak = tracker.get_tracker_snapshot("peak")[run.device]
    peak = {str(getattr(kind, "value", kind)): int(n) for kind, n in peak.items()}
    return host_held(run, peak, tracker.host_peak)


# The kinds `parallel.offload` keeps in host memory, and the prefix of their host entries in a peak.
OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")
HOST = "host:"


def host_held(run: Run, peak: dict[str, int], offloaded_peak: int) -> dict[str, int]:
    """The peak of the device, with the host memory's tensors beside it under `HOST` kinds. With
    `parallel.offload` the weights' shards, their gradients and the optimizer state are in host
    memory (the fake run holds them on its one device; the tracker keeps the device's peak without
    them, and their own peak, `offloaded_peak`). The shard and gradient of the unit in transit (one
    block's) are not counted on the device. With `checkpoint.async`, the host copy of the
    checkpoint (`_staged_bytes`)."""
    peak = dict(peak)
    if run.cfg.checkpoint.enabled and run.cfg.checkpoint.async_save:
        peak[HOST + "Checkpoint staging"] = _staged_bytes(run)
    if not run.cfg.parallel.offload:
        return peak
    for kind in OFFLOADED:
        peak["Total"] -= peak.pop(kind, 0)
    peak[HOST + "Offloaded states"] = offloaded_peak
    return peak


def _staged_bytes(run: Run) -> int:
    """The host copy an async checkpoint is written from (`checkpoint.async`, kept from save to save):
    this rank's shards of the weights it saves (with LoRA, the adapters) and the optimizer state."""
    from vlmcore.models.lora import has_adapters

    weights = run.step.trainable if has_adapters(run.model) else list(run.model.parameters())
    state = [t for s in run.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(_local_bytes(t) for t in [*weights, *state])


def _local_bytes(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", tensor)
    return local.numel() * local.element_size()


@contextmanager
def _untracked_sharding_propagation(tracker: "FSDPMemTracker") -> Iterator[None]:
    """DTensor's sharding propagation runs an op on fake tensors of its global shapes, the first
    time it sees the op with those inputs (it caches the result), to learn its output's shape: no
    memory on a GPU. Under the estimate's fake mode the tracker cannot tell those ops from the
    step's and would count their outputs (as temporaries, in backward) in the first step that
    meets each op, e.g. 160 KB more at the peak of a tiny Qwen3-VL under tp 2. The tracker skips
    them here."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def untracked(propagator: ShardingPropagator, op_schema: object) -> object:
        tracker.in_sharding_propagation += 1
        try:
            return propagate(propagator, op_schema)
        finally:
            tracker.in_sharding_propagation -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = untracked
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate


def _first_step_state(run: Run, tracker: "PeakTracker") -> None:
    """What a run's first step leaves for the next: the optimizer state of every trainable weight,
    made by an optimizer step on zero gradients. The first step holds the same as a later one but
    for that state, so its peak is never the larger; tracing its forward and backward would double
    the estimate's time. The figures are those of tracing two whole steps, to the byte: nothing
    else outlives a step (its activations, gradients and communication buffers are freed by its
    end), the inputs are counted from the start either way (`track_inputs`), and DTensor's sharding
    propagation, which runs in the first step that meets each op only, is not counted either way
    (`_untracked_sharding_propagation`)."""
    tracker.zero_gradients(run.step.trainable)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def _batch_tensors(micro: list[Batch | None]) -> list[torch.Tensor]:
    """The tensors of the micro-batches, their images' and videos' included."""
    tensors = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        tensors.append(tensor)
        return tensor

    for batch in micro:
        if batch is not None:  # an encoder rank's micro-batch without an image
            batch.map_tensors(collect)
    return tensors


def format_table(result: dict) -> str:
    unit, scale = ("GiB", 2**30) if result["peak_bytes"] >= 2**30 else ("MiB", 2**20)
    side = result["image_side"]
    image = f"image {side}x{side} merged patches" if side else "no image"
    if side and result.get("video_frames"):
        image = f"video of {result['video_frames']} frame groups of {side}x{side} merged patches"
    cp = f"cp {result['cp']} x " if result.get("cp", 1) > 1 else ""
    mesh = f"dp_replicate {result['dp_replicate']} x dp_shard {result['dp_shard']} x {cp}tp {result['tp']}"
    lines = [
        f"peak memory per device, rank {result['rank']} of {result['world_size']} ({mesh}), "
        f"{result['micro_batch_size']} x {result['seq_len']} tokens, {image}, "
        f"activation checkpointing {result['activation_checkpointing']}, {result['param_dtype']} compute, "
        f"{'compiled blocks' if result.get('compile') else 'eager'}"
    ]
    modules = result.get("modules") or {"": result}
    width = 18 if "modules" in result else 10
    lines.append(f"{'kind':<16}" + "".join(f"{(m + ' ' if m else '') + unit:>{width}}" for m in modules))
    kinds = dict.fromkeys(k for m in modules.values() for k, n in m["peak_bytes_by_kind"].items() if n)
    for kind in kinds:
        lines.append(
            f"{kind:<16}"
            + "".join(f"{m['peak_bytes_by_kind'].get(kind, 0) / scale:>{width}.2f}" for m in modules.values())
        )
    lines.append(f"{'total':<16}" + "".join(f"{m['peak_bytes'] / scale:>{width}.2f}" for m in modules.values()))
    host = result.get("host_bytes_by_kind") or {}
    lines.append(
        f"{'host memory':<16}{result.get('host_bytes', 0) / scale:>{width}.2f}"
        + (" (" + ", ".join(f"{k} {n / scale:.2f}" for k, n in host.items()) + ")" if host else "")
    )
    if "rollout" in result:
        r = result["rollout"]
        lines.append(
            f"rollout (grpo)  {r['peak_bytes'] / scale:>{width}.2f} ({r['prompts']} prompts x group = {r['rows']} rows "
            f"of {r['tokens']} tokens: resident {r['resident_bytes'] / scale:.2f}, gathered weights "
            f"{r['gathered_weights_bytes'] / scale:.2f}, cache {r['cache_bytes'] / scale:.2f}, prefill "
            f"{r['prefill_bytes'] / scale:.2f}, decode {r['decode_bytes'] / scale:.2f}); the peak is the larger "
            "of the step's total and this"
        )
    if "modules" in result:
        lines.append(
            "modules: "
            + ", ".join(
                f"{name} on ranks [{m['ranks'][0]}, {m['ranks'][1]}) (estimated on rank {m['rank']})"
                for name, m in modules.items()
            )
        )
    return "\n".join(lines)
