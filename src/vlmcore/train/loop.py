"""`vlmcore train CONFIG [--set key=value ...]`: one training stage, under torchrun or as one process.

Start-up: the process group; the stage checked against the world size and the model
(vlmcore.parallel.checks); the kernels; the run built (vlmcore.train.build: model on meta,
frozen, parallelized, materialized and loaded, optimizer, step) and its data; resume from the
latest checkpoint. Then the loop below.

The loss of a step is the sum of token losses over all micro-batches and data-parallel ranks
divided by the global number of label tokens (counted before the forward passes), and FSDP
reduces gradients by SUM: any split of the same global batch gives the same gradients.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vlmcore.config import ConfigError, TrainConfig, load_config, to_dict, warnings_of
from vlmcore.models import load_hf_config
from vlmcore.parallel.checks import check_run
from vlmcore.parallel.mesh import device_for_rank, init_distributed
from vlmcore.train.build import build_run, check_kernels
from vlmcore.train.checkpoint import CheckpointError, global_batch_rows, resume_latest, rng_state, save_final
from vlmcore.train.metrics_log import MetricsLogger, global_counts, peak_tflops, step_record
from vlmcore.train.module_timer import ModuleTimer
from vlmcore.train.optim import lr_factor, schedule_total, set_lr
from vlmcore.train.profiling import StepProfiler
from vlmcore.train.run_dir import mark_done, prepare_output_dir
from vlmcore.train.step import to_device


class TrainingError(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vlmcore.cli import existing_file

    parser.add_argument("config", type=existing_file, help="YAML run config (see vlmcore.config.TrainConfig)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, dotted keys for sections (repeatable)",
    )


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
            signal.signal(s, lambda signum, frame: setattr(self, "signum", signum))


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


def agreed_signal(stop: _StopSignal) -> int:
    """The stop signal any rank received (0: none), the same on every rank."""
    flag = torch.tensor([stop.signum])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _train(cfg: TrainConfig, out: Path, device: torch.device, stop: _StopSignal) -> int:
    rank = dist.get_rank()
    layout = check_run(cfg, dist.get_world_size(), load_hf_config(cfg.model_path))
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed)
    backends = check_kernels(cfg, device)  # before anything is written
    if rank == 0:
        print("kernels: " + ", ".join(f"{part} {backend}" for part, backend in backends.items()))
    run = build_run(cfg, layout, device)
    model, optimizer, train_step, encoder = run.model, run.optimizer, run.step, run.role == "vision"
    model.train()
    # Per-module times need both modules on the rank (not so under disjoint layouts).
    timer = ModuleTimer(model, device) if cfg.metrics.module_times and run.role == "both" else None
    data = run.data()
    # Written only now: a setting that does not fit the model (trainable, tp) leaves nothing behind.
    prepare_output_dir(cfg, out)
    dims = layout.data.dims  # the data's split of the global batch (the language model's)
    split = {
        "world_size": dist.get_world_size(),
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "tp": dims.tp,
        "grad_accum_steps": layout.grad_accum_steps,
        "micro_batch_size": cfg.micro_batch_size,
    }
    checkpointer, state = resume_latest(cfg, out, split, model, optimizer, data)
    if signum := agreed_signal(stop):  # during start-up: no step since the checkpoint, nothing to save
        if rank == 0:
            print(
                f"signal {signum} before the first step at step {state['step']}: nothing to save, exiting to be resumed"
            )
        return 128 + signum
    logger = MetricsLogger(out, rank == 0, cfg.metrics.tensorboard, cfg.metrics.wandb, to_dict(cfg), state["step"])
    peak = peak_tflops(device, cfg.metrics.peak_tflops)
    batches, nonfinite_in_a_row = iter(data), 0
    profiler = StepProfiler(cfg.metrics.profile_steps, out / "profile", rank, device)

    def save_checkpoint():
        if checkpointer is not None:
            checkpointer.save(
                state["step"], model, optimizer, dict(state), {"rng": rng_state(), "loader": data.state_dict()}
            )

    while state["step"] < cfg.steps:
        profiler.step_starts(state["step"] + 1)
        t0 = time.perf_counter()
        host_micro = [next(batches) for _ in range(layout.grad_accum_steps)]
        data_wait = time.perf_counter() - t0
        # cp and tp peers hold the same rows; encoder ranks count nothing
        counts = global_counts([] if encoder else host_micro, model.config, dims.tp * dims.cp)
        if counts["label_tokens"] == 0:
            raise TrainingError(f"step {state['step'] + 1}: the global batch has no label tokens")
        done = state["step"] + 1 if cfg.schedule.unit == "steps" else state["samples"] + int(counts["samples"])
        factor = lr_factor(cfg.schedule, done, schedule_total(cfg))
        if run.bridge is not None:  # an encoder rank gets the image batches of its rows
            host_micro = run.bridge.plan_step(host_micro)
        result = train_step(
            [to_device(b, device, run.context) for b in host_micro],
            counts["label_tokens"],
            lambda opt: set_lr(opt, factor),
        )
        nonfinite_in_a_row = 0 if result.applied else nonfinite_in_a_row + 1
        state["skipped_steps"] += not result.applied
        state["step"] += 1
        state["data_rows"] += global_batch_rows(split)
        state["samples"] += int(counts["samples"])
        state["tokens"] += int(counts["tokens"])
        # Host time of the step: the step's one host read (norm and loss) waits for its backward,
        # so from step to step this follows the GPU without a synchronize of its own.
        step_time = time.perf_counter() - t0
        record = step_record(
            state, result, counts, cfg.optimizer.lr * factor, step_time, data_wait, peak, device, dims.tp
        )
        logger.log(record | (timer.read() if timer else {}))
        profiler.step_ended(state["step"])

        if nonfinite_in_a_row >= cfg.max_nonfinite_steps:
            save_checkpoint()
            _finish(checkpointer, logger)
            raise TrainingError(
                f"step {state['step']}: {nonfinite_in_a_row} steps in a row with a non-finite "
                f"loss or gradient norm; checkpoint saved, stopping (max_nonfinite_steps)"
            )
        if signum := agreed_signal(stop):
            save_checkpoint()
            _finish(checkpointer, logger)
            if rank == 0:
                print(f"signal {signum}: checkpoint saved at step {state['step']}, exiting to be resumed")
            return 128 + signum
        if (cfg.checkpoint.interval and state["step"] % cfg.checkpoint.interval == 0) or state["step"] == cfg.steps:
            save_checkpoint()

    _finish(checkpointer, logger)
    if cfg.save_final:
        save_final(
            out,
            model,
            {
                "model_path": cfg.model_path,
                "step": state["step"],
                "tokens": state["tokens"],
                "samples": state["samples"],
                "stage_config": to_dict(cfg),
            },
        )
    if rank == 0:
        mark_done(out)
    return 0


def _finish(checkpointer, logger) -> None:
    if checkpointer is not None:
        checkpointer.wait()
    logger.close()
