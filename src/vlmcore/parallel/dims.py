"""The `dp_replicate x dp_shard x tp` sizes a parallel config gives on a world size. No torch,
so the workflow checks every stage's layout on the login node, before any job is queued."""

from dataclasses import dataclass

from vlmcore.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp


def resolve_dims(cfg: ParallelConfig, world_size: int) -> ParallelDims:
    """Fills in `dp_shard: -1` and checks the product against the world size."""
    replicate, shard, tp = cfg.dp_replicate, cfg.dp_shard, cfg.tp
    if cfg.mode == "ddp":  # dp_shard is 1 or -1 (vlmcore.config.RULES)
        shard, replicate = 1, -1 if replicate == 1 else replicate
    if replicate == -1:
        replicate = world_size // tp if world_size % tp == 0 else 0
    if shard == -1:
        shard = world_size // (replicate * tp) if world_size % (replicate * tp) == 0 else 0
    dims = ParallelDims(replicate, shard, tp)
    if shard < 1 or dims.world_size != world_size:
        raise ConfigError(
            f"parallel: dp_replicate ({cfg.dp_replicate}) x dp_shard ({cfg.dp_shard}) x tp ({cfg.tp}) "
            f"does not fit the world size {world_size}", "parallel")
    return dims
