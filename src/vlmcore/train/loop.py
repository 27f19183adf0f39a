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
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from vlmcore.config import ConfigError, TrainConfig, load_config, save_config, to_dict, warnings_of
from vlmcore.families import family
from vlmcore.parallel.bridge import DisjointBridge, SourceBatches
from vlmcore.parallel.dims import check_layouts
from vlmcore.parallel.mesh import (build_disjoint_meshes, build_mesh, device_for_rank, dp_rank, init_distributed,
                                   resolve_dims)
from vlmcore.parallel.parallelize import parallelize
from vlmcore.models import build_model, load_hf_config, load_hf_weights
from vlmcore.train.checkpoint import (CheckpointError, Checkpointer, load_model_weights, rng_state, save_final,
                                      set_rng_state)
from vlmcore.train.metrics_log import MetricsLogger, batch_flops, peak_tflops
from vlmcore.train.module_timer import ModuleTimer
from vlmcore.train.optim import build_optimizer, freeze, lr_factor, schedule_total, set_lr
from vlmcore.train.run_dir import archive_stale_run, mark_done, mark_unfinished
from vlmcore.train.step import build_step, host_stats


class TrainingError(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vlmcore.cli import existing_file

    parser.add_argument("config", type=existing_file, help="YAML run config (see vlmcore.config.TrainConfig)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, dotted keys for sections (repeatable)")


def run(args) -> int:
    from vlmcore.data.quality import DataError

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
    except (TrainingError, DataError, CheckpointError) as e:  # DataError: a damaged shard, refused before any step
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


def _gather_counts(counts: Counter, tp: int) -> dict:
    """The sum over all ranks of per-rank counts by name (TP ranks read the same data)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(counts))
    return {name: n // tp for name, n in sorted(sum(map(Counter, gathered), Counter()).items())}


def _peak_mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def train(cfg: TrainConfig) -> int:
    out = Path(cfg.output_dir)
    if (out / "done").exists():
        print(f"{out}/done exists: stage already trained")
        return 0
    # From the start: SLURM's warning can come while the model loads, and SIGUSR1's default
    # action would kill the trainer there.
    stop = _StopSignal()
    device = device_for_rank()
    init_distributed(device)
    try:
        return _train(cfg, out, device, stop)
    finally:
        dist.destroy_process_group()


def check_kernels(cfg: TrainConfig, device: torch.device) -> dict:
    """The attention, Gated DeltaNet and MoE experts backends of this run (vlmcore.kernels), set for the model
    code; a version known to compute wrongly on this GPU stops the run here, before any work."""
    from vlmcore import kernels
    from vlmcore.models.gpu_kernels import use_backends

    model = family(cfg.model_path)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    try:
        backends = kernels.check(cfg.parallel.linear_attention, capability, model.linear_attention,
                                 has_experts=model.experts)
    except kernels.KernelError as e:
        key = "parallel.linear_attention" if str(e).startswith("linear_attention") else "model_path"
        raise ConfigError(f"{key}: {e}") from None
    use_backends(backends)
    return backends


def build_meta_model(cfg: TrainConfig, mesh, dims, shard_one_rank: bool = False):
    """The stage's model on the meta device (no memory): frozen by `trainable` and parallelized.
    Returns the model and its parameters with TP-partial gradients (`apply_tp`).
    `shard_one_rank`: see `vlmcore.parallel.fsdp.apply_fsdp`."""
    model = build_model(cfg.model_path, device="meta")
    freeze(model, cfg.trainable)
    return model, parallelize(model, cfg, mesh, dims, shard_one_rank)


def materialize(model, device: torch.device) -> None:
    """Allocates each rank's shards on `device` and fills them with the random init."""
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()


def build_parallel_model(cfg: TrainConfig, mesh, dims, device: torch.device):
    """The stage's model, sharded and loaded: the previous stage's final/, else the snapshot's
    safetensors. Returns the model and its parameters with TP-partial gradients (`apply_tp`)."""
    model, partial_params = build_meta_model(cfg, mesh, dims)
    materialize(model, device)
    if cfg.init_from:
        load_model_weights(model, cfg.init_from)
    elif any(Path(cfg.model_path).glob("*.safetensors")):
        load_hf_weights(model, cfg.model_path)
    elif dist.get_rank() == 0:
        print(f"{cfg.model_path}: no safetensors, training from random init")
    return model, partial_params


def resume(checkpointer: Checkpointer, path: Path, model, optimizer, data, state: dict, layout: dict) -> None:
    """Loads model, optimizer and `state` in place; the loader position and RNG only when the
    layout is the one that wrote the checkpoint (they are per rank)."""
    layout_state = {f"layout_{k}": 0 for k in layout}
    dcp.load({"train": layout_state}, checkpoint_id=str(path))
    same_layout = all(layout_state[f"layout_{k}"] == v for k, v in layout.items())
    rank_state = {"rng": rng_state(), "loader": data.state_dict()} if same_layout else None
    # The config wins over the checkpoint's group settings (name, lr, weight decay, betas, eps, the
    # fused or foreach kernel): a checkpoint keeps them by group index, and under disjoint layouts
    # the encoder and language ranks' groups share indices, so a rank may read another's settings
    # or none (torch then falls back to AdamW's defaults: no fused kernel after a resume).
    built = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    checkpointer.load(path, model, optimizer, state, rank_state)
    for group, settings in zip(optimizer.param_groups, built):
        group.update(settings)
    if rank_state is not None:
        set_rng_state(rank_state["rng"])
        data.load_state_dict(rank_state["loader"])
    elif dist.get_rank() == 0:
        print(f"{path}: another layout wrote it; model and optimizer resharded, data stream and RNG restart")
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {state['step']}")


def set_seed_and_determinism(cfg: TrainConfig) -> None:
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed)


