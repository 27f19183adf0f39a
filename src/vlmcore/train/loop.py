"""`vlmcore train CONFIG [--set key=value ...]`: one training stage, under torchrun or as one process.

Setup order: process group and mesh; model on the meta device; stage freezing; parallelize
(TP, AC, compile, FSDP2); materialize and load weights (HF snapshot or a previous stage's
final/); optimizer; data; resume from the latest checkpoint. Then the loop below.

The loss of a step is the sum of token losses over all micro-batches and data-parallel ranks
divided by the global number of label tokens (counted before the forward passes), and FSDP
reduces gradients by SUM: any split of the same global batch gives the same gradients.
"""

import argparse
import os
import resource
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from vlmcore.config import ConfigError, TrainConfig, load_config, save_config, to_dict, warnings_of
from vlmcore.parallel.mesh import build_mesh, device_for_rank, dp_rank, init_distributed, resolve_dims
from vlmcore.parallel.parallelize import parallelize, vision_tower
from vlmcore.train.checkpoint import (Checkpointer, load_hf_weights, load_model_weights, rng_state, save_final,
                                      set_rng_state)
from vlmcore.train.loss import chunked_cross_entropy
from vlmcore.train.metrics import MetricsLogger, batch_flops, peak_tflops
from vlmcore.train.optim import build_optimizer, clean_name, freeze, lr_factor, schedule_total, set_lr
from vlmcore.train.run_dir import archive_stale_run, mark_done, mark_unfinished


