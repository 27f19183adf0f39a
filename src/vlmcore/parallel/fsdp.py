"""FSDP2 (fully_shard) wrapping: one unit per decoder block, the vision tower as one unit, the
rest (embeddings, final norm, LM head) in the root unit. On a 2-D mesh the same call gives HSDP,
and with a shard size of 1 it is plain data parallelism (DDP). Under expert parallelism each
block's experts (already sharded over `ep`) are a unit of their own over the data-parallel ranks
orthogonal to EP. Over a single rank with no dtype to cast to (fp32 training, as on CPU) the model
stays a plain module, as torchtitan leaves it without FSDP: there FSDP would only copy every
weight and gradient, twice each per step (13% of a tiny MoE's CPU step)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from vlmcore.config import PrecisionConfig
from vlmcore.models.moe import moe_blocks


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    vision: nn.Module | None,
    mesh: DeviceMesh,
    vision_mesh: DeviceMesh,
    precision: PrecisionConfig,
    expert_mesh: DeviceMesh | None = None,
    shard_one_rank: bool = False,
) -> None:
    """`vision_mesh`: the vision tower's own data-parallel mesh (vlmcore.parallel.bridge);
    `expert_mesh`: the experts' under expert parallelism; `shard_one_rank`: FSDP units even over
    one rank without a cast (the memory estimate: torch's tracker of plain modules fails on frozen
    weights)."""
    param_dtype = getattr(torch, precision.param_dtype)
    reduce_dtype = getattr(torch, precision.reduce_dtype)
    if (
        not shard_one_rank
        and dist.get_world_size() == 1
        and all(p.dtype == param_dtype == reduce_dtype for p in model.parameters())
    ):
        return
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        if expert_mesh is not None:
            for moe in moe_blocks(block):
                fully_shard(moe.experts, mesh=expert_mesh, mp_policy=mp_policy)
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    if vision is not None:
        # Kept unsharded from forward to backward: no all-gather during backward, whose position
        # would differ between ranks with and without images (DeepStack feeds several layers);
        # the reduce-scatter then runs at the end of backward, in the same order on every rank.
        fully_shard(vision, mesh=vision_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    # The root keeps embed_tokens and lm_head together (they may be tied) and, being the root,
    # stays unsharded from forward to backward, so the loss can use lm_head.weight directly.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already divided by the global number of label tokens: reduce by SUM.
            # (The vision tower's repeated images are counted once by vlmcore.parallel.bridge.)
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives (no PREMUL_SUM: gloo lacks it).
            module.set_force_sum_reduction_for_comms(True)