def prepare_output_dir(cfg: TrainConfig, out: Path) -> None:
    """Rank 0 moves another run's checkpoints aside, marks the run unfinished and saves its config."""
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        reason = archive_stale_run(out, cfg)
        if reason:
            print(reason)
        mark_unfinished(out)
        save_config(cfg, out / "config.yaml")
    dist.barrier()


def start_state(cfg: TrainConfig, out: Path, dims, model, optimizer, data):
    """The checkpointer (None when disabled) and the run's counters, resumed from the latest
    intact checkpoint if there is one. `dims`: the data loader's layout (the language model's)."""
    layout = {"world_size": dist.get_world_size(), "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
              "tp": dims.tp, "grad_accum_steps": cfg.grad_accum_steps, "micro_batch_size": cfg.micro_batch_size}
    state = {"step": 0, "samples": 0, "tokens": 0, "skipped_steps": 0, **{f"layout_{k}": 0 for k in layout}}
    checkpointer = Checkpointer(out, cfg.checkpoint.keep, cfg.checkpoint.async_save) if cfg.checkpoint.enabled else None
    latest = checkpointer.latest() if checkpointer else None
    if latest is not None:
        resume(checkpointer, latest, model, optimizer, data, state, layout)
    state.update({f"layout_{k}": v for k, v in layout.items()})
    if state["step"] == cfg.steps and dist.get_rank() == 0:
        print(f"step {cfg.steps} was reached before final/ and done were written: writing them, no training")
    return checkpointer, state


def global_counts(host_micro: list, model_config, tp: int, step: int) -> dict:
    """Label tokens, samples, tokens and FLOPs of the global batch, summed on the host (gloo: no
    GPU wait); tp peers hold the same batch, hence the division."""
    stats = host_stats(host_micro)
    flops = [batch_flops(model_config, b) for b in host_micro]
    llm_flops, vision_flops = sum(f[0] for f in flops), sum(f[1] for f in flops)
    skipped = sum((Counter(b.skipped_samples) for b in host_micro), Counter())  # bad samples
    keys = ("label_tokens", "samples", "tokens", "llm_flops", "vision_flops", "skipped_samples")
    counts = torch.tensor([*(stats[k] for k in keys[:3]), llm_flops, vision_flops, sum(skipped.values())],
                          dtype=torch.float64)
    dist.all_reduce(counts)
    counts = dict(zip(keys, (counts / tp).tolist()))
    if counts["label_tokens"] == 0:
        raise TrainingError(f"step {step + 1}: the global batch has no label tokens")
    # By reason only on steps that have any: every rank sees the same global sum, so all gather or none.
    if counts["skipped_samples"]:
        counts["skipped_samples_by_reason"] = _gather_counts(skipped, tp)
    return counts


