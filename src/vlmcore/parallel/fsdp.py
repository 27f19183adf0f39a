"""FSDP2 (fully_shard) wrapping: one unit per decoder block, the vision tower as one unit, the
rest (embeddings, final norm, LM head) in the root unit. On a 2-D mesh the same call gives HSDP,
and with a shard size of 1 it is plain data parallelism (DDP)."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], vision: nn.Module | None, mesh: DeviceMesh,
               vision_mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """`vision_mesh`: the vision tower's own data-parallel mesh (vlmcore.parallel.bridge)."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
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
