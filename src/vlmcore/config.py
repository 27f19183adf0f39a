"""Typed run config of one training stage: dataclasses, YAML load, `--set` overrides, validation.

Each key is declared once, here: its type (a `Literal` for a choice), default, allowed range and
meaning. `validate` checks those ranges and the `RULES` between keys, and docs/config.md's table
is generated from the same declarations (`python -m vlmcore.config_docs`), so they cannot drift.
Every error names the config key (and the file when there is one), so a typo in a
workflow-written YAML is found at once instead of deep inside the training loop.
"""

import contextlib
import dataclasses
import fnmatch
import json
import math
import operator
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from vlmcore.blend import BlendError, read_blend


class ConfigError(ValueError):
    """A bad config value; `key` is the dotted config key it is about (None: the whole file)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


Dtype = Literal["float32", "bfloat16", "float16"]
LinearAttentionBackend = Literal["auto", "fla", "torch"]
_BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def setting(
    default: Any,
    doc: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    also: tuple = (),
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A config key: its default, its meaning (its line in docs/config.md) and its allowed range,
    which `validate` checks: the bounds ge/gt/le/lt (a float must also be finite), or a value in `also`."""
    bounds = {op: v for op, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    metadata = {"doc": doc, "bounds": bounds, "also": also}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class OptimizerConfig:
    lr: float = setting(1.0e-3, "AdamW peak learning rate (of every parameter group without its own)", ge=0)
    vision_lr: float | None = setting(None, "peak learning rate of the vision tower; null = lr", ge=0)
    projector_lr: float | None = setting(None, "peak learning rate of the vision-language projector; null = lr", ge=0)
    weight_decay: float = setting(0.01, "AdamW decoupled weight decay (not on norms, biases, embeddings)", ge=0)
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW betas (first and second moment)", ge=0, lt=1)
    eps: float = setting(1.0e-8, "AdamW epsilon", gt=0)
    moments_dtype: Literal["float32", "bfloat16"] = setting(
        "float32",
        "dtype of AdamW's two moments: float32 (the weights' dtype, 8 bytes a weight) or bfloat16 (4 bytes a "
        "weight; each step computes in float32 and rounds them back; docs/performance.md for its drift)",
    )


@dataclass
class ScheduleConfig:
    name: Literal["cosine", "wsd", "constant"] = setting("cosine", "learning-rate schedule after the linear warmup")
    unit: Literal["steps", "samples"] = setting("steps", "what the warmup, the decay and the run length are counted in")
    warmup_steps: int = setting(0, "linear warmup length (unit steps)", ge=0)
    warmup_samples: int = setting(0, "linear warmup length (unit samples)", ge=0)
    total_samples: int | None = setting(None, "length of the run in samples (unit samples)", gt=0)
    min_lr_ratio: float = setting(0.1, "final learning rate of cosine and wsd, as a share of the peak", ge=0, le=1)
    decay_fraction: float = setting(0.2, "wsd: share of the run spent in the cooldown", gt=0, le=1)
    cooldown: Literal["linear", "cosine", "1-sqrt"] = setting("linear", "wsd: shape of the cooldown")


@dataclass
class ModuleLayout:
    """One module's parallel layout (vlmcore.parallel.layout.resolve_layout)."""

    tp: int | None = setting(
        None, "tensor-parallel ranks of this module; null: parallel.tp (language), 1 (vision)", ge=1
    )
    dp_shard: int | None = setting(
        None,
        "FSDP shards of this module; -1 = what is left of its ranks; null: parallel.dp_shard (language), -1 (vision)",
        ge=1,
        also=(-1,),
    )
    dp_replicate: int | None = setting(
        None,
        "data-parallel replicas of this module (HSDP when > 1); null: parallel.dp_replicate (language; vision "
        "too when the language tp is 1, else 1)",
        ge=1,
    )
    ranks: Literal["all"] | list[int] = setting(
        "all",
        "all: on every rank, with the other module (colocated); [start, end): on these ranks only "
        "(disjoint: the two ranges tile the world, each module with tp 1 for now)",
    )


@dataclass
class ModulesConfig:
    vision: ModuleLayout = field(default_factory=ModuleLayout)
    language: ModuleLayout = field(default_factory=ModuleLayout)


@dataclass
class ParallelConfig:
    dp_replicate: int = setting(1, "data-parallel replicas (HSDP when > 1 with mode fsdp)", ge=1)
    dp_shard: int = setting(-1, "FSDP shards; -1 = whatever is left of the world size", ge=1, also=(-1,))
    tp: int = setting(1, "tensor-parallel ranks (inside a node)", ge=1)
    ep: int = setting(
        1,
        "expert-parallel ranks (MoE models): each holds num_experts / ep experts; carved out of "
        "dp_shard (x cp), which it must divide",
        ge=1,
    )
    cp: int = setting(
        1,
        "context-parallel ranks: each holds 1/cp of every row, attention and linear attention by "
        "all-to-all over heads, so cp x tp must divide the k/v heads (docs/hpc.md section 15)",
        ge=1,
    )
    mode: Literal["fsdp", "ddp"] = setting(
        "fsdp", "fsdp: FSDP2 (HSDP when dp_replicate > 1); ddp: replicate everything"
    )
    sequence_parallel: bool = setting(True, "under tp > 1: norms and the residual stream split on the sequence")
    one_rank_cast: bool = setting(
        True,
        "on one rank with a compute dtype other than the weights' (bf16): no FSDP2 units; every "
        "weight cast in one multi-tensor copy a forward and the copies held to the end of "
        "backward (2 bytes a weight more at the peak, counted by vlmcore memory; one launch "
        "instead of two per weight); false: FSDP2 units, one block's copy at a time",
    )
    offload: bool = setting(
        False,
        "keep the weights' shards, their gradients and the optimizer state in host memory (FSDP2's "
        "CPUOffloadPolicy, pinned on a GPU): each unit's shard is copied to the device for its all-gather "
        "and its gradient back, and AdamW steps on the CPU; needs FSDP2 units (one rank: one_rank_cast false)",
    )
    activation_checkpointing: Literal["none", "selective", "full"] = setting(
        "none", "recompute activations in backward: selective (the cheap ops) or full (every block)"
    )
    compile: bool = setting(
        False,
        "torch.compile each block and the chunked cross-entropy; Gated DeltaNet layers "
        "and EP MoE blocks (a graph break each) compile in pieces, inside the checkpoint "
        "under full activation checkpointing, and run eagerly under selective (docs/moe.md)",
    )
    linear_attention: LinearAttentionBackend = setting(
        "auto",
        "Qwen3.5 Gated DeltaNet kernels on GPU: auto = fla where installed and correct on this GPU "
        "(docs/hpc.md), else torch; fla = fla or stop; torch = the pure-torch chunked rule",
    )
    # Each module's own layout (docs/hpc.md, "Per-module layouts"); unset: the keys above.
    modules: ModulesConfig = field(default_factory=ModulesConfig)


@dataclass
class Float8Config:
    recipe: Literal["none", "tensorwise", "rowwise"] = setting(
        "none",
        "FP8 training (torchao float8) of the language model's attention and dense MLP projections "
        "(docs/performance.md): tensorwise = one scale per tensor, FSDP2 all-gathers the weights in float8; "
        "rowwise = one scale per row, weights all-gathered in param_dtype; none = no FP8. Needs torchao and "
        "a GPU of compute capability 8.9 or more (or emulate)",
    )
    emulate: bool = setting(
        False, "emulate the float8 matmuls in high precision (CPU tests; any GPU); false on CPU is refused"
    )


@dataclass
class PrecisionConfig:
    param_dtype: Dtype = setting("float32", "dtype of the forward and backward computation (FSDP2 mixed precision)")
    reduce_dtype: Dtype = setting("float32", "dtype of the gradient reduction across ranks")
    fp8: Float8Config = field(default_factory=Float8Config)


@dataclass
class CheckpointConfig:
    enabled: bool = setting(True, "false: no checkpoints at all (scaling runs)")
    interval: int = setting(50, "steps between checkpoints; 0 = only at the end and on a signal", ge=0)
    keep: int = setting(2, "checkpoints kept; older ones are deleted", ge=1)
    async_save: bool = setting(False, "save in the background while training goes on")  # YAML key `async`
    async_mode: Literal["process", "thread"] = setting(
        "process",
        "with async: who writes while training goes on; process = DCP's process-based checkpointer (a "
        "writer process per rank, fed from a host copy made before the save returns: pinned on a GPU, the "
        "checkpoint's size per rank in host memory, counted by vlmcore memory); thread = a thread of the trainer",
    )


@dataclass
class ResilienceConfig:
    """Riding out faults inside one allocation (docs/hpc.md section 6)."""

    max_restarts: int = setting(
        2,
        "restarts of the stage's ranks inside one job after a rank dies or a collective fails "
        "(torchrun --max-restarts, each resuming from the latest checkpoint); once spent, the job fails "
        "and Snakemake's retry resubmits it",
        ge=0,
    )
    collective_timeout_s: float = setting(
        600.0,
        "seconds a collective may wait for its peers before it fails (the process group's timeout); "
        "must exceed a step, checked at each straggler gather",
        gt=0,
    )
    flight_recorder_entries: int = setting(
        2000,
        "last collectives each rank records (torch's Flight Recorder), dumped into "
        "flight_recorder/ on a failed collective; 0 = off",
        ge=0,
    )
    straggler_interval: int = setting(
        10, "steps between gathers of every rank's step time (one small all_gather); 0 = never", ge=0
    )
    straggler_margin: float = setting(
        0.2, "a rank busier than the median rank by more than this share of it is named a straggler", gt=0
    )


@dataclass
class MetricsConfig:
    tensorboard: bool = setting(True, "write TensorBoard event files in output_dir")
    wandb: bool = setting(False, "log to Weights & Biases, always offline")
    peak_tflops: float | None = setting(
        None, "peak TFLOP/s of one device for the MFU; null = from the device table", gt=0
    )
    module_times: bool = setting(
        True, "time the vision tower and the LLM apart (vision_time_s, llm_time_s): a few CUDA events per micro-batch"
    )
    profile_steps: list[int] = setting(
        None,
        "steps (1-based) traced with torch.profiler, first to last: a trace and a summary (GPU busy time, "
        "host syncs, launches, top kernels) per rank in output_dir/profile/; [] = none",
        ge=1,
        factory=list,
    )


@dataclass
class DataConfig:
    kind: Literal["packed", "random"] = setting(
        "packed", "packed: data_path is a packed Energon dataset; random: synthetic rows (benchmarks, engine tests)"
    )
    seq_len: int = setting(
        256,
        "random: tokens per row; objective grpo: tokens of a rollout row (a prompt and its completion; the "
        "workflow sets it to pack.seq_len)",
        ge=2,
    )
    segments: int = setting(2, "random: samples packed per row", ge=1)
    image_fraction: float = setting(0.5, "random, VL models: share of rows that carry an image", ge=0, le=1)
    image_side: int = setting(2, "random, VL models: merged patches per side of an image (side**2 LLM tokens)", ge=1)
    video_fraction: float = setting(
        0.0,
        "random, VL models: share of rows that carry a video (in the longest "
        "segment without an image that has room for it)",
        ge=0,
        le=1,
    )
    video_frames: int = setting(
        2,
        "random, VL models: frame groups per video (temporal_patch_size frames each; "
        "image_side**2 tokens, a timestamp and vision start/end per group)",
        ge=1,
    )


@dataclass
class LoraConfig:
    rank: int = setting(
        0, "rank of the low-rank adapters; 0 = no LoRA (full fine-tuning of the `trainable` parameters)", ge=0
    )
    alpha: float = setting(16.0, "scale of the adapters' update: alpha / rank", gt=0)
    dropout: float = setting(
        0.0,
        "dropout on the adapted linear layers' input to their adapter (must be 0 with experts on an MoE model)",
        ge=0,
        lt=1,
    )
    targets: list[str] = setting(
        None,
        "fnmatch patterns over module names (`model.language_model.layers.*.mlp.*_proj`, `model.visual.blocks.*.attn.qkv`, "
        "`model.visual.merger.*`): the linear layers of the language model, vision tower and projector that get "
        "adapters; each pattern must match one",
        factory=lambda: ["*.self_attn.[qkvo]_proj"],
    )
    experts: bool = setting(True, "adapters on every routed expert of the MoE families (none on dense models)")


@dataclass
class DPOConfig:
    beta: float = setting(
        0.1, "objective dpo: how far the policy may move from the reference (the implicit reward's scale)", gt=0
    )
    label_smoothing: float = setting(
        0.0,
        "objective dpo: assumed share of pairs whose preference is wrong (conservative DPO); 0 = plain sigmoid DPO",
        ge=0,
        lt=0.5,
    )
    reference: Literal["copy", "adapters_off"] = setting(
        "copy",
        "objective dpo: the reference policy; copy = a frozen copy of the weights the stage starts from; "
        "adapters_off = the policy with its LoRA adapters switched off (the same weights, no second model; "
        "needs lora.rank > 0)",
    )


@dataclass
class RewardConfig:
    """One reward of a GRPO stage: a function of the rewards registry, by name, and its weight."""

    name: str = ""
    weight: float = 1.0


@dataclass
class GRPOConfig:
    prompts_per_step: int = setting(8, "objective grpo: prompts a step's rollout samples completions for", ge=1)
    group_size: int = setting(
        8,
        "objective grpo: completions sampled per prompt (its group: a completion's advantage is its reward "
        "against its group's); at least 2",
        ge=1,
    )
    temperature: float = setting(
        1.0,
        "objective grpo: sampling temperature; the policy's and the reference's log-probabilities are taken at it",
        ge=0,
    )
    top_p: float = setting(1.0, "objective grpo: nucleus sampling's probability mass; 1 = off", gt=0, le=1)
    top_k: int = setting(0, "objective grpo: sample from the k likeliest tokens only; 0 = off", ge=0)
    max_new_tokens: int = setting(
        256, "objective grpo: a completion's longest length (and dr_grpo's normaliser per completion)", ge=1
    )
    loss: Literal["grpo", "dapo", "dr_grpo", "gspo"] = setting(
        "dapo",
        "objective grpo: how the token losses are averaged: grpo = each completion's mean, then the mean over "
        "completions; dapo = over all completion tokens of the global batch; dr_grpo = the sum / (completions x "
        "max_new_tokens); gspo = the sequence-level ratio (exp of a completion's mean log-ratio), averaged as grpo",
    )
    epsilon_low: float = setting(0.2, "objective grpo: the ratio's clip below, at 1 - epsilon_low", gt=0, lt=1)
    epsilon_high: float = setting(
        0.2, "objective grpo: the ratio's clip above, at 1 + epsilon_high (DAPO's clip-higher: 0.28)", gt=0
    )
    delta: float = setting(
        0.0,
        "objective grpo: dual clip, the unclipped ratio capped at delta (bounds a negative advantage's term); "
        "0 = off, else > 1 + epsilon_high",
        ge=0,
    )
    beta: float = setting(
        0.0, "objective grpo: weight of the KL penalty to the reference (k3 estimate); 0 = no reference", ge=0
    )
    kl_ratio_weighted: bool = setting(
        True,
        "objective grpo: the KL estimate of each token weighed by its ratio (the tokens are the sampling "
        "policy's; TRL's use_bias_correction_kl)",
    )
    reference: Literal["frozen", "adapters_off"] = setting(
        "frozen",
        "objective grpo, beta > 0: the reference policy; frozen = a frozen copy of the weights the stage starts "
        "from; adapters_off = the policy with its LoRA adapters switched off (needs lora.rank > 0)",
    )
    scale_rewards: Literal["group", "batch", "none"] = setting(
        "group",
        "objective grpo: the advantage is the reward minus its group's mean, divided by the rewards' standard "
        "deviation in its group, in the step's batch, or by nothing",
    )
    updates_per_rollout: int = setting(
        1,
        "objective grpo: optimizer steps on each rollout batch (the ratio is against the rollout's log-probabilities)",
        ge=1,
    )
    overlong_buffer: int = setting(
        0,
        "objective grpo: DAPO's soft overlong punishment, the last tokens before max_new_tokens over which a "
        "completion's reward falls linearly by up to overlong_factor; 0 = off",
        ge=0,
    )
    overlong_factor: float = setting(
        1.0, "objective grpo: the overlong punishment at max_new_tokens (overlong_buffer > 0)", ge=0
    )
    dynamic_sampling: bool = setting(
        False, "objective grpo: drop the groups whose rewards are all equal (no advantage, DAPO's dynamic sampling)"
    )
    shuffle_rewards: bool = setting(
        False,
        "objective grpo, a control for benchmarks: each group's rewards permuted among its completions before "
        "the advantages, so that they carry no information about which completion earned them (the logged "
        "rewards stay the true ones)",
    )
    rewards: list[RewardConfig] = setting(
        None,
        "objective grpo: the rewards, each {name, weight}: a function of the rewards registry and its weight in "
        "the completion's reward",
        factory=list,
    )
    reward_workers: int = setting(
        2, "objective grpo: processes of each rank that compute the rewards, apart from the trainer", ge=1
    )
    reward_timeout_s: float = setting(10.0, "objective grpo: seconds a reward function may take per completion", gt=0)
    tis_cap: float = setting(
        0.0,
        "objective grpo: truncated importance sampling, each token's loss weighed by min(exp(trainer - sampler "
        "log-probability), tis_cap), the ratio then against the trainer's own; 0 = off",
        ge=0,
    )


@dataclass
class TrainConfig:
    model_path: str = setting("", "HF snapshot: architecture, tokenizer, and the weights unless init_from")
    output_dir: str = setting("", "run directory: checkpoints, final/, metrics, the resolved config.yaml")
    data_path: str | None = setting(
        None, "packed Energon dataset, or a blend file of several by weight (vlmcore.blend) (data.kind packed)"
    )
    init_from: str | None = setting(None, "a previous stage's final/ (DCP) to start from; null = model_path's weights")
    steps: int = setting(100, "optimizer steps of the run", ge=1)
    micro_batch_size: int = setting(1, "packed rows per micro-batch per data-parallel rank", ge=1)
    grad_accum_steps: int = setting(1, "micro-batches per optimizer step", ge=1)
    global_batch_rows: int = setting(
        0,
        "packed rows per optimizer step over all data-parallel ranks; set, grad_accum_steps follows from it "
        "(global_batch_rows / (data-parallel ranks x micro_batch_size)), so a stage whose next job gets another "
        "number of nodes keeps its batch and resumes exactly; 0 = data-parallel ranks x micro_batch_size x "
        "grad_accum_steps",
        ge=0,
    )
    allow_global_batch_change: bool = setting(
        False,
        "true: a resume whose rows per step (data-parallel ranks x micro_batch_size x grad_accum_steps) "
        "differ from the checkpoint's goes on from the rows consumed so far (none repeated or skipped, but the "
        "steps' batches are not the uninterrupted run's); false: such a resume is refused",
    )
    seed: int = setting(0, "seed of the data order and of the random data", ge=0, le=2**32 - 1)
    trainable: list[str] = setting(None, "fnmatch patterns of the trained parameters; [] = all of them", factory=list)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    max_grad_norm: float = setting(
        1.0, "global gradient-norm clipping; 0 = no clipping (the norm is still logged)", ge=0
    )
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    save_final: bool = setting(True, "write final/ and the done marker at the end")
    num_workers: int = setting(0, "data-loader worker processes per rank", ge=0)
    deterministic: bool = setting(False, "deterministic torch algorithms (slower)")
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss_chunk_tokens: int = setting(1024, "tokens per cross-entropy chunk (bounds the logits in memory)", ge=1)
    max_nonfinite_steps: int = setting(5, "consecutive skipped (non-finite) steps before the run saves and stops", ge=1)
    objective: Literal["sft", "dpo", "grpo"] = setting(
        "sft",
        "the stage's loss: sft = next-token cross-entropy over the label tokens; dpo = direct preference "
        "optimisation over preference pairs (data: a `preference:` source through vlmcore prepare and pack); "
        "grpo = group relative policy optimisation over sampled completions and their rewards",
    )
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


def _always(cfg: TrainConfig) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    """A rule between keys, read as its sentence: `key` `message` (`data.segments must be even when
    objective is dpo and ...`). When `when(config)` holds, the key's value must pass `must(value,
    config)`; else `validate` refuses it with the message. The key and the message are the rule's
    line in docs/config.md."""

    key: str
    message: str
    must: Callable[[Any, TrainConfig], bool]
    when: Callable[[TrainConfig], bool] = _always

    def broken_by(self, cfg: TrainConfig) -> bool:
        return self.when(cfg) and not self.must(_value(cfg, self.key), cfg)


def _lora_stage(cfg: TrainConfig) -> bool:
    return cfg.lora.rank > 0


def _dpo_stage(cfg: TrainConfig) -> bool:
    return cfg.objective == "dpo"


def _ddp(cfg: TrainConfig) -> bool:
    return cfg.parallel.mode == "ddp"


def _random_data(cfg: TrainConfig) -> bool:
    return cfg.data.kind == "random"


def _unit_is(unit: str) -> Callable[[TrainConfig], bool]:
    return lambda c: c.schedule.unit == unit


# A legal setting that is probably a mistake: (dotted key, why it is suspicious, suspicious(value, config)).
Suspicion = tuple[str, str, Callable[[Any, TrainConfig], bool]]


def _each_lr(text: str, suspicious: Callable[[float], bool]) -> list[Suspicion]:
    return [
        (f"optimizer.{k}", text, lambda v, c: v is not None and suspicious(v))
        for k in ("lr", "vision_lr", "projector_lr")
    ]


def _module_rules(module: str) -> list[Rule]:
    key = f"parallel.modules.{module}"
    return [
        Rule(
            f"{key}.ranks",
            "must be all or [start, end) with 0 <= start < end",
            must=lambda ranks, c: ranks == "all" or (len(ranks) == 2 and 0 <= ranks[0] < ranks[1]),
        ),
        Rule(
            f"{key}.dp_shard",
            "must be 1, -1 or null when parallel.mode is ddp",
            when=_ddp,
            must=lambda dp_shard, c: dp_shard in (1, -1, None),
        ),
    ]


def _lora_rules() -> list[Rule]:
    return [
        Rule(
            "trainable",
            "must be [] when lora.rank > 0 (with LoRA only the adapters train; lora.targets chooses them)",
            when=_lora_stage,
            must=lambda trainable, c: not trainable,
        ),
        Rule(
            "lora.targets",
            "must hold a pattern when lora.rank > 0 and lora.experts is false (else nothing would train)",
            when=lambda c: _lora_stage(c) and not c.lora.experts,
            must=lambda targets, c: bool(targets),
        ),
        Rule(
            "lora.targets",
            "must not match lm_head (the training loss multiplies lm_head.weight chunk by chunk without calling "
            "the layer, so an adapter there would never train)",
            when=_lora_stage,
            must=lambda targets, c: not any(fnmatch.fnmatchcase("lm_head", pattern) for pattern in targets),
        ),
        Rule(
            "precision.fp8.recipe",
            "must be none when lora.rank > 0 (the adapted layers would lose their adapters to torchao's swap)",
            when=_lora_stage,
            must=lambda recipe, c: recipe == "none",
        ),
    ]


def _dpo_rules() -> list[Rule]:
    """What a DPO stage needs: pairs in random data, and a reference it can have."""
    return [
        Rule(
            "data.segments",
            "must be even when objective is dpo and data.kind is random (consecutive segments are the pairs)",
            when=lambda c: _dpo_stage(c) and _random_data(c),
            must=lambda segments, c: segments % 2 == 0,
        ),
        Rule(
            "dpo.reference",
            "must be copy unless lora.rank > 0 (adapters_off is the base of a LoRA stage)",
            when=lambda c: not _lora_stage(c),
            must=lambda reference, c: reference == "copy",
        ),
    ]


def _grpo_stage(cfg: TrainConfig) -> bool:
    return cfg.objective == "grpo"


def _grpo_rules() -> list[Rule]:
    """What a GRPO stage needs: groups that can compare, a loss that can move, a reference it can have."""
    return [
        Rule(
            "grpo.group_size",
            "must be >= 2 when objective is grpo (a completion's advantage is its reward against its group's: "
            "a group of 1 has none)",
            when=_grpo_stage,
            must=lambda size, c: size >= 2,
        ),
        Rule(
            "grpo.temperature",
            "must be > 0 when objective is grpo and grpo.group_size > 1 (greedy completions of a prompt are all "
            "the same: equal rewards, no advantage, no learning signal)",
            when=lambda c: _grpo_stage(c) and c.grpo.group_size > 1,
            must=lambda temperature, c: temperature > 0,
        ),
        Rule(
            "grpo.delta",
            "must be 0 or > 1 + grpo.epsilon_high (a cap below the clip would bound every ratio)",
            must=lambda delta, c: delta == 0 or delta > 1 + c.grpo.epsilon_high,
        ),
        Rule(
            "grpo.reference",
            "must be frozen unless lora.rank > 0 (adapters_off is the base of a LoRA stage)",
            when=lambda c: not _lora_stage(c),
            must=lambda reference, c: reference == "frozen",
        ),
        Rule(
            "grpo.max_new_tokens",
            "must be < data.seq_len when objective is grpo on packed prompts (a rollout row holds its prompt "
            "and its completion)",
            when=lambda c: _grpo_stage(c) and c.data.kind == "packed",
            must=lambda max_new_tokens, c: max_new_tokens < c.data.seq_len,
        ),
        Rule(
            "grpo.overlong_buffer",
            "must be <= grpo.max_new_tokens",
            must=lambda buffer, c: buffer <= c.grpo.max_new_tokens,
        ),
        Rule(
            "grpo.rewards",
            "must name at least one reward when objective is grpo",
            when=_grpo_stage,
            must=lambda rewards, c: len(rewards) > 0,
        ),
        Rule(
            "grpo.rewards",
            "must each have a name and a finite weight",
            must=lambda rewards, c: all(r.name and math.isfinite(r.weight) for r in rewards),
        ),
        Rule(
            "grpo.tis_cap",
            "must be 0 when grpo.updates_per_rollout > 1 (the correction takes the trainer's log-probabilities "
            "of the sampling weights from the policy, which only the first update has)",
            when=lambda c: c.grpo.updates_per_rollout > 1,
            must=lambda cap, c: cap == 0,
        ),
    ]


def _tokens_per_segment(cfg: TrainConfig) -> int:
    return cfg.data.seq_len // cfg.data.segments


# Rules between keys, checked in this order after each key's own type and range.
RULES = [
    Rule("model_path", "is required", must=lambda path, c: path != ""),
    Rule("output_dir", "is required", must=lambda path, c: path != ""),
    Rule(
        "data_path",
        "is required unless data.kind is random",
        when=lambda c: not _random_data(c),
        must=lambda path, c: bool(path),
    ),
    Rule(
        "schedule.warmup_steps",
        "must be <= steps when schedule.unit is steps (no warmup longer than the run)",
        when=_unit_is("steps"),
        must=lambda warmup, c: warmup <= c.steps,
    ),
    Rule(
        "schedule.total_samples",
        "is required when schedule.unit is samples",
        when=_unit_is("samples"),
        must=lambda total, c: total is not None,
    ),
    Rule(
        "schedule.warmup_samples",
        "must be <= schedule.total_samples when schedule.unit is samples",
        when=_unit_is("samples"),
        must=lambda warmup, c: warmup <= c.schedule.total_samples,
    ),
    Rule(
        "metrics.profile_steps",
        "must be steps the run reaches (<= steps)",
        must=lambda steps, c: all(s <= c.steps for s in steps),
    ),
    Rule(
        "parallel.dp_shard",
        "must be 1 or -1 when parallel.mode is ddp",
        when=_ddp,
        must=lambda dp_shard, c: dp_shard in (1, -1),
    ),
    *_module_rules("vision"),
    *_module_rules("language"),
    Rule(
        "parallel.modules.language.ranks",
        "must be all when parallel.modules.vision.ranks is all and a range when it "
        "is a range (every module on every rank, or each on its own ranks)",
        must=lambda ranks, c: (ranks == "all") == (c.parallel.modules.vision.ranks == "all"),
    ),
    *_lora_rules(),
    Rule("data.segments", "must be <= data.seq_len / 2", must=lambda segments, c: segments <= c.data.seq_len // 2),
    *_dpo_rules(),
    *_grpo_rules(),
    Rule(
        "data.image_side",
        "must leave room for an image (image_side**2 + 4 tokens) in data.seq_len / data.segments "
        "when data.kind is random and data.image_fraction > 0",
        when=lambda c: _random_data(c) and c.data.image_fraction > 0,
        must=lambda side, c: side**2 + 4 <= _tokens_per_segment(c),
    ),
    Rule(
        "data.video_frames",
        "must leave room for a video (video_frames * (image_side**2 + 5) + 2 tokens) in "
        "data.seq_len / data.segments when data.kind is random and data.video_fraction > 0",
        when=lambda c: _random_data(c) and c.data.video_fraction > 0,
        must=lambda frames, c: frames * (c.data.image_side**2 + 5) + 2 <= _tokens_per_segment(c),
    ),
]
# Legal settings that are probably mistakes: (key, why, suspicious(value, config)).
WARNINGS = [
    *_each_lr("is 0: its parameters will not change", lambda lr: lr == 0),
    *_each_lr("is 1 or more: AdamW moves every weight by about that much per step", lambda lr: lr >= 1),
    (
        "schedule.min_lr_ratio",
        "is 1: the cosine or wsd schedule never decays",
        lambda v, c: v == 1 and c.schedule.name != "constant",
    ),
    (
        "precision.param_dtype",
        "is float16: without loss scaling small gradients underflow; bfloat16 has float32's range",
        lambda v, c: v == "float16",
    ),
]


# YAML keys that are not valid Python identifiers.
_KEY_ALIASES = {"async": "async_save"}
_YAML_NAMES = {v: k for k, v in _KEY_ALIASES.items()}
_EXPECTED = {bool: "true or false", int: "an integer", str: "a string"}


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against the annotation `tp`, converting YAML scalars where lossless."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _convert_choice(value, tp, key)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(value, tp, key)
    if dataclasses.is_dataclass(tp):
        return _convert_section(value, tp, key)
    if origin is list:
        return _convert_list(value, tp, key)
    if origin is tuple:
        return _convert_tuple(value, tp, key)
    if tp in _EXPECTED:
        return _convert_exact(value, tp, key)
    if tp is float:
        return _convert_float(value, key)
    raise TypeError(f"unsupported config annotation {tp} for {key}")


def _convert_choice(value: Any, tp: Any, key: str) -> Any:
    """A value of a `Literal[...]`: one of its choices."""
    choices = typing.get_args(tp)
    if value not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(choices)}, got {value!r}", key)
    return value


def _convert_union(value: Any, tp: Any, key: str) -> Any:
    """A value of `A | B | None`: None where allowed, else the first of the types that fits
    (e.g. `Literal["all"] | list[int]`); the error lists why each did not."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    errors = []
    for inner in [a for a in args if a is not type(None)]:
        try:
            return _convert(value, inner, key)
        except ConfigError as e:
            errors.append(str(e).removeprefix(f"{key}: "))
    raise ConfigError(f"{key}: {'; or '.join(errors)}", key)


def _convert_section(value: Any, tp: type, key: str) -> Any:
    """A nested section (a config dataclass) from a mapping."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}", key)
    return _from_dict(tp, value, key + ".")


