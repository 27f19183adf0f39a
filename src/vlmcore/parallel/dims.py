"""The `dp_replicate x dp_shard x tp` sizes a parallel config gives on a world size. No torch,
so the workflow checks every stage's layout on the login node, before any job is queued.

Expert parallelism is carved out of the shard ranks: `dp_shard = dp_shard_mod_ep x ep`. Each
group of `ep` consecutive shard ranks splits the experts between its ranks (and exchanges tokens);
the `dp_shard_mod_ep` ranks orthogonal to it FSDP-shard each expert shard further."""

from dataclasses import dataclass

from vlmcore.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.ep

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
    dims = ParallelDims(replicate, shard, tp, cfg.ep)
    if shard < 1 or dims.world_size != world_size:
        raise ConfigError(
            f"parallel: dp_replicate ({cfg.dp_replicate}) x dp_shard ({cfg.dp_shard}) x tp ({cfg.tp}) "
            f"does not fit the world size {world_size}", "parallel")
    if shard % cfg.ep:
        raise ConfigError(f"parallel.ep: {cfg.ep} does not divide the data-parallel shard ranks (dp_shard {shard} "
                          f"on {world_size} ranks)", "parallel.ep")
    return dims
