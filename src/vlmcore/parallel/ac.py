"""Activation checkpointing per transformer block: full, or selective (keep matmul and attention
outputs, recompute the cheap element-wise ops in between)."""

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from vlmcore.parallel.compile import apply_compile

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
# The varlen kernels' custom ops, where installed (torch >= 2.10; flash-attn >= 2.7).
try:
    import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn::_varlen_attn)
except ImportError:
    pass
for _namespace, _op in (("torch_attn", "_varlen_attn"), ("flash_attn", "_flash_attn_varlen_forward")):
    try:
        _SAVE_OPS.add(getattr(getattr(torch.ops, _namespace), _op).default)
    except (AttributeError, RuntimeError):
        pass

# Profiler annotations are not computation. FSDP2 wraps its hooks in them, and a nested FSDP unit
# inside a block (the experts under expert parallelism) runs its hooks a different number of times
# in the recompute than in forward, which selective checkpointing's per-op replay counts take for
# a changed graph ("record_function invocation index ... not found in storage", as reported for
# torchtitan's FSDP + EP in pytorch/torchtitan#3427; pytorch/pytorch#196862 proposes this exclusion).
# Added to torch's set when selective checkpointing is applied, not at import.
_PROFILER_OPS = {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


def _save_matmuls(
    ctx: SelectiveCheckpointContext, op: torch._ops.OpOverload, *args: object, **kwargs: object
) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(blocks: nn.Module, mode: str, compile_blocks: bool = False) -> None:
    """Wraps every child of `blocks` (a ModuleList / ModuleDict of transformer blocks) in place;
    with `compile_blocks`, then compiles each (`apply_compile`, which must come after this)."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"parallel.activation_checkpointing: unknown mode {mode!r}")
    if mode == "selective":
        SAC_IGNORED_OPS.update(_PROFILER_OPS)
    if mode != "none":
        selective = partial(create_selective_checkpoint_contexts, _save_matmuls)
        context_fn = {"context_fn": selective} if mode == "selective" else {}
        for name, block in list(blocks.named_children()):
            blocks.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False, **context_fn))
    if compile_blocks:
        apply_compile(blocks, mode)
