"""Applies the parallelisms in their required order: TP, EP, activation checkpointing, per-block
compile, then FSDP2 (FSDP, HSDP or DDP by the mesh). The language model takes the run's mesh;
the vision tower its own layout (`parallel.modules.vision`) on the same ranks, or with disjoint
layouts each rank holds one module on its own ranks' mesh (`parallelize_disjoint`)."""

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from vlmcore.config import ConfigError, ModuleLayout, TrainConfig
from vlmcore.parallel.ac import apply_ac
from vlmcore.parallel.bridge import ReceivedImages, VisionBridge, count_images_once
from vlmcore.parallel.compile import apply_compile
from vlmcore.parallel.dims import check_layouts, refuse_disjoint
from vlmcore.parallel.expert_parallel import apply_ep
from vlmcore.parallel.fsdp import apply_fsdp
from vlmcore.parallel.mesh import ParallelDims, build_mesh, dp_mesh, expert_mesh
from vlmcore.parallel.tp import apply_tp, apply_vision_tp


def parallelize_vision(model: nn.Module, vision_dims: ParallelDims, mesh: DeviceMesh, dims: ParallelDims):
    """TP-shards the vision tower on its own mesh of the same ranks (the run's mesh when the
    layouts are the same); returns the mesh FSDP2 shards it over."""
    vision, prefix = mesh, ""
    if vision_dims != dataclasses.replace(dims, ep=1):  # (the vision tower has no experts)
        prefix = "vision_"
        vision = build_mesh(vision_dims, torch.device(mesh.device_type), prefix)
    if vision_dims.tp > 1:
        apply_vision_tp(model, vision[prefix + "tp"])
        VisionBridge(model.vision_tower(), vision[prefix + "tp"], dims.tp)
    count_images_once(model.vision_tower(), dims.tp)
    return dp_mesh(vision, vision_dims, prefix)


def _replace(model: nn.Module, part: nn.Module, new: nn.Module | None) -> str:
    """Puts `new` where `part` is in `model`; returns the part's state-dict prefix."""
    name = next(name for name, module in model.named_modules() if module is part)
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, new)
    return name + "."


def parallelize_disjoint(model: nn.Module, cfg: TrainConfig, mesh: DeviceMesh, dims: ParallelDims,
                         module: str) -> None:
    """Disjoint layouts: this rank holds `module` only, FSDP-sharded over its own ranks' mesh.
    An encoder rank drops the language model and the LM head (so no tie either); a language rank
    puts a parameterless stand-in for the vision tower (`ReceivedImages`), which returns the
    embeddings the bridge received."""
    if module == "vision":
        model.dropped_prefixes = tuple(_replace(model, part, None) for part in (model.text_model(), model.lm_head))
        model.config = copy.copy(model.config)
        model.config.tie_word_embeddings = False
        stack, root, blocks = model.vision_layers(), model.vision_tower(), []
    else:
        width = model.config.vision_config.out_hidden_size
        model.dropped_prefixes = (_replace(model, model.vision_tower(), ReceivedImages(width)),)
        stack, root, blocks = model.decoder_layers(), model, list(model.decoder_layers().children())
    if not any(p.requires_grad for p in model.parameters()):  # its ranks would have nothing to do
        raise ConfigError(f"trainable: no parameter of the {'vision tower' if module == 'vision' else 'language model'}"
                          f" trains, but it has ranks of its own (parallel.modules.{module}.ranks); train this stage "
                          f"with colocated layouts", "trainable")
    apply_ac(stack, cfg.parallel.activation_checkpointing)
    if cfg.parallel.compile:
        apply_compile(stack, cfg.parallel.activation_checkpointing)
    apply_fsdp(root, blocks, None, dp_mesh(mesh, dims, "vision_" if module == "vision" else ""), None,
               param_dtype=getattr(torch, cfg.precision.param_dtype),
               reduce_dtype=getattr(torch, cfg.precision.reduce_dtype))


def parallelize(model: nn.Module, cfg: TrainConfig, mesh: DeviceMesh, dims: ParallelDims,
                shard_one_rank: bool = False) -> list:
    """Returns the (module, attribute name) of the parameters whose gradients must be summed over
    the TP ranks. `shard_one_rank`: see `apply_fsdp`."""
    blocks, vision = model.decoder_layers(), model.vision_tower()
    if vision is None and cfg.parallel.modules.vision != ModuleLayout():
        raise ConfigError(f"parallel.modules.vision: the {model.config.model_type} model has no vision tower",
                          "parallel.modules.vision")
    layouts = check_layouts(cfg, dist.get_world_size())
    refuse_disjoint(cfg.parallel, layouts)
    if cfg.parallel.modules.vision.ranks != "all":
        if getattr(model.config.get_text_config(), "num_experts", 0):
            raise ConfigError("parallel.modules.vision.ranks: disjoint layouts of a mixture-of-experts model are not "
                              "supported yet (use colocated layouts)", "parallel.modules.vision.ranks")
        module = "vision" if dist.get_rank() in layouts["vision"][1] else "language"
        parallelize_disjoint(model, cfg, mesh, dims, module)
        return []
    partial, experts = [], expert_mesh(mesh, dims) if dims.ep > 1 else None
    if dims.tp > 1:
        partial = apply_tp(model, mesh["tp"], cfg.parallel.sequence_parallel)
    if experts is not None:
        apply_ep(model, experts["ep"])
    vision_dp_mesh = parallelize_vision(model, layouts["vision"][0], mesh, dims) if vision is not None else None
    for stack in [blocks] + ([model.vision_layers()] if vision is not None else []):
        apply_ac(stack, cfg.parallel.activation_checkpointing)
        if cfg.parallel.compile:
            apply_compile(stack, cfg.parallel.activation_checkpointing)
    apply_fsdp(model, list(blocks.children()), vision, dp_mesh(mesh, dims), vision_dp_mesh,
               param_dtype=getattr(torch, cfg.precision.param_dtype),
               reduce_dtype=getattr(torch, cfg.precision.reduce_dtype),
               expert_mesh=dp_mesh(experts, dims, shard="dp_shard_mod_ep") if experts is not None else None,
               shard_one_rank=shard_one_rank)
    return partial
