"""`vlmcore train CONFIG [--set key=value ...]`: one training stage, under torchrun or as one process.

Start-up (`Trainer.__init__`, after the process group): the stage checked against the world size
and the model (vlmcore.parallel.checks); the kernels; the run built (vlmcore.train.build: model on
meta, frozen, parallelized, materialized and loaded, optimizer, step) and its data; resume from the
latest checkpoint. Then the steps (`Trainer.train`) and one way out (`Trainer.finish`).

The loss of a step is the objective's loss summed over all micro-batches and data-parallel ranks
divided by its global count (`Objective.count`, counted before the forward passes: label tokens
for SFT, pairs for DPO), and FSDP reduces gradients by SUM: any split of the same global batch
gives the same gradients.
"""

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from vlmcore.config import ConfigError, TrainConfig, load_config, to_dict, warnings_of
from vlmcore.models import load_hf_config
from vlmcore.parallel import float8
from vlmcore.parallel.checks import check_run
from vlmcore.parallel.mesh import device_for_rank, init_distributed
from vlmcore.rewards.stage import open_rewards
from vlmcore.train.build import build_run, check_kernels
from vlmcore.train.checkpoint import CheckpointError, resume_latest, rng_state, save_final
from vlmcore.train.metrics_log import Hardware, MetricsLogger, StepTimes, global_counts, peak_tflops, step_record
from vlmcore.train.module_timer import ModuleTimer
from vlmcore.train.optim import lr_factor, schedule_total, set_lr
from vlmcore.train.profiling import StepProfiler
from vlmcore.train.resilience import FaultInjection, FlightRecorder, StragglerWatch, announce_restart
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


def run(args: argparse.Namespace) -> int:
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

    def __init__(self) -> None:
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
    recorder = FlightRecorder(cfg.resilience, out)
    recorder.configure()
    init_distributed(device, timeout=timedelta(seconds=cfg.resilience.collective_timeout_s))
    announce_restart(cfg.resilience)
    recorder.start()
    try:
        status = _train(cfg, out, device, stop)
        # Every rank waits for the others before the group goes: a rank that destroyed its group
        # and exited while a peer was still in its last collective could abort in gloo's teardown
        # ("terminate called without an active exception"), and torchrun then fails the job. On
        # the success path only: a rank that raised must not wait for peers that never arrive.
        dist.barrier()
        return status
    except RuntimeError as e:
        if not isinstance(e, (TrainingError, CheckpointError)):  # a failed or timed-out collective
            recorder.failed(e)
        raise
    finally:
        recorder.close()
        dist.destroy_process_group()


def agreed_signal(stop: _StopSignal) -> int:
    """The stop signal any rank received (0: none), the same on every rank."""
    flag = torch.tensor([stop.signum])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _train(cfg: TrainConfig, out: Path, device: torch.device, stop: _StopSignal) -> int:
    trainer = Trainer(cfg, out, device, stop)
    ending = trainer.train()
    return trainer.finish(ending)


@dataclass
class Ending:
    """Why the steps stopped: the last step reached (every field unset), a stop signal, or too many
    non-finite steps in a row. `before_first_step`: a signal during start-up, with no step since
    the checkpoint and so nothing to save."""

    signum: int = 0
    nonfinite_steps: int = 0
    before_first_step: bool = False

    @property
    def saves_checkpoint(self) -> bool:
        """A stop before the last step keeps the steps since the last checkpoint."""
        stopped_early = self.signum > 0 or self.nonfinite_steps > 0
        return stopped_early and not self.before_first_step


def _set_seed(cfg: TrainConfig) -> None:
    """The run's seed, and under `deterministic` torch's deterministic kernels."""
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed)


