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

A LoRA linear (vlmcore.models.lora) is split as its base: `ColwiseParallel` and `RowwiseParallel`
here are torch's, also distributing the adapters (column-parallel: B Shard(0), A whole; row-parallel:
A Shard(1), B whole), so its forward computes the update with DTensors of the same output layout as
the base's. The vision qkv's B takes its heads' rows as the weight does (`OwnHeadsLoraLinear`).

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
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwiseParallel
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwiseParallel

from vlmcore.models.lora import LoraLinear
from vlmcore.models.moe import SparseMoeBlock

HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# Whole on every TP rank, used for this rank's heads only (the fused qkv's adapters too, under LoRA).
LINEAR_ATTN_PARTIAL = (
    "in_proj_qkv.weight",
    "in_proj_qkv.lora_A",
    "in_proj_qkv.lora_B",
    "conv1d.weight",
    "A_log",
    "dt_bias",
    "norm.weight",
)


def _distribute_parameters(
    module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src_data_rank: int | None
) -> None:
    """The module's own parameters (not its children's: a LoRA linear's dropout module is one) as
    DTensors of the placements named; a plain linear has no `lora_A` / `lora_B`."""
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


class ColwiseParallel(TorchColwiseParallel):
    """torch's ColwiseParallel (weight and bias Shard(0): output features split) that also splits a
    LoRA linear's update (models/lora.py) the same way: B (out, rank) Shard(0), A (rank, in) whole
    (Replicate). The forward computes the update with these DTensors: B A x comes out Shard(-1), as W x."""

    PLACEMENTS = {"weight": Shard(0), "bias": Shard(0), "lora_A": Replicate(), "lora_B": Shard(0)}

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute_parameters(module, device_mesh, self.PLACEMENTS, self.src_data_rank)


class RowwiseParallel(TorchRowwiseParallel):
    """torch's RowwiseParallel (weight Shard(1): input features split, bias whole; the output a partial
    sum) that also splits a LoRA linear's update the same way: A (rank, in) Shard(1), B (out, rank)
    whole. A x is then a partial sum, so is B A x, reduced with W x by the plan's output layout."""

    PLACEMENTS = {"weight": Shard(1), "bias": Replicate(), "lora_A": Shard(1), "lora_B": Replicate()}

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute_parameters(module, device_mesh, self.PLACEMENTS, self.src_data_rank)


def sum_grad_over(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """t, whose gradient is summed over the ranks of `mesh` in backward (each rank's is partial)."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _own_rows(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's heads' rows of each third ([q | k | v]) of a whole tensor; in backward the rows'
    gradients are all-gathered, so the whole tensor's gradient is whole on every rank."""
    whole = DTensor.from_local(t.view(3, -1, *t.shape[1:]), mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(1)]).to_local().flatten(0, 1)


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
        return _own_rows(t, self.tp_mesh)


class OwnHeadsLoraLinear(LoraLinear):
    """OwnHeadsLinear of a LoRA qkv (models/lora.py): B's rows are taken as the weight's (their
    gradients all-gathered); A stays whole, and its gradient, this rank's heads' part, is summed
    over the TP ranks as x's is. Still a LoraLinear, so the merge and the export find it."""

    tp_mesh: DeviceMesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = sum_grad_over(x, self.tp_mesh)
        y = F.linear(x, _own_rows(self.weight, self.tp_mesh), _own_rows(self.bias, self.tp_mesh))
        if not self.adapters_enabled:
            return y
        lora_a = sum_grad_over(self.lora_A, self.tp_mesh)
        low_rank = F.linear(self.lora_dropout(x), lora_a)
        return y + F.linear(low_rank, _own_rows(self.lora_B, self.tp_mesh)) * self.scaling


def apply_vision_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shards the vision blocks of `model` in place over `tp_mesh` (no partial gradients)."""
    for block in model.vision_layers():
        # Same parameters and state-dict names, another forward (as fully_shard swaps classes).
        qkv = block.attn.qkv
        qkv.__class__ = OwnHeadsLoraLinear if isinstance(qkv, LoraLinear) else OwnHeadsLinear
        qkv.tp_mesh = tp_mesh
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
    # torch's SequenceParallel makes new parameters that require gradients: frozen ones (a LoRA
    # stage's base, `trainable`'s rest) are frozen again at the end.
    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
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
        for path, _, attr in (name.rpartition(".") for name in names):
            module = block.get_submodule(path)
            if hasattr(module, attr):  # the adapters are there under LoRA only
                partial.append((module, attr))
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
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    return partial
