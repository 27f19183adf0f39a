"""Expert parallelism: each rank of an `ep` group holds num_experts / ep of every MoE block's
experts (`gate_up_proj` / `down_proj` as DTensors, Shard(0) over the `ep` mesh), and the block's
tokens travel to the ranks holding their experts and back.

Dispatch, per MoE block (`AllToAllDispatch`, the block's dispatcher: rows already sorted by expert):
  1. all-to-all of the tokens-per-expert counts: each rank learns how many rows it gets from
     every peer for each of its local experts;
  2. one host read of the split sizes per block (all-to-all takes host integers: `_split_sizes`);
  3. all-to-all of the rows (differentiable: its backward is the reverse all-to-all), which
     arrive grouped by source rank, then by local expert; regrouped by local expert, run through
     the local experts, put back in arrival order;
  4. all-to-all back: the outputs return to their rows' ranks, in the order they were sent.

Gradients: an expert's gradient on its EP rank already sums the contributions of every peer's
tokens (through the all-to-all's backward); FSDP then sums over the data-parallel ranks
orthogonal to EP (`dp_shard_mod_ep`, and `dp_replicate`), with the loss normalised globally as
for every other parameter, so no factor differs.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from vlmcore.models.moe import GroupedExperts, moe_blocks


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shards every MoE block's experts over `ep_mesh` and gives the block the all-to-all dispatch."""
    for block in moe_blocks(model):
        experts = block.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        block.dispatch = AllToAllDispatch(ep_mesh.get_group())


class AllToAllDispatch:
    """Rows to the ranks of the `ep` group holding their experts and back (the steps above)."""

    reads_host = True  # the all-to-all's split sizes

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        """x: (N, H) rows sorted by (global) expert, `counts[e]` rows for expert e -> the experts'
        outputs, same rows and order. Rank r of the group holds experts [r * L, (r + 1) * L)."""
        ep = dist.get_world_size(self.group)
        local = experts.num_experts // ep
        received = torch.empty_like(counts)  # received[src * L + l]: rows from rank src for local expert l
        dist.all_to_all_single(received, counts, group=self.group)
        send, recv = _split_sizes(counts.view(ep, local).sum(1), received.view(ep, local).sum(1), x.shape[0])
        rows = all_to_all_single_autograd(x, recv, send, self.group)
        expert = torch.repeat_interleave(
            torch.arange(local, device=x.device).repeat(ep), received, output_size=rows.shape[0]
        )
        order = torch.argsort(expert, stable=True)
        y = experts(rows[order], received.view(ep, local).sum(0))
        y = torch.zeros_like(y).index_copy(0, order, y)
        return all_to_all_single_autograd(y, send, recv, self.group)


def _split_sizes(send: torch.Tensor, recv: torch.Tensor, rows: int) -> list[list[int]]:
    """Rows sent to and received from each peer, read on the host. A fake tensor (the memory
    estimate) has no values: each peer then gets an equal part of the rows (balanced routing)."""
    if isinstance(send, FakeTensor):
        ep = send.shape[0]
        even = [rows // ep + (r < rows % ep) for r in range(ep)]
        return [even, even]
    return torch.stack([send, recv]).tolist()
