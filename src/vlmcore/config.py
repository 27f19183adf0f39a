"""Typed run config of one training stage: dataclasses, YAML load, `--set` overrides, validation.

Every error names the config key (and the file when there is one), so a typo in a
workflow-written YAML is found at once instead of deep inside the training loop.
"""

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A bad config value; `key` is the dotted config key it is about (None: the whole file)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


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
            raise ConfigError(f"{key}: expected a mapping, got {value!r}", key)
        return _from_dict(tp, value, key + ".")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}", key)
        (inner,) = typing.get_args(tp)
        return [_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        inner = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(inner):
            raise ConfigError(f"{key}: expected a list of {len(inner)} values, got {value!r}", key)
        return tuple(_convert(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, inner)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}", key)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}", key)
        return value
    if tp is float:
        # YAML 1.1 reads `1e-3` (no dot) as a string.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}", key)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}", key)
        return value
    raise TypeError(f"unsupported config annotation {tp} for {key}")


def _from_dict(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for raw_key, value in data.items():
        name = _KEY_ALIASES.get(raw_key, raw_key)
        if name not in names:
            raise ConfigError(f"{prefix}{raw_key}: unknown key (known: {', '.join(sorted(names))})", prefix + raw_key)
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


def _need(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}", key)


def _check_run(cfg: TrainConfig) -> None:
    _need(bool(cfg.model_path), "model_path", "is required")
    _need(bool(cfg.output_dir), "output_dir", "is required")
    _need(cfg.data.kind == "random" or bool(cfg.data_path), "data_path", "is required unless data.kind is random")
    _need(cfg.steps > 0, "steps", f"must be > 0, got {cfg.steps}")
    _need(cfg.micro_batch_size > 0, "micro_batch_size", f"must be > 0, got {cfg.micro_batch_size}")
    _need(cfg.grad_accum_steps > 0, "grad_accum_steps", f"must be > 0, got {cfg.grad_accum_steps}")
    _need(cfg.seed >= 0, "seed", f"must be >= 0, got {cfg.seed}")
    _need(cfg.num_workers >= 0, "num_workers", f"must be >= 0, got {cfg.num_workers}")
    _need(math.isfinite(cfg.max_grad_norm) and cfg.max_grad_norm >= 0, "max_grad_norm",
          f"must be >= 0 (0 = no clipping), got {cfg.max_grad_norm}")
    _need(cfg.loss_chunk_tokens > 0, "loss_chunk_tokens", f"must be > 0, got {cfg.loss_chunk_tokens}")
    _need(cfg.max_nonfinite_steps > 0, "max_nonfinite_steps", f"must be > 0, got {cfg.max_nonfinite_steps}")


def _check_optimizer(opt: OptimizerConfig) -> None:
    # A negative learning rate trains by gradient ascent without any other sign of trouble.
    for key in ("lr", "vision_lr", "projector_lr"):
        lr = getattr(opt, key)
        if lr is not None:
            _need(math.isfinite(lr) and lr >= 0, f"optimizer.{key}", f"must be a finite number >= 0, got {lr}")
    _need(math.isfinite(opt.weight_decay) and opt.weight_decay >= 0, "optimizer.weight_decay",
          f"must be >= 0, got {opt.weight_decay}")
    _need(all(0 <= b < 1 for b in opt.betas), "optimizer.betas", f"both must be in [0, 1), got {list(opt.betas)}")
    _need(math.isfinite(opt.eps) and opt.eps > 0, "optimizer.eps", f"must be > 0, got {opt.eps}")


def _check_schedule(cfg: TrainConfig) -> None:
    sched = cfg.schedule
    _need(0 <= sched.min_lr_ratio <= 1, "schedule.min_lr_ratio", f"must be in [0, 1], got {sched.min_lr_ratio}")
    _need(0 < sched.decay_fraction <= 1, "schedule.decay_fraction", f"must be in (0, 1], got {sched.decay_fraction}")
    _need(sched.warmup_steps >= 0, "schedule.warmup_steps", f"must be >= 0, got {sched.warmup_steps}")
    _need(sched.warmup_samples >= 0, "schedule.warmup_samples", f"must be >= 0, got {sched.warmup_samples}")
    if sched.unit == "steps":
        _need(sched.warmup_steps <= cfg.steps, "schedule.warmup_steps",
              f"must be <= steps ({cfg.steps}): the warmup is longer than the run, got {sched.warmup_steps}")
    if sched.unit == "samples":
        _need(sched.total_samples is not None and sched.total_samples > 0,
              "schedule.total_samples", "is required (> 0) when schedule.unit is samples")
        _need(sched.warmup_samples <= sched.total_samples, "schedule.warmup_samples",
              f"must be <= schedule.total_samples ({sched.total_samples}): the warmup is longer than the run, "
              f"got {sched.warmup_samples}")


def _check_parallel(par: ParallelConfig) -> None:
    for key in ("dp_replicate", "tp"):
        _need(getattr(par, key) >= 1, f"parallel.{key}", f"must be >= 1, got {getattr(par, key)}")
    _need(par.dp_shard == -1 or par.dp_shard >= 1, "parallel.dp_shard", f"must be -1 or >= 1, got {par.dp_shard}")


def _check_data(data: DataConfig) -> None:
    _need(data.seq_len > 1, "data.seq_len", f"must be > 1, got {data.seq_len}")
    _need(1 <= data.segments <= data.seq_len // 2, "data.segments",
          f"must be in [1, seq_len/2 = {data.seq_len // 2}], got {data.segments}")
    _need(0 <= data.image_fraction <= 1, "data.image_fraction", f"must be in [0, 1], got {data.image_fraction}")
    _need(data.image_side >= 1, "data.image_side", f"must be >= 1, got {data.image_side}")


def validate(cfg: TrainConfig) -> None:
    """Checks every choice and range (not the paths: see check_paths); raises ConfigError naming the key."""
    for dotted, choices in _CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        _need(value in choices, dotted, f"must be one of {', '.join(choices)}, got {value!r}")
    _check_run(cfg)
    _check_optimizer(cfg.optimizer)
    _check_schedule(cfg)
    _check_parallel(cfg.parallel)
    _check_data(cfg.data)
    _need(cfg.checkpoint.interval >= 0, "checkpoint.interval", f"must be >= 0, got {cfg.checkpoint.interval}")
    _need(cfg.checkpoint.keep >= 1, "checkpoint.keep", f"must be >= 1, got {cfg.checkpoint.keep}")
    peak = cfg.metrics.peak_tflops
    _need(peak is None or (math.isfinite(peak) and peak > 0), "metrics.peak_tflops", f"must be > 0 or null, got {peak}")


def check_paths(cfg: TrainConfig) -> None:
    """The inputs a run reads must exist: checked when a run starts, not when the workflow plans
    (the earlier jobs create them)."""
    model = Path(cfg.model_path)
    _need(model.is_dir(), "model_path", f"{model} is not a directory")
    _need((model / "config.json").is_file(), "model_path", f"{model} has no config.json (not an HF snapshot)")
    if cfg.init_from:
        _need((Path(cfg.init_from) / ".metadata").is_file(), "init_from",
              f"{cfg.init_from} is not a checkpoint directory (no .metadata), e.g. a previous stage's final/")
    if cfg.data.kind == "packed":
        _need(Path(cfg.data_path).is_dir(), "data_path", f"{cfg.data_path} is not a directory")


def warnings_of(cfg: TrainConfig) -> list[str]:
    """Legal settings that are probably mistakes."""
    found = []
    for key in ("lr", "vision_lr", "projector_lr"):
        if getattr(cfg.optimizer, key) == 0:
            found.append(f"optimizer.{key} is 0: its parameters will not change")
    return found


def from_dict(data: dict) -> TrainConfig:
    """A validated TrainConfig from a mapping with the YAML key names (paths not checked)."""
    cfg = _from_dict(TrainConfig, data)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = (), paths_must_exist: bool = False) -> TrainConfig:
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
        cfg = from_dict(data)
        if paths_must_exist:
            check_paths(cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}", e.key) from None
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
