"""Tensor-parallel plans (DTensor `parallelize_module`) for Qwen3, Qwen3-VL and Qwen3.5 (the degrees
are checked against the model's heads before: vlmcore.parallel.checks).

Per decoder block, attention heads and the MLP are split: q/k/v (and Qwen3.5's gated q) and
gate/up are column-parallel, o/down row-parallel, so each rank holds whole heads. The embedding
is vocabulary-parallel, and the LM head weight is sharded on the vocabulary, which the chunked
loss uses directly (vocabulary-parallel loss).

Sequence parallelism (default): between the sub-blocks the residual stream and the norms are
split on the sequence (Shard(1)); each attention or MLP all-gathers its input and reduce-scatters
its output, the traffic of the all-reduce that closes each sub-block without it, but norms and
residual activations take 1/tp of the memory and compute. The sequence is split after the
embedding (`split_sequence`), where Qwen3-VL's image features are already in place (DeepStack
features are split the same way), and the final norm's output is all-gathered by the loss.

Qwen3.5's linear-attention (Gated DeltaNet) mixers are split over heads too: `in_proj_z/a/b`
column-parallel, `out_proj` row-parallel. Their fused `in_proj_qkv` ([q | k | v], unequal
blocks) and its `conv1d` cannot be one DTensor shard, so they stay whole on every TP rank
(still sharded by FSDP) and each rank reads its heads' rows of them (`GatedDeltaNet.head_shard`),
as it does for `A_log` and `dt_bias`.

The vision tower has its own layout (`parallel.modules.vision`, by default tp 1: every language
TP rank computes the same thing). With its own tp (`apply_vision_tp`), each vision block's
attention `proj` and MLP `linear_fc2` are row-parallel and `linear_fc1` column-parallel; the
fused `attn.qkv` stays whole (`OwnHeadsLinear`), and the residual stream replicated: the vision
TP group runs the tower on the same images (vlmcore.parallel.bridge).

Parameters that are whole on every TP rank but used for local heads only (per-head q/k norms,
the gated norm and the rows read by the linear-attention mixers) get partial gradients on each
rank; `apply_tp` returns them, as (module, attribute name) since FSDP later replaces the
parameter objects on the same modules, for the train step to all-reduce once per optimizer step.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from vlmcore.models.moe import SparseMoeBlock

HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# Whole on every TP rank, used for this rank's heads only.
LINEAR_ATTN_PARTIAL = ("in_proj_qkv.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight")


def sum_grad_over(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """t, whose gradient is summed over the ranks of `mesh` in backward (each rank's is partial)."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class OwnHeadsLinear(nn.Linear):
    """The vision attention's fused qkv ([q | k | v] rows) under vision TP: its weight stays whole
    (FSDP-sharded; a three-block row split is no shard that DCP can save) and each rank computes its
    heads of q, k and v from their rows of it; in backward the rows' gradients are all-gathered, so
    the weight's gradient is whole on every rank, like the norms'."""

    tp_mesh: DeviceMesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each rank's gradient of x covers its heads only: summed over the TP ranks.
        return F.linear(sum_grad_over(x, self.tp_mesh), self.own_rows(self.weight), self.own_rows(self.bias))

    def own_rows(self, t: torch.Tensor) -> torch.Tensor:
        whole = DTensor.from_local(t.view(3, -1, *t.shape[1:]), self.tp_mesh, [Replicate()], run_check=False)
        return whole.redistribute(self.tp_mesh, [Shard(1)]).to_local().flatten(0, 1)


def apply_vision_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shards the vision blocks of `model` in place over `tp_mesh` (no partial gradients)."""
    for block in model.vision_layers():
        # Same parameters and state-dict names, another forward (as fully_shard swaps classes).
        block.attn.qkv.__class__ = OwnHeadsLinear
        block.attn.qkv.tp_mesh = tp_mesh
        parallelize_module(
            block,
            tp_mesh,
            {"attn.proj": RowwiseParallel(), "mlp.linear_fc1": ColwiseParallel(), "mlp.linear_fc2": RowwiseParallel()},
        )


def _gather(args: int) -> PrepareModuleInput:
    """The sub-block's first input goes from sequence-split to whole; other inputs untouched."""
    rest = (None,) * (args - 1)
    return PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))