def step_record(cfg: TrainConfig, state: dict, result, counts: dict, lr_scale: float, step_time: float,
                data_wait: float, peak: float | None, device: torch.device, tp: int) -> dict:
    """One line of metrics.jsonl."""
    world = dist.get_world_size()
    llm_tflops = counts["llm_flops"] / step_time / world / 1e12
    vision_tflops = counts["vision_flops"] / step_time / world / 1e12
    tokens = counts["tokens"]
    return {
        "step": state["step"], "loss": result.loss_sum / tp / counts["label_tokens"], "grad_norm": result.grad_norm,
        "lr": cfg.optimizer.lr * lr_scale, "tokens": state["tokens"], "samples": state["samples"],
        "label_tokens": int(counts["label_tokens"]),
        "tokens_per_s": tokens / step_time, "tokens_per_s_per_device": tokens / step_time / world,
        "tflops_per_device": llm_tflops + vision_tflops,
        "mfu": 100 * (llm_tflops + vision_tflops) / peak if peak else None,
        "llm_tflops_per_device": llm_tflops, "vision_tflops_per_device": vision_tflops,
        "peak_mem_gb": _peak_mem_gb(device), "data_wait_s": data_wait, "step_time_s": step_time,
        "world_size": world, "skipped_steps": state["skipped_steps"], "skipped_samples": int(counts["skipped_samples"]),
        **({"skipped_samples_by_reason": counts["skipped_samples_by_reason"]} if counts["skipped_samples"] else {}),
        **(result.moe or {}),  # moe_aux_loss, moe_load_imbalance
    }


def agreed_signal(stop: _StopSignal) -> int:
    """The stop signal any rank received (0: none), the same on every rank."""
    flag = torch.tensor([stop.signum])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def disjoint_setup(cfg: TrainConfig, device: torch.device):
    """Disjoint layouts (`parallel.modules.*.ranks`): every module's (dims, ranks), and this
    rank's module's dims and mesh."""
    layouts = check_layouts(cfg, dist.get_world_size())
    meshes = build_disjoint_meshes(layouts, device)
    module = "vision" if dist.get_rank() in layouts["vision"][1] else "language"
    return layouts, layouts[module][0], meshes[module]


