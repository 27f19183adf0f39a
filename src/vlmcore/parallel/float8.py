"""FP8 training of the language model's linear layers with torchao's float8 (`precision.fp8`).

`convert_to_float8` swaps the chosen `nn.Linear` modules of the decoder blocks for torchao's
`Float8Linear`, on the meta device, before tensor parallelism and FSDP wrap them (torchao's
order: the float8 weight wrapper must exist when FSDP shards the parameters). Each forward then
casts the input and weight to float8 with dynamic scales and multiplies them with `_scaled_mm`
(or, with `precision.fp8.emulate`, in high precision on the float8-rounded values: CPU tests).

What is converted, by name: the attention projections (`self_attn.{q,k,v,o}_proj`) and the dense
MLP projections (`mlp.{gate,up,down}_proj`, and the MoE blocks' shared expert's), the matmuls
that carry most of a dense model's FLOPs. What stays in the parameter dtype:
- the LM head and the embeddings: outside the decoder blocks; the logits' softmax over the whole
  vocabulary is sensitive to the rounding (torchtitan leaves `output` unconverted too), and the
  embedding is a lookup, no matmul;
- the vision tower and the projector: not language-model layers (their widths are small, and
  the vision features feed every later layer);
- the MoE router (`mlp.gate`, a `TopKRouter`, and `mlp.shared_expert_gate`): routing decisions
  flip on small changes of the logits;
- the routed experts: grouped weights, not `nn.Linear` (torchao's MoE float8 path is a separate
  grouped-GEMM prototype);
- Qwen3.5's Gated DeltaNet mixers: their fused `in_proj_qkv` is read by rows under tensor
  parallelism (vlmcore.parallel.tp), not through its forward;
- any layer whose input or output width is not a multiple of 16 (`_scaled_mm` needs it), with a
  log line.

Recipes (torchao's `Float8LinearConfig.from_recipe_name`): tensorwise, one scale per tensor, with
FSDP2's float8 all-gather (the sharded weight is cast to float8 before the all-gather, half the
traffic of bf16; its scale is computed for all weights at once after each optimizer step,
`precompute_scales`); rowwise, one scale per row, finer but with a bf16 all-gather (torchao
supports the float8 all-gather for tensorwise scaling only).

torchao is imported here only, and only when `precision.fp8.recipe` is set: CPU users without it
run everything else.
"""

import dataclasses
import functools
import logging
import sys
from collections.abc import Callable

import torch
from torch import nn

from vlmcore.config import ConfigError, Float8Config, TrainConfig
from vlmcore.parallel.checks import check_fp8_device

log = logging.getLogger(__name__)

# Module names (their last two parts) of the linear layers converted to float8.
CONVERTED = {
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
    ("shared_expert", "gate_proj"),
    ("shared_expert", "up_proj"),
    ("shared_expert", "down_proj"),
}
# _scaled_mm's alignment: both widths of a converted weight are multiples of this.
ALIGNMENT = 16


def require_torchao() -> None:
    """A clear error naming the key when torchao is missing."""
    try:
        import torchao.float8  # noqa: F401  (only whether it imports)
    except ImportError as e:
        raise ConfigError(
            f"precision.fp8.recipe: FP8 training needs torchao (pip install 'vlmcore[fp8]'): {e}",
            "precision.fp8.recipe",
        ) from None


def check_device(cfg: TrainConfig, device: torch.device) -> None:
    """FP8 on this run's device (vlmcore.parallel.checks.check_fp8_device) and torchao at hand:
    before the model is built."""
    if cfg.precision.fp8.recipe == "none":
        return
    capability = None
    name = ""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
    check_fp8_device(cfg, device.type, capability, name)
    require_torchao()


def float8_linear_config(fp8: Float8Config) -> object:
    """torchao's `Float8LinearConfig` of the recipe, emulated or not, with FSDP2's float8
    all-gather for tensorwise scaling."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(fp8.recipe)
    return dataclasses.replace(config, emulate=fp8.emulate, enable_fsdp_float8_all_gather=fp8.recipe == "tensorwise")


def wanted(module: nn.Module, name: str) -> bool:
    """Whether the linear layer `name` (within a decoder block) is converted (module docstring)."""
    if type(module) is not nn.Linear:  # LoRA's adapted layers and the vision TP's OwnHeadsLinear stay
        return False
    if tuple(name.split(".")[-2:]) not in CONVERTED:
        return False
    out_features, in_features = module.weight.shape
    if out_features % ALIGNMENT or in_features % ALIGNMENT:
        # A warning: `vlmcore train` configures no logging, and Python shows warnings without.
        log.warning(
            "fp8: layers.%s stays in param_dtype: its shape %s is not a multiple of %d",
            name,
            tuple(module.weight.shape),
            ALIGNMENT,
        )
        return False
    return True


def convert_to_float8(blocks: nn.ModuleList, fp8: Float8Config) -> list[str]:
    """Swaps the wanted linear layers of the decoder `blocks` for `Float8Linear` in place; returns
    their names (within `blocks`)."""
    require_torchao()
    from torchao.float8 import convert_to_float8_training

    converted = []

    def keep_name(module: nn.Module, name: str) -> bool:
        if wanted(module, name):
            converted.append(name)
            return True
        return False

    convert_to_float8_training(blocks, module_filter_fn=keep_name, config=float8_linear_config(fp8))
    return converted


def precompute_scales(model: nn.Module) -> Callable[[], None] | None:
    """What to call after each optimizer step of a model whose float8 weights FSDP2 all-gathers
    in float8: torchao's precompute of their dynamic scales (one all-reduce of every weight's
    amax, instead of one per weight in the next forward). None when there is nothing to do."""
    from torch.distributed.tensor import DTensor

    float8_linear = _float8_linear_class()
    if float8_linear is None:
        return None
    gathered_in_float8 = [
        m
        for m in model.modules()
        if isinstance(m, float8_linear) and m.config.enable_fsdp_float8_all_gather and isinstance(m.weight, DTensor)
    ]
    if not gathered_in_float8:
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return functools.partial(precompute_float8_dynamic_scale_for_fsdp, model)


def _float8_linear_class() -> type | None:
    """torchao's `Float8Linear` where torchao's float8 was imported (as `convert_to_float8` does),
    else None: a model without float8 layers needs no torchao."""
    if "torchao.float8" not in sys.modules:
        return None
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear
