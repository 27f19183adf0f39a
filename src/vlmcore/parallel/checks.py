"""Every check of a training stage that depends on the world size or on the model, in one pass
before any work (`check_run`): by the workflow when it is parsed (the model's checks once its
config.json is at hand), by `vlmcore memory`, and at the start of `vlmcore train`. Each error is a
ConfigError naming the key to change.

No torch: a model is its transformers config or its config.json as a dict.
"""

import dataclasses
import math
from types import SimpleNamespace
from typing import Any, TypeAlias

from vlmcore.config import ConfigError, TrainConfig
from vlmcore.families import FAMILIES, Family, family
from vlmcore.parallel.layout import MODULES, RunLayout, modules_set, resolve_layout

# A model's config read by attribute: a transformers config, or its config.json as `as_config` gives
# it (typed Any: this module imports no transformers, see the module docstring).
ModelConfig: TypeAlias = Any


def check_run(cfg: TrainConfig, world_size: int, model_config: ModelConfig | dict | None = None) -> RunLayout:
    """The stage's layout on `world_size` ranks, checked against the world and, given the model's
    config (a transformers config or a config.json dict), against the model."""
    layout = resolve_layout(cfg.parallel, world_size)
    layout = dataclasses.replace(layout, grad_accum_steps=grad_accum_steps(cfg, layout))
    check_rows(cfg, layout)
    # Disjoint layouts run each module with tp 1 (vlmcore.parallel.disjoint): tensor parallelism on
    # them resolves (the workflow plans it) but cannot run yet.
    for module in MODULES:
        if layout.disjoint and layout.grid(module).dims.tp > 1:
            raise ConfigError(
                f"parallel.modules.{module}.tp: disjoint layouts (parallel.modules.*.ranks) with "
                f"tensor parallelism are not implemented yet; use tp 1",
                f"parallel.modules.{module}.tp",
            )
    check_offload(cfg, layout)
    cp = layout.language.dims.cp
    if cp > 1 and cfg.data.kind == "random" and cfg.data.seq_len % cp:
        raise ConfigError(
            f"parallel.cp: {cp} does not divide the rows' length (data.seq_len {cfg.data.seq_len})", "parallel.cp"
        )
    if model_config is not None:
        check_model(cfg, layout, as_config(model_config))
    return layout


def check_offload(cfg: TrainConfig, layout: RunLayout) -> None:
    """`parallel.offload` is FSDP2's CPUOffloadPolicy: it needs FSDP2's units, which the one-rank cast
    replaces, and is applied to colocated modules only (disjoint layouts shard each module alone)."""
    if not cfg.parallel.offload:
        return
    if layout.world_size == 1 and cfg.parallel.one_rank_cast:
        raise ConfigError(
            "parallel.offload: on one rank it needs FSDP2's units, which parallel.one_rank_cast: true "
            "replaces; set parallel.one_rank_cast: false",
            "parallel.offload",
        )
    if layout.disjoint:
        raise ConfigError(
            "parallel.offload: not applied under disjoint module layouts (parallel.modules.*.ranks); "
            "use colocated modules or offload: false",
            "parallel.offload",
        )


def grad_accum_steps(cfg: TrainConfig, layout: RunLayout) -> int:
    """The micro-batches of a step: `grad_accum_steps`, or with `global_batch_rows` set, those that
    make it up on this layout's data-parallel ranks."""
    if not cfg.global_batch_rows:
        return cfg.grad_accum_steps
    per_step = cfg.micro_batch_size * layout.data.dims.dp
    accum, rest = divmod(cfg.global_batch_rows, per_step)
    if rest or not accum:
        raise ConfigError(
            f"global_batch_rows: {cfg.global_batch_rows} is not a multiple of micro_batch_size x "
            f"data-parallel ranks = {cfg.micro_batch_size} x {layout.data.dims.dp} = {per_step}",
            "global_batch_rows",
        )
    if cfg.grad_accum_steps not in (1, accum):
        raise ConfigError(
            f"grad_accum_steps: {cfg.grad_accum_steps} with global_batch_rows {cfg.global_batch_rows} "
            f"on {layout.data.dims.dp} data-parallel ranks (which makes it {accum}); set one of the two",
            "grad_accum_steps",
        )
    return accum


