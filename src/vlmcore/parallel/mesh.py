"""Process group and the `dp_replicate x dp_shard x tp` device mesh."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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
            f"does not fit the world size {world_size}")
    return dims


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(device: torch.device) -> None:
    """Joins the torchrun process group, or makes a one-process group when not under torchrun,
    so the rest of the engine (FSDP2, DCP) runs the same code either way."""
    if dist.is_initialized():
        return
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def build_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (dims.dp_replicate, dims.dp_shard, dims.tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def dp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D (FSDP) or 2-D replicate x shard (HSDP / DDP)."""
    if dims.dp_replicate == 1:
        return mesh["dp_shard"]
    return mesh["dp_replicate", "dp_shard"]


def dp_rank(dims: ParallelDims) -> int:
    """Data-parallel rank: tp is the innermost mesh dimension, so tp peers share a batch."""
    return dist.get_rank() // dims.tp
