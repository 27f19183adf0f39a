"""Tensor-parallel plans (DTensor `parallelize_module`) for Qwen3, Qwen3-VL and Qwen3.5.

Per decoder block, attention heads and the MLP are split: q/k/v (and Qwen3.5's gated q) and
gate/up are column-parallel, o/down row-parallel, so each rank holds whole heads and one
all-reduce closes each sub-block. The residual stream between blocks stays replicated (plain
tensors): Qwen3-VL's image scatter and DeepStack, and the packed-sequence attention, need the
full sequence on every rank. The embedding is vocabulary-parallel, and the LM head weight is
sharded on the vocabulary, which the chunked loss uses directly (vocabulary-parallel loss).

Qwen3.5's linear-attention (Gated DeltaNet) blocks keep their mixer replicated (their MLP is
still split), and the vision tower is not tensor parallel: both run as replicated compute,
which is exact because every TP rank sees the same input and receives the full gradient.

Per-head q/k norms act on local heads, so their gradients are partial sums over the TP
ranks; `apply_tp` returns their names for the loop to all-reduce once per optimizer step.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from vlmcore.config import ConfigError

SUPPORTED = ("qwen3", "qwen3_vl", "qwen3_5")

ATTENTION_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
}
MLP_PLAN = {
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def _text_config(config):
    return getattr(config, "text_config", config)


def check_tp(config, tp: int) -> None:
    if config.model_type not in SUPPORTED:
        raise ConfigError(f"parallel.tp: no tensor-parallel plan for model_type {config.model_type!r} "
                         f"(supported: {', '.join(SUPPORTED)})")
    text = _text_config(config)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(text, key)
        if value % tp:
            raise ConfigError(f"parallel.tp: {tp} does not divide the model's {key} ({value})")


def _block_plan(block: nn.Module) -> dict:
    plan = {}
    if hasattr(block, "self_attn"):
        plan.update(ATTENTION_PLAN)
    if hasattr(block, "mlp"):
        plan.update(MLP_PLAN)
    return plan


def _set_local_heads(block: nn.Module, tp: int) -> None:
    """Attention modules that store head counts must see the per-rank counts."""
    attn = getattr(block, "self_attn", None)
    for key in ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads"):
        if attn is not None and isinstance(getattr(attn, key, None), int):
            setattr(attn, key, getattr(attn, key) // tp)


def apply_tp(model: nn.Module, blocks: nn.Module, tp_mesh: DeviceMesh) -> list[str]:
    """Shards `model` in place over `tp_mesh`; returns the names of parameters whose gradients
    are partial sums over the TP ranks."""
    check_tp(model.config, tp_mesh.size())
    partial = []
    blocks_name = next(n for n, m in model.named_modules() if m is blocks)
    for index, block in blocks.named_children():
        parallelize_module(block, tp_mesh, _block_plan(block))
        _set_local_heads(block, tp_mesh.size())
        if hasattr(block, "self_attn"):
            partial += [f"{blocks_name}.{index}.{norm}.weight" for norm in HEAD_NORMS
                        if hasattr(block.self_attn, norm.split(".")[1])]
    embed = next(m for n, m in model.named_modules() if n.endswith("embed_tokens"))
    parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if model.lm_head.weight is not embed.weight:
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    return partial