def check_rows(cfg: TrainConfig, layout: RunLayout) -> None:
    """With `parallel.modules` set: the global micro-batch (micro_batch_size rows on each language
    data-parallel rank) divisible by the LCM of the modules' DP sizes, so each module's
    data-parallel rank has whole rows of its own."""
    if not modules_set(cfg.parallel):
        return
    rows = cfg.micro_batch_size * layout.language.dims.dp
    sizes = {m: layout.grid(m).dims.dp for m in ("language", "vision")}
    lcm = math.lcm(*sizes.values())
    if rows % lcm:
        raise ConfigError(
            f"micro_batch_size: the global micro-batch ({cfg.micro_batch_size} x {sizes['language']} language "
            f"data-parallel ranks = {rows} rows) is not divisible by {lcm}, the LCM of the module data-parallel "
            f"sizes ({', '.join(f'{m} {n}' for m, n in sizes.items())})",
            "micro_batch_size",
        )


def check_model(cfg: TrainConfig, layout: RunLayout, config: ModelConfig) -> None:
    try:
        model = family(config)
    except ValueError as e:
        raise ConfigError(f"model_path: {e}", "model_path") from None
    if not model.vision and cfg.parallel.modules.vision != type(cfg.parallel.modules.vision)():
        raise ConfigError(
            f"parallel.modules.vision: the {config.model_type} model has no vision tower", "parallel.modules.vision"
        )
    if layout.disjoint and model.experts:
        raise ConfigError(
            "parallel.modules.vision.ranks: disjoint layouts of a mixture-of-experts model are not "
            "supported yet (use colocated layouts)",
            "parallel.modules.vision.ranks",
        )
    if cfg.lora.rank > 0 and not cfg.lora.targets and not model.experts:
        # lora.experts (default true) adapts routed experts only; without targets a dense model gets no adapter.
        raise ConfigError(
            f"lora.targets: must hold a pattern on the {config.model_type} model, which has no routed experts "
            "for lora.experts to adapt (else nothing would train)",
            "lora.targets",
        )
    if cfg.objective == "grpo":
        check_rollout_context(cfg, config)
    check_ep(config, layout.language.dims.ep)
    if layout.language.dims.cp > 1:
        check_cp_model(config, model, layout.language.dims.cp, layout.language.dims.tp)
    if layout.language.dims.tp > 1:
        check_tp(config, layout.language.dims.tp)
    if model.vision and layout.vision.dims.tp > 1:
        check_vision_tp(config, layout.vision.dims.tp)


def check_rollout_context(cfg: TrainConfig, config: ModelConfig) -> None:
    """A GRPO stage's rollout rows (data.seq_len tokens: a prompt and up to grpo.max_new_tokens
    sampled after it) must fit the model's context, or the decoder would refuse at the first rollout."""
    context = getattr(text_config(config), "max_position_embeddings", None)
    if context is not None and cfg.data.seq_len > context:
        raise ConfigError(
            f"data.seq_len: {cfg.data.seq_len} tokens a rollout row (a prompt and grpo.max_new_tokens "
            f"{cfg.grpo.max_new_tokens}) exceed the {config.model_type} model's context "
            f"(max_position_embeddings {context})",
            "data.seq_len",
        )


def text_config(config: ModelConfig) -> ModelConfig:
    return getattr(config, "text_config", None) or config


