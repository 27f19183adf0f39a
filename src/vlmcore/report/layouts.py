"""Which per-module layout pays: a cost model of the training step for each candidate layout.

Inputs (`Workload`): the compute of one optimizer step of each module, in device-seconds summed
over all ranks (S_v for the vision tower, S_l for the LLM: from measured `vision_time_s` and
`llm_time_s` times the world size, or from FLOPs / achieved FLOP/s, see `seconds_from_flops`),
the parameter counts P_v, P_l, the vision patches and image tokens of the step, and the shapes
that size the messages; and the cluster (`Cluster`): GPUs per node, bandwidth per GPU inside a
node (B_in, NVLink) and between nodes (B_out, InfiniBand), the TP efficiency e kept per doubling.

A module m on n ranks with tensor parallel degree t (its FSDP group has d = n / t ranks):

    compute_m(n, t) = S_m / n / e^log2(t / t_0)                  (same work per rank, thinner matmuls)
    fsdp_m(n, t)    = (P_m / t) (g_m M b + b_r) (d - 1) / d / B  (g_m all-gathers per micro-batch, one
                                                                  reduce-scatter of the gradients per step)
    time_m(n, t)    = max(compute_m, fsdp_m)                     (FSDP prefetch overlaps its traffic)
    tp_v(n, t)      = 8 depth_v (t - 1) (patches / n) h_v b / B_in
                      (per vision block, forward and backward: 4 + 4 all-gathers / reduce-scatters of
                       the activations of the t ranks' patches, each rank moving (t-1)/t of them)

with t_0 the TP degree S_m was measured at (vision 1; LLM t_l, which it keeps in every layout),
M micro-batches per step, b bytes per parameter and activation (bf16: 2), b_r per reduced
gradient (fp32: 4), B = B_in when the group fits in a node, else B_out. g_l = 2 (the LLM's blocks
are gathered for forward and again for backward), g_v = 1 (vlmcore's vision tower is one FSDP
unit kept unsharded from forward to backward, parallel/fsdp.py).

    colocated, vision TP t:  step = time_v(W, t) + tp_v(W, t) + time_l(W, t_l)
        every rank runs the vision tower then the LLM, one after the other.
    disjoint, k vision ranks: V = time_v(k, 1),  L = time_l(W - k, t_l)
        step = max(V, L) + min(V, L) / M + bridge
        bridge = 2 n_t image_tokens h_out b / (min(k, W - k) B)      (B of the whole world)
        the encoder ranks work on micro-batch i + 1 while the LLM ranks work on micro-batch i
        (with M = 1 nothing overlaps: V + L); the bridge sends the n_t merged image-embedding
        tensors (1 + DeepStack levels) forward and their gradients back.

A layout is a candidate when its degrees divide: t a power of two within a node dividing W and
the vision heads; for disjoint, W - k divisible by t_l, and the step's rows G = (W / t_l) mbs M
divisible by each module's data-parallel size (k and (W - k) / t_l), so every module sees the
whole global batch. Baseline: colocated with vision TP 1 (what vlmcore does without
`parallel.modules`); speed-up = baseline step / candidate step.

Measured times are taken as compute: FSDP traffic a run already exposed is in them, so the
prediction is conservative for layouts that move less. Not modelled: memory (a layout must also
fit: `vlmcore memory`), the load imbalance of images over ranks, pipeline bubbles beyond the
fill term, HSDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: transformers comes in (through vlmcore.models) where a config is read
    import pandas as pd
    from transformers import PretrainedConfig


@dataclass
class Cluster:
    """JUPITER (4 GH200) and MareNostrum 5 ACC (4 H100) nodes alike: 4 GPUs, NVLink 4 between
    pairs (6 links, 150 GB/s per direction), one NDR200 InfiniBand port per GPU (25 GB/s). Peak
    link figures: measured NCCL bus bandwidth (nccl-tests) is the better input where known."""

    gpus_per_node: int = 4
    intra_node_gbs: float = 150.0
    inter_node_gbs: float = 25.0
    tp_efficiency: float = 0.9  # compute efficiency kept per doubling of tensor parallelism
    dtype_bytes: int = 2
    reduce_bytes: int = 4


@dataclass
class Workload:
    """One optimizer step of a recipe, summed over all ranks."""

    vision_s: float  # device-seconds of vision tower forward + backward
    llm_s: float  # device-seconds of everything else of forward + backward
    vision_params: int
    llm_params: int
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    patches: float  # vision patches in the step
    image_tokens: float  # merged image tokens (patches / merge**2) the bridge sends
    bridge_hidden: int  # out_hidden_size: width of an image token for the LLM
    bridge_tensors: int = 1  # 1 + DeepStack levels
    micro_batches: int = 1  # gradient accumulation steps M
    micro_batch_size: int = 1
    llm_tp: int = 1


@dataclass
class Prediction:
    layout: str
    vision_tp: int
    vision_ranks: int
    llm_ranks: int
    vision_s: float  # per-step time of the vision part (its compute or FSDP traffic, and its TP traffic)
    llm_s: float
    bridge_s: float
    step_s: float
    speedup: float = 1.0  # against the baseline (colocated, vision TP 1)


def seconds_from_flops(flops: float, achieved_tflops: float) -> float:
    """Device-seconds of `flops` at `achieved_tflops` per device (peak x MFU)."""
    return flops / (achieved_tflops * 1e12)


def _bandwidth(cluster: Cluster, ranks: int) -> float:
    return (cluster.intra_node_gbs if ranks <= cluster.gpus_per_node else cluster.inter_node_gbs) * 1e9


def module_time(
    compute_s: float, params: int, ranks: int, tp: int, measured_tp: int, gathers: int, w: Workload, c: Cluster
) -> float:
    """max(compute, FSDP traffic) of a module on `ranks` ranks with tensor parallel `tp` (its
    compute measured at `measured_tp`), its parameters all-gathered `gathers` times per micro-batch."""
    compute = compute_s / ranks / c.tp_efficiency ** math.log2(tp / measured_tp)
    shard = ranks // tp
    per_param = gathers * w.micro_batches * c.dtype_bytes + c.reduce_bytes
    fsdp = params / tp * per_param * (shard - 1) / shard / _bandwidth(c, ranks)
    return max(compute, fsdp)


def vision_tp_traffic(w: Workload, c: Cluster, world: int, tp: int) -> float:
    return (
        8 * w.vision_depth * (tp - 1) * (w.patches / world) * w.vision_hidden * c.dtype_bytes / (c.intra_node_gbs * 1e9)
    )


def colocated(w: Workload, c: Cluster, world: int, vision_tp: int) -> Prediction:
    tp_traffic = vision_tp_traffic(w, c, world, vision_tp)
    vision = module_time(w.vision_s, w.vision_params, world, vision_tp, 1, 1, w, c) + tp_traffic
    llm = module_time(w.llm_s, w.llm_params, world, w.llm_tp, w.llm_tp, 2, w, c)
    return Prediction(f"colocated, vision TP {vision_tp}", vision_tp, world, world, vision, llm, 0.0, vision + llm)


def disjoint(w: Workload, c: Cluster, world: int, vision_ranks: int) -> Prediction:
    k = vision_ranks
    rest = world - vision_ranks
    vision = module_time(w.vision_s, w.vision_params, k, 1, 1, 1, w, c)
    llm = module_time(w.llm_s, w.llm_params, rest, w.llm_tp, w.llm_tp, 2, w, c)
    bridge_bytes = 2 * w.bridge_tensors * w.image_tokens * w.bridge_hidden * c.dtype_bytes
    bridge = bridge_bytes / (min(k, rest) * _bandwidth(c, world))
    step = max(vision, llm) + min(vision, llm) / w.micro_batches + bridge
    return Prediction(f"disjoint, {k} vision + {rest} LLM ranks", 1, k, rest, vision, llm, bridge, step)


def candidates(w: Workload, c: Cluster, world: int) -> list[Prediction]:
    """Every layout whose degrees divide (module docstring), baseline first."""
    tps = [1 << i for i in range(min(c.gpus_per_node, world).bit_length())]  # the powers of two up to a node
    rows = world // w.llm_tp * w.micro_batch_size * w.micro_batches
    colocated_layouts = [colocated(w, c, world, tp) for tp in tps if world % tp == 0 and w.vision_heads % tp == 0]
    disjoint_layouts = [
        disjoint(w, c, world, k)
        for k in range(1, world)
        if (world - k) % w.llm_tp == 0 and rows % k == 0 and rows % ((world - k) // w.llm_tp) == 0
    ]
    return colocated_layouts + disjoint_layouts


def compare(w: Workload, c: Cluster, world: int) -> list[Prediction]:
    """The candidates, fastest first, each with its speed-up over the baseline."""
    layouts = candidates(w, c, world)
    base = layouts[0].step_s
    for p in layouts:
        p.speedup = base / p.step_s
    return sorted(layouts, key=lambda p: p.step_s)


def workload_of(config: PretrainedConfig, vision_s: float, llm_s: float, patches: float, **step: int) -> Workload:
    """A Workload for an HF model config (Qwen3-VL / Qwen3.5): parameter counts from the model
    built on the meta device, shapes from its vision config; `step`: the Workload fields
    micro_batches, micro_batch_size and llm_tp."""
    from vlmcore.models import build_model

    model = build_model(config, device="meta")
    vision_params = sum(p.numel() for p in model.vision_tower().parameters())
    v = config.vision_config
    return Workload(
        vision_s=vision_s,
        llm_s=llm_s,
        vision_params=vision_params,
        llm_params=sum(p.numel() for p in model.parameters()) - vision_params,
        vision_depth=v.depth,
        vision_hidden=v.hidden_size,
        vision_heads=v.num_heads,
        patches=patches,
        image_tokens=patches / v.spatial_merge_size**2,
        bridge_hidden=v.out_hidden_size,
        bridge_tensors=1 + len(getattr(v, "deepstack_visual_indexes", None) or []),
        **step,
    )


def flops_workload(
    config: PretrainedConfig,
    rows: int,
    seq_len: int,
    image_grids: list[list[int]],
    achieved_tflops: float,
    **step: int,
) -> Workload:
    """A Workload before any run, from FLOPs (vlmcore.models.flops): `rows` packed rows per step,
    each one segment of `seq_len` tokens holding the images `image_grids` ([t, h, w] in patches),
    at `achieved_tflops` per device; `step` as in workload_of."""
    from vlmcore.models.flops import llm_flops, vision_flops

    return workload_of(
        config,
        vision_s=seconds_from_flops(rows * vision_flops(config, image_grids), achieved_tflops),
        llm_s=seconds_from_flops(rows * llm_flops(config, [seq_len]), achieved_tflops),
        patches=rows * sum(t * h * w for t, h, w in image_grids),
        **step,
    )


def measured_workload(metrics: pd.DataFrame, settings: dict, warmup_steps: int) -> Workload | None:
    """The Workload of a training run from its metrics.jsonl rows (a DataFrame) and config.yaml:
    means of `vision_time_s`, `llm_time_s` and `vision_patches` after the warm-up steps, times the
    ranks that run them. None when the run has no module times (metrics.module_times off, a text
    model, a run from before they were logged). Raises ValueError when its model config is gone."""
    from vlmcore.models import load_hf_config

    measured = metrics.iloc[warmup_steps:]
    if measured.empty or "vision_time_s" not in measured or measured["vision_time_s"].isna().all():
        return None
    world = int(metrics["world_size"].iloc[0])
    parallel = settings.get("parallel", {})
    modules = parallel.get("modules") or {}
    llm_tp = (modules.get("language") or {}).get("tp") or parallel.get("tp", 1)
    # Under vision TP a rank's tower runs on the images of the language data-parallel ranks of its
    # vision TP group (parallel/bridge.py): vision_tp / llm_tp batches, counted once per group.
    shared = max(1, ((modules.get("vision") or {}).get("tp") or 1) // llm_tp)
    try:
        config = load_hf_config(settings["model_path"])
    except (KeyError, OSError, ValueError) as e:
        raise ValueError(f"no model config ({e})") from None
    return workload_of(
        config,
        vision_s=measured["vision_time_s"].mean() * world,
        llm_s=measured["llm_time_s"].mean() * world,
        patches=measured["vision_patches"].mean() * world / llm_tp / shared,  # TP peers share a batch
        micro_batches=settings.get("grad_accum_steps", 1),
        micro_batch_size=settings.get("micro_batch_size", 1),
        llm_tp=llm_tp,
    )
