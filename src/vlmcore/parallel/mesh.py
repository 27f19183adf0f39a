"""The process group, and the device meshes of a run layout (vlmcore.parallel.layout)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from vlmcore.parallel.layout import RunLayout


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout: timedelta | None = None) -> None:
    """Joins the torchrun process group, or makes a one-process group when not under torchrun,
    so the rest of the engine (FSDP2, DCP) runs the same code either way. `timeout`: how long a
    collective waits for its peers (None: torch's default)."""
    if dist.is_initialized():
        return
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


class Meshes:
    """The device meshes of a run layout, found by module name. Every rank builds all of them:
    making process groups is collective over the world.

    A module's mesh is `dp_replicate x dp_shard x tp` over its ranks (tp innermost; with context
    parallelism `dp_replicate x dp_shard_cp x tp`, the cp ranks innermost in dp_shard_cp). The vision
    tower shares the language model's unless its degrees differ or it has ranks of its own (its
    dimensions are then named `vision_*`). Under expert parallelism the experts get the language
    ranks again with dp_shard (under cp: dp_shard x cp) unflattened into `dp_shard_mod_ep x ep`:
    their weights are split over `ep` and FSDP-sharded over `dp_shard_mod_ep` (a mesh of its own
    rather than `dp_shard` flattened from the two: torch deprecates slicing a flattened dimension
    from the root mesh)."""

    def __init__(self, layout: RunLayout, device: torch.device) -> None:
        self.layout = layout
        self.meshes = {"language": self._module_mesh("language", device)}
        dims = layout.language.dims
        language = self.meshes["language"]
        # FSDP shards over dp_shard x cp (the cp ranks of a row hold different tokens, so their
        # gradients add up like those of different rows); the cp ranks are that dimension
        # unflattened, from the same root mesh as the TP mesh (FSDP2 composes only meshes of one root).
        # Dimension 1 by index: torch 2.10's _unflatten refuses a dimension given by a name it has.
        self.context = language._unflatten(1, (dims.dp_shard, dims.cp), ("dp_shard", "cp")) if dims.cp > 1 else None
        # ep out of dp_shard (x cp): consecutive ranks, under cp first a row's cp ranks.
        self.experts = (
            language._unflatten(1, (dims.dp_shard_mod_ep, dims.ep), ("dp_shard_mod_ep", "ep")) if dims.ep > 1 else None
        )
        self.meshes["vision"] = (
            self._module_mesh("vision", device) if layout.vision_mesh_of_its_own else self.meshes["language"]
        )

    def _module_mesh(self, module: str, device: torch.device) -> DeviceMesh:
        grid = self.layout.grid(module)
        dims = ("dp_replicate", "dp_shard", "tp")
        names = tuple(self._name(module, name) for name in dims)
        shape = tuple(getattr(grid.dims, name) for name in dims)
        if grid.dims.cp > 1:
            names = ("dp_replicate", "dp_shard_cp", "tp")
            shape = (shape[0], shape[1] * grid.dims.cp, shape[2])
        if not self.layout.disjoint:
            return init_device_mesh(device.type, shape, mesh_dim_names=names)
        return DeviceMesh(
            device.type, torch.arange(grid.ranks.start, grid.ranks.stop).view(shape), mesh_dim_names=names
        )

    def _name(self, module: str, dim: str) -> str:
        return ("vision_" if module == "vision" and self.layout.vision_mesh_of_its_own else "") + dim

    def tp(self, module: str = "language") -> DeviceMesh:
        return self.meshes[module][self._name(module, "tp")]

    def dp(self, module: str = "language") -> DeviceMesh:
        """The mesh FSDP2 shards the module over: 1-D (FSDP) or 2-D replicate x shard (HSDP / DDP)."""
        mesh = self.meshes[module]
        replicate = self._name(module, "dp_replicate")
        shard = self._name(module, "dp_shard")
        if module == "language" and self.context is not None:
            shard = "dp_shard_cp"
        return mesh[shard] if self.layout.grid(module).dims.dp_replicate == 1 else mesh[replicate, shard]

    def cp(self) -> DeviceMesh:
        """The language model's context-parallel ranks: the ranks that share rows."""
        return self.context["cp"]

    def ep(self) -> DeviceMesh:
        return self.experts["ep"]

    def expert_dp(self) -> DeviceMesh:
        """The mesh FSDP2 shards the experts over: the ranks orthogonal to EP."""
        if self.layout.language.dims.dp_replicate == 1:
            return self.experts["dp_shard_mod_ep"]
        return self.experts["dp_replicate", "dp_shard_mod_ep"]