class TrainingError(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML run config (see vlmcore.config.TrainConfig)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, dotted keys for sections (repeatable)")


def run(args) -> int:
    # Every rank reads the same file: one rank says what is wrong with it.
    first_rank = os.environ.get("RANK", "0") == "0"
    try:
        cfg = load_config(args.config, args.set, paths_must_exist=True)
    except ConfigError as e:
        if first_rank:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if first_rank:
        for warning in warnings_of(cfg):
            print(f"warning: {args.config}: {warning}", file=sys.stderr)
    try:
        return train(cfg)
    except ConfigError as e:  # a setting that does not fit the model or the world size
        print(f"error: {args.config}: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


class _StopSignal:
    """Records SIGTERM / SIGUSR1 (SLURM's warning before the time limit); the loop checkpoints
    and exits at the end of the current step."""

    def __init__(self):
        self.signum = 0
        for s in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum


def build_data(cfg: TrainConfig, model_config, rank: int, world: int):
    if cfg.data.kind == "random":
        from vlmcore.train.random_data import RandomBatches

        return RandomBatches(model_config, seq_len=cfg.data.seq_len, segments=cfg.data.segments,
                             image_fraction=cfg.data.image_fraction, micro_batch_size=cfg.micro_batch_size,
                             dp_rank=rank, dp_world=world, grad_accum_steps=cfg.grad_accum_steps, seed=cfg.seed,
                             image_side=cfg.data.image_side)
    from vlmcore.data.loader import build_loader

    return build_loader(cfg.data_path, dp_rank=rank, dp_world=world, micro_batch_size=cfg.micro_batch_size,
                        seed=cfg.seed, num_workers=cfg.num_workers)


def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients, correct for FSDP / TP (sharded DTensor) gradients:
    one reduction per (mesh, placements) group, then combined."""
    groups = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = p.grad
            groups[(g.device_mesh, g.placements) if isinstance(g, DTensor) else None].append(g)
    total = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total += norm.double().cpu() ** 2
    return total.sqrt()


def sum_partial_grads(params: list[torch.Tensor], group) -> None:
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=group)


class VisionDummy:
    """Runs the vision tower on a tiny zero image, weighted by 0, for micro-batches without images.

    The vision tower is one FSDP unit, so every rank must take part in its collectives at the
    same point: for a text-only micro-batch this runs it right after the token embedding (a
    forward hook), where an image batch runs it too, and adds `0 * output` to the embeddings, so
    the backward graph has the same shape on every rank and the gradients are unchanged.
    """

    def __init__(self, model: torch.nn.Module, vision: torch.nn.Module):
        self.vision = vision
        self.config = model.config.vision_config
        self.active = False
        embed = next(m for n, m in model.named_modules() if n.endswith("embed_tokens") and "visual" not in n)
        embed.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if not self.active:
            return output
        v, device = self.config, output.device
        merge = v.spatial_merge_size
        pixels = torch.zeros(merge * merge, v.in_channels * v.temporal_patch_size * v.patch_size ** 2, device=device)
        grid = torch.tensor([[1, merge, merge]], device=device)
        leaves = torch.utils._pytree.tree_leaves(self.vision(pixels, grid))
        return output + sum(t.float().sum() for t in leaves if torch.is_tensor(t) and t.is_floating_point()) * 0.0


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _peak_mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def train(cfg: TrainConfig) -> int:
    out = Path(cfg.output_dir)
    if (out / "done").exists():
        print(f"{out}/done exists: stage already trained")
        return 0
    device = device_for_rank()
    init_distributed(device)
    try:
        return _train(cfg, out, device)
    finally:
        dist.destroy_process_group()


def build_meta_model(cfg: TrainConfig, mesh, dims):
    """The stage's model on the meta device (no memory): frozen by `trainable` and parallelized.
    Returns the model and the names of parameters with TP-partial gradients."""
    from vlmcore.models import build_model

    model = build_model(cfg.model_path, device="meta")
    freeze(model, cfg.trainable)
    return model, set(parallelize(model, cfg, mesh, dims))


def materialize(model, device: torch.device) -> None:
    """Allocates each rank's shards on `device` and fills them with the random init."""
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()


def build_parallel_model(cfg: TrainConfig, mesh, dims, device: torch.device):
    """The stage's model, sharded and loaded: the previous stage's final/, else the snapshot's
    safetensors. Returns the model and the names of parameters with TP-partial gradients."""
    model, partial_names = build_meta_model(cfg, mesh, dims)
    materialize(model, device)
    if cfg.init_from:
        load_model_weights(model, cfg.init_from)
    elif any(Path(cfg.model_path).glob("*.safetensors")):
        load_hf_weights(model, cfg.model_path)
    elif dist.get_rank() == 0:
        print(f"{cfg.model_path}: no safetensors, training from random init")
    return model, partial_names


def resume(checkpointer: Checkpointer, path: Path, model, optimizer, data, state: dict, layout: dict) -> None:
    """Loads model, optimizer and `state` in place; the loader position and RNG only when the
    layout is the one that wrote the checkpoint (they are per rank)."""
    layout_state = {f"layout_{k}": 0 for k in layout}
    dcp.load({"train": layout_state}, checkpoint_id=str(path))
    same_layout = all(layout_state[f"layout_{k}"] == v for k, v in layout.items())
    rank_state = {"rng": rng_state(), "loader": data.state_dict()} if same_layout else None
    config_values = [{k: g[k] for k in ("base_lr", "weight_decay", "betas", "eps")} for g in optimizer.param_groups]
    checkpointer.load(path, model, optimizer, state, rank_state)
    for group, values in zip(optimizer.param_groups, config_values):
        group.update(values)  # the config wins over the checkpoint's hyperparameters
    if rank_state is not None:
        set_rng_state(rank_state["rng"])
        data.load_state_dict(rank_state["loader"])
    elif dist.get_rank() == 0:
        print(f"{path}: another layout wrote it; model and optimizer resharded, data stream and RNG restart")
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {state['step']}")


def forward_backward(model, micro: list[dict], label_tokens: float, vision_dummy, chunk_tokens: int) -> torch.Tensor:
    """Accumulates the gradients of sum(token losses) / label_tokens over the micro-batches;
    returns this rank's sum of token losses."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    for i, batch in enumerate(micro):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(i == len(micro) - 1)  # reduce once, after the last
        if vision_dummy is not None:
            vision_dummy.active = batch.get("pixel_values") is None
        output = model(batch["input_ids"], pixel_values=batch.get("pixel_values"),
                       image_grid_thw=batch.get("image_grid_thw"), position_ids=batch.get("position_ids"),
                       cu_seqlens=batch.get("cu_seqlens"), return_hidden=True)
        local_sum, _ = chunked_cross_entropy(output.hidden_states, model.lm_head.weight, batch["labels"],
                                             chunk_tokens)
        (local_sum / label_tokens).backward()
        loss_sum += local_sum.detach().double().cpu()
        del output, local_sum
    return loss_sum


def clip_grads(params: list[torch.Tensor], norm: float, max_norm: float) -> None:
    coef = max_norm / (norm + 1e-6)
    if max_norm > 0 and coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def _train(cfg: TrainConfig, out: Path, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = resolve_dims(cfg.parallel, world)
    mesh = build_mesh(dims, device)
    data_rank = dp_rank(dims)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed)
    model, partial_names = build_parallel_model(cfg, mesh, dims, device)
    model.train()
    optimizer = build_optimizer(model, cfg.optimizer, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    partial = [p for n, p in model.named_parameters() if clean_name(n) in partial_names and p.requires_grad]
    tp_group = mesh["tp"].get_group() if dims.tp > 1 else None
    vision = vision_tower(model)
    vision_dummy = VisionDummy(model, vision) if vision is not None else None
    data = build_data(cfg, model.config, data_rank, dims.dp)

    # Written only now: a setting that does not fit the model (trainable, tp) leaves nothing behind.
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        reason = archive_stale_run(out, cfg)  # checkpoints of another run are moved aside
        if reason:
            print(reason)
        mark_unfinished(out)
        save_config(cfg, out / "config.yaml")
    dist.barrier()

    layout = {"world_size": world, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp,
              "grad_accum_steps": cfg.grad_accum_steps, "micro_batch_size": cfg.micro_batch_size}
    state = {"step": 0, "samples": 0, "tokens": 0, "skipped_steps": 0, **{f"layout_{k}": 0 for k in layout}}
    checkpointer = Checkpointer(out, cfg.checkpoint.keep, cfg.checkpoint.async_save) if cfg.checkpoint.enabled else None
    latest = checkpointer.latest() if checkpointer else None
    if latest is not None:
        resume(checkpointer, latest, model, optimizer, data, state, layout)
    state.update({f"layout_{k}": v for k, v in layout.items()})
    if state["step"] == cfg.steps and rank == 0:
        print(f"step {cfg.steps} was reached before final/ and done were written: writing them, no training")

    logger = MetricsLogger(out, rank == 0, cfg.metrics.tensorboard, cfg.metrics.wandb, to_dict(cfg), state["step"])
    peak = peak_tflops(device, cfg.metrics.peak_tflops)
    stop = _StopSignal()
    batches = iter(data)
    nonfinite_in_a_row = 0

    def save_checkpoint():
        if checkpointer is not None:
            checkpointer.save(state["step"], model, optimizer, dict(state),
                              {"rng": rng_state(), "loader": data.state_dict()})

    while state["step"] < cfg.steps:
        t0 = time.perf_counter()
        micro = [_to_device(next(batches), device) for _ in range(cfg.grad_accum_steps)]
        data_wait = time.perf_counter() - t0
        llm_flops, vision_flops = map(sum, zip(*(batch_flops(model.config, b) for b in micro)))
        counts = torch.tensor([sum(int((b["labels"] != -100).sum()) for b in micro),
                               sum(b["num_samples"] for b in micro), sum(b["input_ids"].numel() for b in micro),
                               llm_flops, vision_flops], dtype=torch.float64)
        dist.all_reduce(counts)
        label_tokens, samples, tokens, llm_flops, vision_flops = (counts / dims.tp).tolist()
        if label_tokens == 0:
            raise TrainingError(f"step {state['step'] + 1}: the global batch has no label tokens")

        loss_sum = forward_backward(model, micro, label_tokens, vision_dummy, cfg.loss_chunk_tokens)
        if partial:
            sum_partial_grads(partial, tp_group)
        norm = grad_norm(trainable)
        dist.all_reduce(loss_sum)
        step_loss = float(loss_sum) / dims.tp / label_tokens

        done = state["step"] + 1 if cfg.schedule.unit == "steps" else state["samples"] + int(samples)
        factor = lr_factor(cfg.schedule, done, schedule_total(cfg))
        if torch.isfinite(norm) and torch.isfinite(torch.tensor(step_loss)):
            clip_grads(trainable, float(norm), cfg.max_grad_norm)
            set_lr(optimizer, factor)
            optimizer.step()
            nonfinite_in_a_row = 0
        else:
            state["skipped_steps"] += 1
            nonfinite_in_a_row += 1
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        state["samples"] += int(samples)
        state["tokens"] += int(tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time = time.perf_counter() - t0

        llm_tflops = llm_flops / step_time / world / 1e12
        vision_tflops = vision_flops / step_time / world / 1e12
        logger.log({
            "step": state["step"], "loss": step_loss, "grad_norm": float(norm), "lr": cfg.optimizer.lr * factor,
            "tokens": state["tokens"], "samples": state["samples"], "label_tokens": int(label_tokens),
            "tokens_per_s": tokens / step_time, "tokens_per_s_per_device": tokens / step_time / world,
            "tflops_per_device": llm_tflops + vision_tflops,
            "mfu": 100 * (llm_tflops + vision_tflops) / peak if peak else None,
            "llm_tflops_per_device": llm_tflops, "vision_tflops_per_device": vision_tflops,
            "peak_mem_gb": _peak_mem_gb(device), "data_wait_s": data_wait, "step_time_s": step_time,
            "world_size": world, "skipped_steps": state["skipped_steps"],
        })

        if nonfinite_in_a_row >= cfg.max_nonfinite_steps:
            save_checkpoint()
            _finish(checkpointer, logger)
            raise TrainingError(f"step {state['step']}: {nonfinite_in_a_row} steps in a row with a non-finite "
                                f"loss or gradient norm; checkpoint saved, stopping (max_nonfinite_steps)")
        flag = torch.tensor([stop.signum])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            save_checkpoint()
            _finish(checkpointer, logger)
            if rank == 0:
                print(f"signal {flag.item()}: checkpoint saved at step {state['step']}, exiting to be resumed")
            return 128 + int(flag.item())
        last = state["step"] == cfg.steps
        if (cfg.checkpoint.interval and state["step"] % cfg.checkpoint.interval == 0) or last:
            save_checkpoint()

    _finish(checkpointer, logger)
    if cfg.save_final:
        save_final(out, model, {"model_path": cfg.model_path, "step": state["step"], "tokens": state["tokens"],
                                "samples": state["samples"], "stage_config": to_dict(cfg)})
    if rank == 0:
        mark_done(out)
    return 0


def _finish(checkpointer, logger) -> None:
    if checkpointer is not None:
        checkpointer.wait()
    logger.close()