def _convert_list(value: Any, tp: Any, key: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}: expected a list, got {value!r}", key)
    (inner,) = typing.get_args(tp)
    return [_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]


def _convert_tuple(value: Any, tp: Any, key: str) -> tuple:
    """A fixed-length tuple, written as a YAML list."""
    inner = typing.get_args(tp)
    if not isinstance(value, (list, tuple)) or len(value) != len(inner):
        raise ConfigError(f"{key}: expected a list of {len(inner)} values, got {value!r}", key)
    return tuple(_convert(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, inner)))


def _convert_exact(value: Any, tp: type, key: str) -> Any:
    """A bool, int or str, exactly (a YAML `true` is no integer)."""
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {_EXPECTED[tp]}, got {value!r}", key)
    return value


def _convert_float(value: Any, key: str) -> float:
    """A number as a float; a string only where it reads as one."""
    if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
        with contextlib.suppress(ValueError):
            return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {value!r}", key)
    return float(value)


def _from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)  # every field, by name
    kwargs = {}
    for raw_key, value in data.items():
        name = _KEY_ALIASES.get(raw_key, raw_key)
        if name not in hints:
            known = ", ".join(sorted(_YAML_NAMES.get(n, n) for n in hints))
            raise ConfigError(f"{prefix}{raw_key}: unknown key (known: {known})", prefix + raw_key)
        kwargs[name] = _convert(value, hints[name], prefix + raw_key)
    return cls(**kwargs)