def _block_plan(block: nn.Module, sequence_parallel: bool) -> dict:
    # Row-parallel outputs: reduce-scattered onto the sequence split (kept as DTensors for the
    # residual add), or all-reduced to a replicated plain tensor.
    row_out = (
        RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sequence_parallel else RowwiseParallel()
    )
    plan = (
        {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()}
        if sequence_parallel
        else {}
    )
    if hasattr(block, "self_attn"):
        if sequence_parallel:
            plan["self_attn"] = _gather(4)  # (x, cos, sin, cu_seqlens)
        plan.update(
            {
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": row_out,
            }
        )
    if hasattr(block, "linear_attn"):
        # (x, cu_seqlens): x whole, as a replicated DTensor for the mixer's partial-gradient read.
        plan["linear_attn"] = PrepareModuleInput(
            input_layouts=(Shard(1) if sequence_parallel else Replicate(), None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=False,
        )
        plan.update({f"linear_attn.{name}": ColwiseParallel() for name in ("in_proj_z", "in_proj_a", "in_proj_b")})
        plan["linear_attn.out_proj"] = row_out
    if isinstance(getattr(block, "mlp", None), SparseMoeBlock):
        # Not split: every TP rank routes and runs the whole tokens (its experts are split by EP).
        if sequence_parallel:
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=False,
            )
    elif hasattr(block, "mlp"):
        if sequence_parallel:
            plan["mlp"] = _gather(1)
        plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": row_out})
    return plan


def _check_even_sequence_split(tp: int) -> Callable[[nn.Module, tuple], None]:
    """torch before 2.13 fails on an unevenly split sequence with 'view size is not compatible'
    (a strided all-gather result; in backward on 2.11, already in forward on 2.12); say what to
    change instead."""

    def check(module: nn.Module, args: tuple) -> None:
        seq_len = args[0].shape[1]
        if seq_len % tp:
            raise ValueError(
                f"sequence parallelism over tp {tp} with rows of {seq_len} tokens needs torch >= 2.13 "
                f"(this is {torch.__version__}): make the packed seq_len a multiple of {tp}, or set "
                f"parallel.sequence_parallel: false"
            )

    return check


def _set_local_heads(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Attention modules that store head counts must see the per-rank counts; linear-attention
    mixers learn which heads are theirs."""
    attn = getattr(block, "self_attn", None)
    for key in ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads"):
        if attn is not None and isinstance(getattr(attn, key, None), int):
            setattr(attn, key, getattr(attn, key) // tp_mesh.size())
    if hasattr(block, "linear_attn"):
        block.linear_attn.head_shard = (tp_mesh.get_local_rank(), tp_mesh.size())


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> list[tuple[nn.Module, str]]:
    """Shards `model` in place over `tp_mesh`; returns the (module, attribute name) of every
    parameter whose gradient is a partial sum over the TP ranks."""
    partial = []
    for block in model.decoder_layers():
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel))
        _set_local_heads(block, tp_mesh)
        names = [
            f"{norm}.weight"
            for norm in HEAD_NORMS
            if hasattr(block, "self_attn") and hasattr(block.self_attn, norm.split(".")[1])
        ]
        names += [f"linear_attn.{name}" for name in LINEAR_ATTN_PARTIAL if hasattr(block, "linear_attn")]
        partial += [(block.get_submodule(path), attr) for path, _, attr in (n.rpartition(".") for n in names)]
    text_model = model.text_model()
    embed = model.token_embedding()
    parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if sequence_parallel:
        if torch.__version__ < (2, 13):
            text_model.split_sequence.register_forward_pre_hook(_check_even_sequence_split(tp_mesh.size()))
        parallelize_module(
            text_model.split_sequence,
            tp_mesh,
            PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False),
        )
        parallelize_module(text_model.norm, tp_mesh, SequenceParallel())
    if model.lm_head.weight is not embed.weight:
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    return partial
