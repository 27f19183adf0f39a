"""Low-rank adapters (LoRA) on the native models: on chosen linear layers and on the MoE routed experts.

A linear layer `y = W x + b` becomes

    y = W x + b + (B A dropout(x)) * alpha / rank        A (rank, in), B (out, rank)

and each routed expert's stacked weight `W_e` (models/moe.py: `gate_up_proj` (E, 2I, H), `down_proj`
(E, H, I)) becomes, in every forward,

    W_e + (B_e A_e) * alpha / rank                     A (E, rank, in), B (E, out, rank)

which is peft's LoRA on the transformers model (`LoraConfig(target_modules=...)` for the linears,
`target_parameters=[...experts.gate_up_proj, ...experts.down_proj]` for the experts: its ParamWrapper
adds the same update to the stacked weight). A starts as peft's (uniform in +-1/sqrt(in), Kaiming's
bound with a = sqrt(5)), B at zero, so the adapted model starts equal to the base.

The adapted modules keep their class's parameters under the same names (`q_proj.weight`,
`mlp.experts.gate_up_proj`) and add the adapters beside them (`q_proj.lora_A`, `q_proj.lora_B`,
`mlp.experts.gate_up_proj_lora_A`, ...): the snapshot IO, the parallel plans by module and the
checkpoints read the base weights as for full fine-tuning, and an adapter is a plain parameter of
the module it adapts, so FSDP2 shards it with that module, EP shards the expert adapters along the
experts as it does the expert weights, and the TP plans split a linear's adapters as its weight
(vlmcore.parallel.tp: B with a column-parallel weight's rows, A with a row-parallel one's columns). Expert adapters take no dropout: the update is folded
into the expert weights, which sees no per-token input (peft refuses dropout there too).

`adapters_disabled(model)` runs forwards of the base model alone (a DPO reference model).
"""

import fnmatch
import math
import re
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from vlmcore.config import ConfigError

from .moe import GroupedExperts, _local

