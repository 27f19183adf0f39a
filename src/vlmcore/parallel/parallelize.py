"""Applies the parallelisms to a model on the meta device, in their required order: the float8
conversion of the language model's linear layers (`precision.fp8`, before TP and FSDP wrap them),
TP, EP, CP, activation checkpointing, per-block compile, then FSDP2 (FSDP, HSDP or DDP by the mesh). The run
layout says what this rank holds: under colocated layouts both modules, the language model on the
language mesh and the vision tower on its own layout of the same ranks; under disjoint layouts one
module on its own ranks (vlmcore.parallel.disjoint). The layout was checked against the model
before (vlmcore.parallel.checks)."""

from torch import nn

from vlmcore.config import TrainConfig
from vlmcore.parallel.ac import apply_ac
from vlmcore.parallel.bridge import VisionBridge, count_images_once
from vlmcore.parallel.cp import apply_cp
from vlmcore.parallel.disjoint import hold_one_module
from vlmcore.parallel.expert_parallel import apply_ep
from vlmcore.parallel.float8 import convert_to_float8
from vlmcore.parallel.fsdp import apply_fsdp
from vlmcore.parallel.layout import RunLayout
from vlmcore.parallel.mesh import Meshes
from vlmcore.parallel.tp import apply_tp, apply_vision_tp


def parallelize(model: nn.Module, cfg: TrainConfig, layout: RunLayout, meshes: Meshes, rank: int) -> list:
    """Returns the (module, attribute name) of the parameters whose gradients must be summed over
    the TP ranks."""
    fp8 = cfg.precision.fp8
    if fp8.recipe != "none":
        converted = convert_to_float8(model.decoder_layers(), fp8)
        if rank == 0:
            print(f"fp8: {fp8.recipe}{' (emulated)' if fp8.emulate else ''}: {len(converted)} linear layers converted")
    role = layout.role(rank)
    if role != "both":
        hold_one_module(model, role, cfg, meshes)
        return []
    dims = layout.language.dims
    blocks = model.decoder_layers()
    vision = model.vision_tower()
    partial = apply_tp(model, meshes.tp(), cfg.parallel.sequence_parallel) if dims.tp > 1 else []
    if dims.ep > 1:
        apply_ep(model, meshes.ep())
    if dims.cp > 1:
        apply_cp(model, meshes.cp())
    if vision is not None:
        if layout.vision.dims.tp > 1:
            apply_vision_tp(model, meshes.tp("vision"))
            VisionBridge(vision, meshes.tp("vision"), dims.tp)
        count_images_once(vision, dims.tp)
    for stack in [blocks] + ([model.vision_layers()] if vision is not None else []):
        apply_ac(stack, cfg.parallel.activation_checkpointing, cfg.parallel.compile)
    apply_fsdp(
        model,
        list(blocks.children()),
        vision,
        meshes.dp(),
        meshes.dp("vision") if vision is not None else None,
        cfg.precision,
        expert_mesh=meshes.expert_dp() if dims.ep > 1 else None,
        one_rank_cast=cfg.parallel.one_rank_cast,
        offload=cfg.parallel.offload,
    )
    return partial