def _set_dotted(node: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for k in parents:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {k} is not a mapping")
    node[last] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, object]]:
    """`key.sub=value` strings -> (dotted key, YAML-parsed value)."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item}: expected key=value")
        key, text = item.split("=", 1)
        parsed.append((key.strip(), yaml.safe_load(text)))
    return parsed


def leaves(cfg: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any, Any]]:
    """(dotted YAML key, field, annotation, value) of every key of a config, in declaration order."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        name = prefix + _YAML_NAMES.get(f.name, f.name)
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, name + ".")
        else:
            yield name, f, hints[f.name], value


def range_text(metadata: Mapping[str, Any]) -> str:
    """The allowed range of a key as docs and errors write it: `>= 0`, `in [0, 1)`, `>= 1 or -1`."""
    bounds = metadata.get("bounds", {})
    low = [op for op in ("ge", "gt") if op in bounds]
    high = [op for op in ("le", "lt") if op in bounds]
    if low and high:
        opening = "[" if low == ["ge"] else "("
        closing = "]" if high == ["le"] else ")"
        text = f"in {opening}{bounds[low[0]]}, {bounds[high[0]]}{closing}"
    else:
        text = " ".join(f"{_BOUNDS[op][1]} {v}" for op, v in bounds.items())
    return text + "".join(f" or {v}" for v in metadata.get("also", ()))