_ADAPTER_NAME = re.compile(r"(^|[._])lora_[AB]$")
# What activation checkpointing and compile put into parameter names.
_WRAPPER_PARTS = re.compile(r"_checkpoint_wrapped_module\.|_orig_mod\.")
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (`...lora_A`, `...lora_B`, `..._lora_A`, ...)."""
    return _ADAPTER_NAME.search(name) is not None


class LoraLinear(nn.Linear):
    """nn.Linear plus a low-rank update (module docstring); `weight` and `bias` keep their names."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        # Built on the meta device, then given the base layer's own parameters (no copy).
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight = base.weight
        self.bias = base.bias
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.zeros(rank, base.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **factory))
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapters_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return y
        return y + self.update(x, self.lora_B)

    def update(self, x: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """The adapters' term of the output channels of `lora_b` (B, or the rows of it that a module
        reading `weight` directly computes: Qwen3.5's Gated DeltaNet takes its heads' share of in_proj_qkv)."""
        return F.linear(F.linear(self.lora_dropout(x), self.lora_A), lora_b) * self.scaling


class LoraGroupedExperts(GroupedExperts):
    """GroupedExperts whose local experts' weights get the low-rank update (module docstring)."""

    def __init__(self, base: GroupedExperts, rank: int, alpha: float) -> None:
        nn.Module.__init__(self)
        self.num_experts = base.num_experts
        self.hidden_dim = base.hidden_dim
        self.gate_up_proj = base.gate_up_proj
        self.down_proj = base.down_proj
        factory = {"device": base.gate_up_proj.device, "dtype": base.gate_up_proj.dtype}
        for name in EXPERT_WEIGHTS:
            experts, out_features, in_features = getattr(base, name).shape
            setattr(self, f"{name}_lora_A", nn.Parameter(torch.zeros(experts, rank, in_features, **factory)))
            setattr(self, f"{name}_lora_B", nn.Parameter(torch.zeros(experts, out_features, rank, **factory)))
        self.scaling = alpha / rank
        self.adapters_enabled = True

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = super().expert_weights()
        if not self.adapters_enabled:
            return gate_up, down
        return self._adapted(gate_up, "gate_up_proj"), self._adapted(down, "down_proj")

    def _adapted(self, weight: torch.Tensor, name: str) -> torch.Tensor:
        lora_a = _local(getattr(self, f"{name}_lora_A"))
        lora_b = _local(getattr(self, f"{name}_lora_B"))
        return weight + torch.bmm(lora_b, lora_a) * self.scaling


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def add_adapters(
    model: nn.Module, rank: int, alpha: float, dropout: float, targets: Sequence[str], experts: bool
) -> list[str]:
    """Puts adapters on the linear layers whose module name matches one of the fnmatch `targets`
    and, with `experts`, on every MoE block's routed experts; freezes everything else. Returns the
    adapted modules' names. Refuses a pattern that matches no linear layer and dropout on experts
    (errors name the `lora.*` config key)."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = {}
    for pattern in targets:
        hits = [name for name in linears if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise ConfigError(f"lora.targets: pattern {pattern!r} matches no linear layer of the model", "lora.targets")
        chosen.update(dict.fromkeys(hits))
    expert_modules = []
    if experts:
        expert_modules = [name for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    if expert_modules and dropout > 0:
        raise ConfigError(
            "lora.dropout: must be 0 with lora.experts on a model with experts (the expert update is folded "
            "into the expert weights, where there is no per-token input to drop)",
            "lora.dropout",
        )
    model.requires_grad_(False)
    for name in chosen:
        _replace(model, name, LoraLinear(linears[name], rank, alpha, dropout))
    for name in expert_modules:
        _replace(model, name, LoraGroupedExperts(model.get_submodule(name), rank, alpha))
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return [*chosen, *expert_modules]


def adapted_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every module with adapters, in model order; the names as in the model's
    state dict (without the wrappers of activation checkpointing and compile)."""
    for name, module in model.named_modules():
        if isinstance(module, (LoraLinear, LoraGroupedExperts)):
            yield _WRAPPER_PARTS.sub("", name), module


def has_adapters(model: nn.Module) -> bool:
    return next(adapted_modules(model), None) is not None


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Forwards (and backwards) inside the context run the base model alone, as if no adapter were there."""
    modules = [m for _, m in adapted_modules(model)]
    for module in modules:
        module.adapters_enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.adapters_enabled = True


def _adapter_init(name: str, shape: Sequence[int], seed: int) -> torch.Tensor:
    """The whole initial tensor of adapter `name`: B zero; A uniform in +-1/sqrt(in) (peft's Kaiming
    init of lora_A), drawn from a generator of `seed` and the name, so every layout draws the same values."""
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int = 0) -> None:
    """Initial adapter values (see `_adapter_init`, by the parameter's name without the wrappers of
    activation checkpointing and compile); a sharded adapter gets its own block of them."""
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        full = _adapter_init(_WRAPPER_PARTS.sub("", name), tuple(param.shape), seed)
        if isinstance(param, DTensor):
            size, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            block = full[tuple(slice(o, o + s) for o, s in zip(offset, size))]
            param.to_local().copy_(block)
        else:
            param.copy_(full)


def _delta(module: nn.Module, weight_name: str) -> torch.Tensor:
    """The adapters' update of one base weight (DTensors where the parameters are)."""
    if isinstance(module, LoraLinear):
        return (module.lora_B @ module.lora_A) * module.scaling
    lora_a = getattr(module, f"{weight_name}_lora_A")
    lora_b = getattr(module, f"{weight_name}_lora_B")
    return torch.bmm(lora_b, lora_a) * module.scaling


@torch.no_grad()
def merged_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` (the model's, by parameter name) with each adapted weight replaced by base + update
    and the adapters left out: the weights of the adapted model as a plain model of its family.
    A collective under FSDP2 (the update's matmul gathers what it needs)."""
    merged = {name: tensor for name, tensor in state_dict.items() if not is_adapter(name)}
    for module_name, module in adapted_modules(model):
        weight_names = ("weight",) if isinstance(module, LoraLinear) else EXPERT_WEIGHTS
        for weight_name in weight_names:
            key = f"{module_name}.{weight_name}"
            merged[key] = merged[key] + _delta(module, weight_name).to(merged[key].dtype)
    return merged


def adapter_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a model state dict."""
    return {name: tensor for name, tensor in state_dict.items() if is_adapter(name)}


# peft nests one ParamWrapper per targeted parameter of a module, in the module's parameter order:
# the experts' `gate_up_proj` adapter is the inner one (`experts.base_layer.lora_A`), `down_proj`'s the outer.
_PEFT_EXPERT_PREFIX = {"gate_up_proj": "base_layer.", "down_proj": ""}


def peft_state_dict(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapters (our names, whole tensors) under peft's names and shapes, as in an
    adapter_model.safetensors: `base_model.model.<module>.lora_A.weight` (rank, in) and `.lora_B.weight`
    (out, rank) for a linear; for experts (E experts) one matrix over all of them, A (E * rank, in) with
    expert e in rows [e * rank, (e + 1) * rank), B (out, rank * E) with expert e in columns e, e + E, ...
    (peft's ParamWrapper reshapes B to (out, rank, E))."""
    out = {}
    for name, tensor in adapters.items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            out[f"base_model.model.{module}.{leaf}.weight"] = tensor
            continue
        weight_name, _, factor = leaf.rpartition("_lora_")
        key = f"base_model.model.{module}.{_PEFT_EXPERT_PREFIX[weight_name]}lora_{factor}.weight"
        experts, rows, cols = tensor.shape
        if factor == "A":  # (E, rank, in) -> (E * rank, in)
            out[key] = tensor.reshape(experts * rows, cols)
        else:  # (E, out, rank) -> (out, rank, E) -> (out, rank * E)
            out[key] = tensor.permute(1, 2, 0).reshape(rows, cols * experts)
    return out