def check_tp(config: ModelConfig, tp: int) -> None:
    """The language model's heads, vocabulary and MLP split over `tp` ranks."""
    model = family(config)
    if not model.tensor_parallel:
        raise ConfigError(
            f"parallel.tp: no tensor-parallel plan for model_type {config.model_type!r} "
            f"(supported: {', '.join(t for t, f in FAMILIES.items() if f.tensor_parallel)})"
        )
    text = text_config(config)
    keys = ["num_attention_heads", "num_key_value_heads", "vocab_size"]
    if getattr(text, "intermediate_size", None) is not None:  # dense MLPs (absent on all-MoE Qwen3.5-MoE)
        keys.append("intermediate_size")
    if model.linear_attention:
        keys += ["linear_num_key_heads", "linear_num_value_heads"]
    for key in keys:
        value = getattr(text, key)
        if value % tp:
            raise ConfigError(f"parallel.tp: {tp} does not divide the model's {key} ({value})")


def check_cp_model(config: ModelConfig, model: Family, cp: int, tp: int = 1) -> None:
    """The heads of every token mixer, those of a TP rank, split over `cp` ranks (the all-to-all gives
    each whole heads)."""
    text = text_config(config)
    keys = ["num_attention_heads", "num_key_value_heads"]
    if model.linear_attention:
        keys += ["linear_num_key_heads", "linear_num_value_heads"]
    for key in keys:
        if getattr(text, key) % (cp * tp):
            ranks = f"cp x tp = {cp} x {tp}" if tp > 1 else f"{cp}"
            raise ConfigError(
                f"parallel.cp: {ranks} does not divide the model's {key} ({getattr(text, key)}): the "
                f"all-to-all gives each cp rank whole heads",
                "parallel.cp",
            )


def check_vision_tp(config: ModelConfig, tp: int) -> None:
    vision = config.vision_config
    for key in ("num_heads", "intermediate_size"):
        if getattr(vision, key) % tp:
            raise ConfigError(
                f"parallel.modules.vision.tp: {tp} does not divide the vision tower's {key} ({getattr(vision, key)})",
                "parallel.modules.vision.tp",
            )


def check_ep(config: ModelConfig, ep: int) -> None:
    """Named-key errors for an expert-parallel degree the model cannot take."""
    num_experts = getattr(text_config(config), "num_experts", 0) or 0
    if ep > 1 and not num_experts:
        raise ConfigError(
            f"parallel.ep: {ep} needs a mixture-of-experts model ({config.model_type} is dense)", "parallel.ep"
        )
    if num_experts % ep:
        raise ConfigError(f"parallel.ep: {ep} does not divide the model's num_experts ({num_experts})", "parallel.ep")


def as_config(config: ModelConfig | dict) -> ModelConfig:
    """A config.json dict as an object read like a transformers config (attributes, sub-configs);
    a transformers config as it is."""
    if not isinstance(config, dict):
        return config
    return SimpleNamespace(**{k: as_config(v) if isinstance(v, dict) else v for k, v in config.items()})


# The first CUDA compute capability with float8 tensor cores (Ada, sm_89; Hopper is 9.0).
FP8_CAPABILITY = (8, 9)


def check_fp8_device(cfg: TrainConfig, device_type: str, capability: tuple[int, int] | None, name: str = "") -> None:
    """FP8 training (`precision.fp8`) on this device: real float8 matmuls need a CUDA GPU of
    compute capability 8.9 or more; elsewhere (CPU, older GPUs) only torchao's emulation runs.
    `capability`: the GPU's (major, minor), None off CUDA; `name`: the GPU's, for the message."""
    fp8 = cfg.precision.fp8
    if fp8.recipe == "none" or fp8.emulate:
        return
    if device_type != "cuda":
        raise ConfigError(
            f"precision.fp8.recipe: {fp8.recipe} needs a CUDA GPU with float8 (compute capability >= 8.9); "
            f"this run is on {device_type}: set precision.fp8.emulate true (tests) or recipe none",
            "precision.fp8.recipe",
        )
    if tuple(capability) < FP8_CAPABILITY:
        major, minor = capability
        raise ConfigError(
            f"precision.fp8.recipe: {fp8.recipe} needs a GPU with float8 (compute capability >= 8.9); "
            f"{name or 'this GPU'} has {major}.{minor}: set recipe none (or precision.fp8.emulate true, slow)",
            "precision.fp8.recipe",
        )