def _in_range(value: Any, metadata: Mapping[str, Any]) -> bool:
    if value in metadata["also"]:
        return True
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return all(_BOUNDS[op][0](value, bound) for op, bound in metadata["bounds"].items())


def _value(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, _KEY_ALIASES.get(part, part))
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Checks every key's declared range, then the RULES between keys (not the paths: see
    check_paths); raises ConfigError naming the key. The types and choices are checked on loading."""
    for name, f, _, value in leaves(cfg):
        values = list(value) if isinstance(value, (tuple, list)) else [value]
        if f.metadata.get("bounds") and not all(v is None or _in_range(v, f.metadata) for v in values):
            each = "each " if isinstance(value, (tuple, list)) else ""
            number = "a finite number " if values and isinstance(values[0], float) else ""
            shown = values if each else value
            raise ConfigError(f"{name}: {each}must be {number}{range_text(f.metadata)}, got {shown}", name)
    for rule in RULES:
        if rule.broken_by(cfg):
            raise ConfigError(f"{rule.key}: {rule.message}, got {_value(cfg, rule.key)!r}", rule.key)


def _need(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}", key)


def check_paths(cfg: TrainConfig) -> None:
    """The inputs a run reads must exist: checked when a run starts, not when the workflow plans
    (the earlier jobs create them)."""
    model = Path(cfg.model_path)
    _need(model.is_dir(), "model_path", f"{model} is not a directory")
    _need((model / "config.json").is_file(), "model_path", f"{model} has no config.json (not an HF snapshot)")
    if cfg.init_from:
        _need(
            (Path(cfg.init_from) / ".metadata").is_file(),
            "init_from",
            f"{cfg.init_from} is not a checkpoint directory (no .metadata), e.g. a previous stage's final/",
        )
    if cfg.data.kind == "packed":
        datasets = _packed_datasets(cfg.data_path)
        for dataset in datasets:
            of_blend = "" if datasets == [Path(cfg.data_path)] else f" (a dataset of the blend {cfg.data_path})"
            _need(dataset.is_dir(), "data_path", f"{dataset}{of_blend} is not a directory")
            _check_pairs(cfg, dataset)


def _packed_datasets(data_path: str) -> list[Path]:
    """The packed datasets `data_path` names: itself (a directory), or those of a blend file."""
    path = Path(data_path)
    if not path.is_file():
        return [path]
    try:
        return read_blend(path).paths
    except BlendError as e:
        raise ConfigError(f"data_path: {e}", "data_path") from None


def _check_pairs(cfg: TrainConfig, dataset: Path) -> None:
    """A DPO stage's packed datasets must hold preference pairs (their stats.json count them)."""
    stats = dataset / "stats.json"
    if cfg.objective != "dpo" or not stats.is_file():
        return
    pairs = json.loads(stats.read_text()).get("pairs", 0)
    _need(
        pairs > 0,
        "data_path",
        f"objective is dpo but {dataset} holds no preference pairs (a `preference:` source through "
        "vlmcore prepare and pack)",
    )


def warnings_of(cfg: TrainConfig) -> list[str]:
    """Legal settings that are probably mistakes."""
    return [f"{name} {why}" for name, why, suspicious in WARNINGS if suspicious(_value(cfg, name), cfg)]


def from_dict(data: dict) -> TrainConfig:
    """A validated TrainConfig from a mapping with the YAML key names (paths not checked)."""
    cfg = _from_dict(TrainConfig, data)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: Sequence[str] = (), paths_must_exist: bool = False) -> TrainConfig:
    """YAML file (or defaults when None) + `--set` overrides -> validated TrainConfig."""
    data = {}
    where = "config" if path is None else str(path)
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: cannot read config: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a mapping")
    for key, value in parse_overrides(list(overrides)):
        _set_dotted(data, key, value)
    try:
        cfg = from_dict(data)
        if paths_must_exist:
            check_paths(cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}", e.key) from None
    return cfg


def to_dict(cfg: TrainConfig) -> dict:
    """Plain dict with the YAML key names (round-trips through load_config); lists for tuples."""
    if dataclasses.is_dataclass(cfg):
        return {_YAML_NAMES.get(f.name, f.name): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