def _train(cfg: TrainConfig, out: Path, device: torch.device, stop: _StopSignal) -> int:
    rank, dims = dist.get_rank(), resolve_dims(cfg.parallel, dist.get_world_size())
    disjoint = cfg.parallel.modules.vision.ranks != "all"
    if disjoint:
        layouts, dims, mesh = disjoint_setup(cfg, device)
    else:
        mesh = build_mesh(dims, device)
    set_seed_and_determinism(cfg)
    backends = check_kernels(cfg, device)  # before anything is written
    if rank == 0:
        print("kernels: " + ", ".join(f"{part} {backend}" for part, backend in backends.items()))
    model, partial_params = build_parallel_model(cfg, mesh, dims, device)
    model.train()
    optimizer = build_optimizer(model, cfg.optimizer)
    bridge = None
    if disjoint:  # each rank holds one module; the bridge carries the image embeddings between them
        bridge = DisjointBridge(model.config, layouts, cfg.micro_batch_size, getattr(torch, cfg.precision.param_dtype),
                                device, rank, dist.get_world_size())
        bridge.stand_in = None if bridge.is_vision else model.vision_tower()
    train_step = build_step(model, optimizer, partial_params, mesh["tp"].get_group() if dims.tp > 1 else None,
                            cfg.loss_chunk_tokens, cfg.max_grad_norm, compiled_loss=cfg.parallel.compile,
                            bridge=bridge)
    # Per-module times need both modules on the rank (not so under disjoint layouts).
    timer = ModuleTimer(model, device) if cfg.metrics.module_times and not disjoint else None
    if not disjoint:
        data = build_data(cfg, model.config, dp_rank(dims), dims.dp)
    else:
        dims, language = layouts["language"]  # from here the data's (and the checkpoint's) layout
        if bridge.is_vision:
            data = SourceBatches([build_data(cfg, model.config, j, dims.dp) for j in bridge.source_ranks()])
        else:
            data = build_data(cfg, model.config, rank - language.start, dims.dp)
    # Written only now: a setting that does not fit the model (trainable, tp) leaves nothing behind.
    prepare_output_dir(cfg, out)
    checkpointer, state = start_state(cfg, out, dims, model, optimizer, data)
    if signum := agreed_signal(stop):  # during start-up: no step since the checkpoint, nothing to save
        if rank == 0:
            print(f"signal {signum} before the first step at step {state['step']}: nothing to save, exiting to be resumed")
        return 128 + signum
    logger = MetricsLogger(out, rank == 0, cfg.metrics.tensorboard, cfg.metrics.wandb, to_dict(cfg), state["step"])
    peak = peak_tflops(device, cfg.metrics.peak_tflops)
    batches, nonfinite_in_a_row = iter(data), 0

    def save_checkpoint():
        if checkpointer is not None:
            checkpointer.save(state["step"], model, optimizer, dict(state),
                              {"rng": rng_state(), "loader": data.state_dict()})

    while state["step"] < cfg.steps:
        t0 = time.perf_counter()
        host_micro = [next(batches) for _ in range(cfg.grad_accum_steps)]
        data_wait = time.perf_counter() - t0
        own = [] if bridge is not None and bridge.is_vision else host_micro  # encoder ranks count nothing
        counts = global_counts(own, model.config, dims.tp, state["step"])
        done = state["step"] + 1 if cfg.schedule.unit == "steps" else state["samples"] + int(counts["samples"])
        factor = lr_factor(cfg.schedule, done, schedule_total(cfg))
        if bridge is not None:  # an encoder rank gets the image batches of its rows
            host_micro = bridge.plan_step(host_micro)
        result = train_step([b if b is None else b.to(device) for b in host_micro], counts["label_tokens"],
                            lambda opt: set_lr(opt, factor))
        nonfinite_in_a_row = 0 if result.applied else nonfinite_in_a_row + 1
        state["skipped_steps"] += not result.applied
        state["step"] += 1
        state["samples"] += int(counts["samples"])
        state["tokens"] += int(counts["tokens"])
        # Host time of the step: the step's one host read (norm and loss) waits for its backward,
        # so from step to step this follows the GPU without a synchronize of its own.
        step_time = time.perf_counter() - t0
        record = step_record(cfg, state, result, counts, factor, step_time, data_wait, peak, device, dims.tp)
        logger.log(record | (timer.read() if timer else {}))

        if nonfinite_in_a_row >= cfg.max_nonfinite_steps:
            save_checkpoint()
            _finish(checkpointer, logger)
            raise TrainingError(f"step {state['step']}: {nonfinite_in_a_row} steps in a row with a non-finite "
                                f"loss or gradient norm; checkpoint saved, stopping (max_nonfinite_steps)")
        signum = agreed_signal(stop)
        if signum:
            save_checkpoint()
            _finish(checkpointer, logger)
            if rank == 0:
                print(f"signal {signum}: checkpoint saved at step {state['step']}, exiting to be resumed")
            return 128 + signum
        if (cfg.checkpoint.interval and state["step"] % cfg.checkpoint.interval == 0) or state["step"] == cfg.steps:
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
