"""Applies the parallelisms in their required order: TP, EP, activation checkpointing, per-block
compile, then FSDP2 (FSDP, HSDP or DDP by the mesh)."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from vlmcore.config import TrainConfig
from vlmcore.parallel.ac import apply_ac
from vlmcore.parallel.compile import apply_compile
from vlmcore.parallel.expert_parallel import apply_ep
from vlmcore.parallel.fsdp import apply_fsdp
from vlmcore.parallel.mesh import ParallelDims, dp_mesh
from vlmcore.parallel.tp import apply_tp


def parallelize(model: nn.Module, cfg: TrainConfig, mesh: DeviceMesh, dims: ParallelDims) -> list:
    """Returns the (module, attribute name) of the parameters whose gradients must be summed over
    the TP ranks."""
    blocks, vision = model.decoder_layers(), model.vision_tower()
    partial = []
    if dims.tp > 1:
        partial = apply_tp(model, mesh["tp"], cfg.parallel.sequence_parallel)
    if dims.ep > 1:
        apply_ep(model, mesh["ep"])
    for stack in [blocks] + ([model.vision_layers()] if vision is not None else []):
        apply_ac(stack, cfg.parallel.activation_checkpointing)
        if cfg.parallel.compile:
            apply_compile(stack)
    # The vision tower is not tensor parallel; under TP it is sharded over all ranks.
    vision_mesh = dp_mesh(mesh, dims)
    if dims.tp > 1:
        vision_mesh = init_device_mesh(mesh.device_type, (dims.world_size,), mesh_dim_names=("all",))
    expert_mesh = dp_mesh(mesh, dims, "dp_shard_mod_ep") if dims.ep > 1 else None
    apply_fsdp(model, list(blocks.children()), vision, dp_mesh(mesh, dims), vision_mesh, vision_replicas=dims.tp,
               expert_mesh=expert_mesh, param_dtype=getattr(torch, cfg.precision.param_dtype),
               reduce_dtype=getattr(torch, cfg.precision.reduce_dtype))
    return partial