class Trainer:
    """One training stage on this rank: the start-up (`__init__`), the steps (`train`), and one way
    out (`finish`): the final model and `done`, or a checkpoint and an exit to be resumed."""

    def __init__(self, cfg: TrainConfig, out: Path, device: torch.device, stop: _StopSignal) -> None:
        self.cfg = cfg
        self.out = out
        self.device = device
        self.stop = stop
        self.rank = dist.get_rank()
        self.layout = check_run(cfg, dist.get_world_size(), load_hf_config(cfg.model_path))
        _set_seed(cfg)
        backends = check_kernels(cfg, device)  # before anything is written
        float8.check_device(cfg, device)
        if self.rank == 0:
            print("kernels: " + ", ".join(f"{part} {backend}" for part, backend in backends.items()))
        # A GRPO stage's rewards, checked by key and their workers started before the model is built.
        self.rewards = open_rewards(cfg)
        self.run = build_run(cfg, self.layout, device)
        self.run.model.train()
        # Per-module times need both modules on the rank (not so under disjoint layouts).
        self.timer = (
            ModuleTimer(self.run.model, device) if cfg.metrics.module_times and self.run.role == "both" else None
        )
        self.data = self.run.data(scorer=self.rewards)
        # Written only now: a setting that does not fit the model (trainable, tp) leaves nothing behind.
        prepare_output_dir(cfg, out)
        split = self.layout.batch_split(cfg.micro_batch_size)
        self.checkpointer, self.state = resume_latest(cfg, out, split, self.run.model, self.run.optimizer, self.data)
        # A blend's datasets, whose rows each step counts (one dataset, or random data: none); a
        # resumed run counts those before it from the row order, exactly the rows the steps saw.
        names = getattr(self.data, "dataset_names", [])
        self.blend_datasets = names if len(names) > 1 else []
        if self.blend_datasets:
            self.state.dataset_rows = self.data.rows_by_dataset(self.state.data_rows)
        self.logger = None  # opened with the first step: a signal during start-up leaves the metrics as they are
        self.nonfinite_in_a_row = 0
        self.faults = FaultInjection(self.rank, lambda: self.stop.signum != 0)  # tests only

    def train(self) -> Ending:
        """Steps until the last one, or until a reason to stop."""
        if signum := agreed_signal(self.stop):
            return Ending(signum=signum, before_first_step=True)
        self._start_steps()
        while self.state.step < self.cfg.steps:
            self.train_step()
            ending = self._reason_to_stop()
            if ending is not None:
                return ending
            if self._checkpoint_due():
                self.save_checkpoint()
        return Ending()

    def _start_steps(self) -> None:
        """The metrics' sinks, the rates' hardware, the data stream and the profiler."""
        cfg = self.cfg
        metrics = cfg.metrics
        self.logger = MetricsLogger(
            self.out, self.rank == 0, metrics.tensorboard, metrics.wandb, to_dict(cfg), self.state.step
        )
        self.hardware = Hardware(self.device, peak_tflops(self.device, metrics.peak_tflops))
        self.batches = iter(self.data)
        self.profiler = StepProfiler(metrics.profile_steps, self.out / "profile", self.rank, self.device)
        self.stragglers = StragglerWatch(cfg.resilience)

    def train_step(self) -> None:
        """One optimizer step over the next global batch, counted and logged."""
        run = self.run
        state = self.state
        self.profiler.step_starts(state.step + 1)
        start = time.perf_counter()
        self.faults.before_step(state.step + 1)
        host_micro = [next(self.batches) for _ in range(self.layout.grad_accum_steps)]
        data_wait = time.perf_counter() - start
        counts_start = time.perf_counter()
        counts = self._global_counts(host_micro)
        peers_wait = time.perf_counter() - counts_start  # mostly the wait for the last rank to arrive
        factor = self._lr_factor(counts)
        if run.bridge is not None:  # an encoder rank gets the image batches of its rows
            host_micro = run.bridge.plan_step(host_micro)
        result = run.step(
            [to_device(b, self.device, run.context) for b in host_micro],
            counts[run.step.objective.count],
            lambda optimizer: set_lr(optimizer, factor),
        )
        self.nonfinite_in_a_row = 0 if result.applied else self.nonfinite_in_a_row + 1
        state.count_step(result.applied, int(counts["samples"]), int(counts["tokens"]), counts.get("dataset_rows"))
        # Host time of the step: the step's one host read (norm and loss) waits for its backward,
        # so from step to step this follows the GPU without a synchronize of its own.
        times = StepTimes(step=time.perf_counter() - start, data_wait=data_wait)
        lr = self.cfg.optimizer.lr * factor
        record = step_record(state, result, counts, lr, times, self.hardware, run.step.objective)
        record |= self.stragglers.after_step(state.step, times.step, peers_wait)
        if hasattr(self.data, "metrics"):  # a data stream's own figures: a GRPO rollout's rewards and lengths
            record |= self.data.metrics()
        self.logger.log(record | (self.timer.read() if self.timer else {}) | self._checkpoint_metrics())
        self.profiler.step_ended(state.step)

    def _checkpoint_metrics(self) -> dict:
        """`checkpoint_in_background` on a step that ran while a save was written, and each save's
        blocking and background times on the first step after it was published."""
        if self.checkpointer is None:
            return {}
        running = {"checkpoint_in_background": True} if self.checkpointer.save_running() else {}
        return running | self.checkpointer.take_timings()

    def _global_counts(self, host_micro: list) -> dict:
        """The global batch's counts (`global_counts`); a batch without label tokens, or without what
        the objective's loss is divided by (DPO: preference pairs), is refused."""
        dims = self.layout.data.dims
        # cp and tp peers hold the same rows; encoder ranks count nothing
        own = [] if self.run.role == "vision" else host_micro
        counts = global_counts(own, self.run.model.config, dims.tp * dims.cp, self.blend_datasets)
        for count in dict.fromkeys(("label_tokens", self.run.step.objective.count)):
            if counts[count] == 0:
                raise TrainingError(
                    f"step {self.state.step + 1}: objective {self.cfg.objective} but the global batch has no "
                    f"{count.replace('_', ' ')} (data_path {self.cfg.data_path})"
                )
        return counts

    def _lr_factor(self, counts: dict) -> float:
        """The learning-rate multiplier of the step about to run: the schedule at the progress it
        brings, in steps or in samples."""
        schedule = self.cfg.schedule
        if schedule.unit == "steps":
            done = self.state.step + 1
        else:
            done = self.state.samples + int(counts["samples"])
        return lr_factor(schedule, done, schedule_total(self.cfg))

    def _reason_to_stop(self) -> Ending | None:
        if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
            return Ending(nonfinite_steps=self.nonfinite_in_a_row)
        if signum := agreed_signal(self.stop):
            return Ending(signum=signum)
        return None

    def _checkpoint_due(self) -> bool:
        """At each checkpoint interval (if set) and at the last step."""
        interval = self.cfg.checkpoint.interval
        at_interval = interval > 0 and self.state.step % interval == 0
        return at_interval or self.state.step == self.cfg.steps

    def save_checkpoint(self) -> None:
        if self.checkpointer is None:
            return
        rank_state = {"rng": rng_state(), "loader": self.data.state_dict()}
        self.checkpointer.save(self.state.step, self.run.model, self.run.optimizer, self.state.state_dict(), rank_state)

    def finish(self, ending: Ending) -> int:
        """The one way out of the steps: a stop saves them and exits to be resumed (or, after too
        many non-finite steps, fails); the last step writes final/ and `done`. Returns the exit code."""
        if ending.saves_checkpoint:
            self.save_checkpoint()
        self._close()
        step = self.state.step
        if ending.nonfinite_steps:
            raise TrainingError(
                f"step {step}: {ending.nonfinite_steps} steps in a row with a non-finite "
                f"loss or gradient norm; checkpoint saved, stopping (max_nonfinite_steps)"
            )
        if ending.signum:
            if ending.before_first_step:
                self._say(
                    f"signal {ending.signum} before the first step at step {step}: nothing to save, exiting to be resumed"
                )
            else:
                self._say(f"signal {ending.signum}: checkpoint saved at step {step}, exiting to be resumed")
            return 128 + ending.signum
        self._save_final()
        if self.rank == 0:
            mark_done(self.out)
        return 0

    def _close(self) -> None:
        """Waits for a checkpoint still being written and closes the metrics' sinks."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.logger is not None:
            self.logger.close()
        if self.rewards is not None:
            self.rewards.close()

    def _save_final(self) -> None:
        if not self.cfg.save_final:
            return
        meta = {
            "model_path": self.cfg.model_path,
            "step": self.state.step,
            "tokens": self.state.tokens,
            "samples": self.state.samples,
            "stage_config": to_dict(self.cfg),
        }
        save_final(self.out, self.run.model, meta)

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(message)
