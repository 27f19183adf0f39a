"""Process group and the `dp_replicate x dp_shard x tp` device mesh; for expert parallelism the
same ranks as `dp_replicate x dp_shard_mod_ep x ep x tp` (see parallel/dims.py)."""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from vlmcore.parallel.dims import ParallelDims, resolve_dims  # noqa: F401 (the mesh's callers use both)


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


def build_mesh(dims: ParallelDims, device: torch.device, prefix: str = "") -> DeviceMesh:
    """The run's mesh, dimensions dp_replicate, dp_shard, tp (tp innermost); a module with its
    own layout gets its own mesh of the same ranks, its dimensions named with a prefix
    (`vision_tp`)."""
    names = tuple(prefix + name for name in ("dp_replicate", "dp_shard", "tp"))
    return init_device_mesh(device.type, (dims.dp_replicate, dims.dp_shard, dims.tp), mesh_dim_names=names)


def expert_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The run's mesh with dp_shard split into (dp_shard_mod_ep, ep): the experts are split over
    `ep` and FSDP-sharded over `dp_shard_mod_ep`. Every rank calls it (it makes process groups).
    Its own mesh rather than `dp_shard` flattened from the two: torch deprecates slicing a
    flattened dimension from the root mesh."""
    # dim by index: torch 2.10's _unflatten refuses a dimension given by a name it has.
    return mesh._unflatten(1, (dims.dp_shard_mod_ep, dims.ep), ("dp_shard_mod_ep", "ep"))


def build_disjoint_meshes(layouts: dict[str, tuple[ParallelDims, range]], device: torch.device) -> dict:
    """Disjoint layouts: each module's mesh over its own ranks (the vision one's dimensions named
    `vision_*`). Every rank builds both: making process groups is collective over the world."""
    meshes = {}
    for module, (dims, ranks) in sorted(layouts.items()):
        prefix = "vision_" if module == "vision" else ""
        shape = (dims.dp_replicate, dims.dp_shard, dims.tp)
        meshes[module] = DeviceMesh(device.type, torch.arange(ranks.start, ranks.stop).view(shape),
                                    mesh_dim_names=tuple(prefix + name for name in ("dp_replicate", "dp_shard", "tp")))
    return meshes


def dp_mesh(mesh: DeviceMesh, dims: ParallelDims, prefix: str = "", shard: str = "dp_shard") -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D (FSDP) or 2-D replicate x shard (HSDP / DDP). The experts'
    is the one orthogonal to EP (`shard="dp_shard_mod_ep"`)."""
    if dims.dp_replicate == 1:
        return mesh[prefix + shard]
    return mesh[prefix + "dp_replicate", prefix + shard]


def dp_rank(dims: ParallelDims) -> int:
    """Data-parallel rank: tp is the innermost mesh dimension, so tp peers share a batch."""
    return dist.get_rank() // dims.tp
