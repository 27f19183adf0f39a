"""Context parallelism by all-to-all over heads (the scheme of DeepSpeed-Ulysses), for rows too
long for one GPU (`parallel.cp`).

A packed row is cut into `cp` contiguous chunks, one a rank (`Batch.context_chunk`): embeddings,
norms, MLPs, the LM head and the loss run on the rank's chunk, so activations shrink by cp.
Attention needs the whole row: an all-to-all before it gives each rank the whole row for 1/cp of
the heads (`sequence_to_heads`), one after it gives each rank its chunk back with every head
(`heads_to_sequence`). In between each rank runs its usual packed-row kernel on whole documents:
causal masking and document boundaries need nothing new, and every rank does exactly 1/cp of
the attention work whatever the documents' lengths, with no balancing (which a ring over
sequence chunks needs). Qwen3.5's Gated DeltaNet splits the same way, its recurrence and short
convolution running per head (per channel) over whole sequences: one all-to-all of its inputs,
one of its output (`UlyssesAttention.channels_to_rows`).

Composes with FSDP (over dp_shard x cp), TP (the all-to-all splits a TP rank's heads further),
EP (experts split over dp_shard x cp) and per-module layouts, colocated or disjoint; the MoE
load-balancing loss is the whole rows' (vlmcore.models.moe.RoutingStats). The limit: cp divides
the k/v heads a rank holds (Qwen3-VL-8B: 8, divided by tp), beyond which a ring over the heads'
sequence chunks is the way (docs/hpc.md, "Context parallelism").
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

# An attention kernel: attend(q, k, v, **kwargs) -> the attention output.
Attend = Callable[..., torch.Tensor]


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """(B, S/cp, H, D) chunk of every head -> (B, S, H/cp, D): the whole row, this rank's heads."""
    batch, chunk, heads, dim = x.shape
    if heads % cp:
        raise ValueError(f"{heads} heads do not split over cp {cp} ranks")
    # Head group j goes to rank j; what arrives from rank i is sequence chunk i.
    x = x.reshape(batch, chunk, cp, heads // cp, dim).permute(2, 0, 1, 3, 4).contiguous()
    x = all_to_all_single_autograd(x, None, None, group)
    return x.permute(1, 0, 2, 3, 4).reshape(batch, cp * chunk, heads // cp, dim)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """(B, S, H/cp, D) of this rank's heads -> (B, S/cp, H, D): this rank's chunk, every head."""
    batch, length, heads, dim = x.shape
    # Sequence chunk i goes to rank i; what arrives from rank j is head group j.
    x = x.reshape(batch, cp, length // cp, heads, dim).permute(1, 0, 2, 3, 4).contiguous()
    x = all_to_all_single_autograd(x, None, None, group)
    return x.permute(1, 2, 0, 3, 4).reshape(batch, length // cp, cp * heads, dim)


def ulysses_attention(
    attend: Attend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    cp: int,
    **kwargs: object,
) -> torch.Tensor:
    """`attend(q, k, v, **kwargs)` (vlmcore.models.attention.attention, with the whole row's
    cu_seqlens) on q (B, S/cp, Hq, D), k/v (B, S/cp, Hkv, D) chunks -> the (B, S/cp, Hq, D) chunk
    of the whole row's attention. Grouped-query heads stay grouped: rank j holds q heads
    [j Hq/cp, (j+1) Hq/cp) and the k/v heads they read, [j Hkv/cp, (j+1) Hkv/cp)."""
    q, k, v = (sequence_to_heads(t, group, cp) for t in (q, k, v))
    return heads_to_sequence(attend(q, k, v, **kwargs), group, cp)


class UlyssesAttention:
    """What a model's token mixer calls under context parallelism: softmax attention calls it
    instead of its kernel; Gated DeltaNet moves its per-channel inputs and its output with it."""

    def __init__(self, group: dist.ProcessGroup, cp: int) -> None:
        self.group = group
        self.cp = cp
        self.rank = dist.get_rank(group)

    def __call__(
        self, attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object
    ) -> torch.Tensor:
        return ulysses_attention(attend, q, k, v, self.group, self.cp, **kwargs)

    def channels_to_rows(self, x: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """(B, S/cp, C) chunk of every channel, C made of `blocks` of per-head channels -> (B, S, C/cp):
        the whole rows for this rank's share (`rank` of `cp` equal parts) of every block."""
        shares = [block.unflatten(-1, (self.cp, -1)) for block in x.split(blocks, dim=-1)]
        return sequence_to_heads(torch.cat(shares, dim=-1), self.group, self.cp).flatten(-2)

    def heads_to_chunk(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H/cp, D) whole rows of this rank's heads -> (B, S/cp, H, D): its chunk, every head."""
        return heads_to_sequence(x, self.group, self.cp)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Every token mixer of the language model (softmax attention, Gated DeltaNet) works on the cp
    ranks' whole rows."""
    context_parallel = UlyssesAttention(cp_mesh.get_group(), cp_mesh.size())
    for block in model.decoder_layers():
        for mixer in ("self_attn", "linear_attn"):
            if hasattr(block, mixer):
                getattr(block, mixer).context_parallel = context_parallel
