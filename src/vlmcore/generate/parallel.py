"""Generation on the model as `vlmcore.parallel.parallelize` left it.

Tensor parallelism needs nothing here: every layer keeps its rank's heads (the caches are made
from the shapes the layers give them) and its collectives run as in training, the TP ranks
generating the same rows in step.

FSDP2: the strategy for a rollout is to gather the sharded weights once (`gathered_weights`),
not per layer as training does. Per layer, every decoding step all-gathers every block again,
so a rollout of N tokens moves the model's weights N times over the network, and every rank must
run the same number of steps, even one whose rows have all stopped, or the others wait in an
all-gather. Gathered once, a rollout moves them once, and each rank's decoding runs on its own.
The gathered weights are FSDP2's own unsharded parameters (the buffers training unshards into,
one block at a time), not a second copy of the model: the cost is holding the whole model
unsharded for the rollout.

Expert parallelism: every MoE block's forward is an all-to-all over the `ep` group, whose ranks
hold different rows (EP is made of data-parallel ranks). So the ranks of an `ep` group decode in
lockstep (`lockstep_group`): each step they agree whether any of them still has a row going
(`any_going`), and a rank whose rows have all stopped joins its peers' steps with one row whose
tokens are not kept, until all have stopped or reached max_new_tokens.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered_weights(model: nn.Module) -> Iterator[None]:
    """Inside: every FSDP2 unit of `model` unsharded, and kept so by its forwards (no collective of
    FSDP2 while generating). After: resharded, each unit's reshard_after_forward as it was. Nothing
    happens to a model without FSDP2."""
    units = fsdp_modules(model)
    if not units:
        yield
        return
    # The root's own setting (kept unsharded after forward) is made at its lazy init, at the first
    # forward: made now, so that what is restored afterwards is what training runs with.
    units[0]._get_fsdp_state()._lazy_init()
    resharding = [reshards_after_forward(m) for m in units]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, reshard in zip(units, resharding):
            unit.reshard()
            unit.set_reshard_after_forward(reshard, recurse=False)


def reshards_after_forward(unit: FSDPModule) -> bool:
    group = unit._get_fsdp_state()._fsdp_param_group
    return group is not None and group.post_forward_mesh_info is not None


def lockstep_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group whose ranks must run every decoding step together: the `ep` group of the
    model's MoE blocks under expert parallelism (their all-to-all dispatch); None otherwise."""
    from vlmcore.models.moe import moe_blocks
    from vlmcore.parallel.expert_parallel import AllToAllDispatch

    for block in moe_blocks(model):
        if isinstance(block.dispatch, AllToAllDispatch):
            return block.dispatch.group
    return None


def any_going(going: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether this rank (no group) or any rank of `group` still has a row to decode."""
    if group is None:
        return going
    flag = torch.tensor([int(going)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
