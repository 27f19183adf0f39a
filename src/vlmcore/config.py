"""Typed run config of one training stage: dataclasses, YAML load, `--set` overrides, validation.

Every error names the config key (and the file when there is one), so a typo in a
workflow-written YAML is found at once instead of deep inside the training loop.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    pass


@dataclass
class OptimizerConfig:
    lr: float = 1.0e-3
    vision_lr: float | None = None  # None = lr
    projector_lr: float | None = None  # None = lr
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1.0e-8


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # cosine | wsd | constant
    unit: str = "steps"  # steps | samples: what warmup, decay and the run length are counted in
    warmup_steps: int = 0
    warmup_samples: int = 0
    total_samples: int | None = None  # unit=samples: length of the run in samples
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: share of the run spent in the cooldown
    cooldown: str = "linear"  # wsd: linear | cosine | 1-sqrt


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1 = whatever is left of the world size
    tp: int = 1
    mode: str = "fsdp"  # fsdp (HSDP when dp_replicate > 1) | ddp
    vision: str = "fsdp"  # fsdp: the vision tower is one FSDP unit over the dp ranks (all ranks under tp)
    sequence_parallel: bool = True  # under tp > 1: norms and the residual stream split on the sequence
    activation_checkpointing: str = "none"  # none | selective | full
    compile: bool = False
    # Gated DeltaNet kernels (Qwen3.5) on GPU: auto = fla where it is installed and correct on this
    # GPU (vlmcore.kernels), else the pure-torch chunked rule; fla = fla or stop; torch = pure torch.
    linear_attention: str = "auto"


@dataclass
class PrecisionConfig:
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"


@dataclass
class CheckpointConfig:
    enabled: bool = True  # false: no checkpoints at all (scaling runs)
    interval: int = 50  # 0 = only at the end and on signal
    keep: int = 2
    async_save: bool = False  # YAML key `async`


@dataclass
class MetricsConfig:
    tensorboard: bool = True
    wandb: bool = False  # always offline
    peak_tflops: float | None = None  # per device; None = from the device table


@dataclass
class DataConfig:
    kind: str = "packed"  # packed: data_path is a packed Energon dataset | random: synthetic batches
    seq_len: int = 256  # random: tokens per row
    segments: int = 2  # random: samples packed per row
    image_fraction: float = 0.5  # random, VL models: share of rows that carry an image
    image_side: int = 2  # random, VL models: merged patches per side of an image (side**2 LLM tokens)


@dataclass
class TrainConfig:
    model_path: str = ""
    output_dir: str = ""
    data_path: str | None = None
    init_from: str | None = None
    steps: int = 100
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    seed: int = 0
    trainable: list[str] = field(default_factory=list)  # fnmatch patterns; empty = everything
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    max_grad_norm: float = 1.0  # 0 = no clipping (the norm is still logged)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    save_final: bool = True
    num_workers: int = 0
    deterministic: bool = False
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss_chunk_tokens: int = 1024  # tokens per cross-entropy chunk (bounds the logits in memory)
    max_nonfinite_steps: int = 5  # consecutive skipped steps before the run saves and stops


# YAML keys that are not valid Python identifiers.
_KEY_ALIASES = {"async": "async_save"}
_DTYPES = ("float32", "bfloat16", "float16")
_CHOICES = {
    "schedule.name": ("cosine", "wsd", "constant"),
    "schedule.unit": ("steps", "samples"),
    "schedule.cooldown": ("linear", "cosine", "1-sqrt"),
    "parallel.mode": ("fsdp", "ddp"),
    "parallel.vision": ("fsdp",),
    "parallel.activation_checkpointing": ("none", "selective", "full"),
    "parallel.linear_attention": ("auto", "fla", "torch"),
    "precision.param_dtype": _DTYPES,
    "precision.reduce_dtype": _DTYPES,
    "data.kind": ("packed", "random"),
}


def _convert(value, tp, key):
    """Checks `value` against the annotation `tp`, converting YAML scalars where lossless."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _from_dict(tp, value, key + ".")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (inner,) = typing.get_args(tp)
        return [_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        inner = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(inner):
            raise ConfigError(f"{key}: expected a list of {len(inner)} values, got {value!r}")
        return tuple(_convert(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, inner)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        # YAML 1.1 reads `1e-3` (no dot) as a string.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp} for {key}")


def _from_dict(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for raw_key, value in data.items():
        name = _KEY_ALIASES.get(raw_key, raw_key)
        if name not in names:
            raise ConfigError(f"{prefix}{raw_key}: unknown key (known: {', '.join(sorted(names))})")
        kwargs[name] = _convert(value, hints[name], prefix + raw_key)
    return cls(**kwargs)


def _set_dotted(data: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {k} is not a mapping")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, object]]:
    """`key.sub=value` strings -> (dotted key, YAML-parsed value)."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item}: expected key=value")
        key, text = item.split("=", 1)
        parsed.append((key.strip(), yaml.safe_load(text)))
    return parsed


def validate(cfg: TrainConfig) -> None:
    def need(ok: bool, key: str, message: str):
        if not ok:
            raise ConfigError(f"{key}: {message}")

    need(bool(cfg.model_path), "model_path", "is required")
    need(bool(cfg.output_dir), "output_dir", "is required")
    need(cfg.data.kind == "random" or bool(cfg.data_path), "data_path", "is required unless data.kind is random")
    need(cfg.steps > 0, "steps", f"must be > 0, got {cfg.steps}")
    need(cfg.micro_batch_size > 0, "micro_batch_size", "must be > 0")
    need(cfg.grad_accum_steps > 0, "grad_accum_steps", "must be > 0")
    need(cfg.num_workers >= 0, "num_workers", "must be >= 0")
    need(cfg.max_grad_norm >= 0, "max_grad_norm", "must be >= 0")
    need(cfg.loss_chunk_tokens > 0, "loss_chunk_tokens", "must be > 0")
    need(cfg.max_nonfinite_steps > 0, "max_nonfinite_steps", "must be > 0")
    need(cfg.optimizer.lr >= 0, "optimizer.lr", "must be >= 0")
    need(0 <= cfg.schedule.min_lr_ratio <= 1, "schedule.min_lr_ratio", "must be in [0, 1]")
    need(0 < cfg.schedule.decay_fraction <= 1, "schedule.decay_fraction", "must be in (0, 1]")
    need(cfg.schedule.warmup_steps >= 0, "schedule.warmup_steps", "must be >= 0")
    if cfg.schedule.unit == "samples":
        need(cfg.schedule.total_samples is not None and cfg.schedule.total_samples > 0,
             "schedule.total_samples", "is required (> 0) when schedule.unit is samples")
    for key in ("dp_replicate", "tp"):
        need(getattr(cfg.parallel, key) >= 1, f"parallel.{key}", "must be >= 1")
    need(cfg.parallel.dp_shard == -1 or cfg.parallel.dp_shard >= 1, "parallel.dp_shard", "must be -1 or >= 1")
    need(cfg.checkpoint.interval >= 0, "checkpoint.interval", "must be >= 0")
    need(cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1")
    need(cfg.data.seq_len > 1, "data.seq_len", "must be > 1")
    need(1 <= cfg.data.segments <= cfg.data.seq_len // 2, "data.segments", "must be in [1, seq_len/2]")
    for dotted, choices in _CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        need(value in choices, dotted, f"must be one of {', '.join(choices)}, got {value!r}")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """YAML file (or defaults when None) + `--set` overrides -> validated TrainConfig."""
    data = {}
    where = "config"
    if path is not None:
        where = str(path)
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: cannot read config: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a mapping")
    for key, value in parse_overrides(list(overrides)):
        _set_dotted(data, key, value)
    try:
        cfg = _from_dict(TrainConfig, data)
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return cfg


def to_dict(cfg: TrainConfig) -> dict:
    """Plain dict with the YAML key names (round-trips through load_config)."""

    def convert(obj):
        if dataclasses.is_dataclass(obj):
            inverse = {v: k for k, v in _KEY_ALIASES.items()}
            return {inverse.get(f.name, f.name): convert(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, (list, tuple)):
            return [convert(v) for v in obj]
        return obj

    return convert(cfg)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
