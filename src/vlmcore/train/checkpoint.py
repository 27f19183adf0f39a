"""Atomic, resumable torch.distributed.checkpoint (DCP) checkpoints.

Layout under `output_dir`:
  checkpoints/step_<N>/   model, optimizer, train state, loader states, RNG (DCP)
  checkpoints/latest      text `step_<N>`, written last (after the rename)
  final/                  model weights only, keys `model.<hf name>`, + meta.json
  done                    empty marker, written after final/

A step is written to `step_<N>.tmp` and renamed when every rank has finished, so a run killed
mid-save leaves only a `.tmp` directory that is never loaded (and is removed at the next start).
DCP stores full logical tensors, so a checkpoint reshards on load: another world size or another
dp/tp layout reads it (the per-rank state only under the same split: `resume`).

Before the rename, `manifest.json` records the size and sha256 of every file (each rank hashes
the files it wrote, most often still in its page cache). A checkpoint damaged after it was
written (a file cut short by a full disk, a bad copy, flipped bytes) is found before loading and
skipped for the one before it (`keep` > 1). Sizes are checked for every checkpoint; the hashes
only of the one about to be loaded, with its files shared out among the ranks.
"""

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from vlmcore.config import TrainConfig
from vlmcore.hashing import sha256_of
from vlmcore.models.lora import adapter_state_dict, has_adapters, is_adapter, merged_state_dict
from vlmcore.parallel.layout import BatchSplit
from vlmcore.train.state import TrainState, split_from_state_dict, split_state_dict

MANIFEST = "manifest.json"


def _is_rank0() -> bool:
    return dist.get_rank() == 0


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_problem(path: Path, hash_part: tuple[int, int] | None = None) -> str | None:
    """Why the DCP checkpoint at `path` cannot be loaded, or None: each file must hold the bytes
    `.metadata` and `manifest.json` say it does (cheap: no tensor is read). `hash_part` (i, n):
    also compare the sha256 of the manifest's files i, i + n, ... (n ranks share the full read).
    A checkpoint without a manifest is checked against `.metadata` only."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a missing or cut .metadata fails in the unpickler, in many ways
        return f".metadata cannot be read ({type(e).__name__}: {e})"
    needed = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size < size:
            return f"{name} is truncated ({file.stat().st_size} of {size} bytes)"
    manifest = json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).is_file() else {}
    for name, (size, _) in sorted(manifest.items()):
        if not (path / name).is_file():
            return f"{name} is missing"
        if (path / name).stat().st_size != size:
            return f"{name} has {(path / name).stat().st_size} bytes, {MANIFEST} records {size}"
    if hash_part is not None:
        part, parts = hash_part
        for name, (_, digest) in sorted(manifest.items())[part::parts]:
            if sha256_of(path / name) != digest:
                return f"{name} does not match its sha256 in {MANIFEST}: its bytes changed after the save"
    return None


def file_digests(path: Path) -> dict[str, list]:
    """{name: [size, sha256]} of the files this rank wrote into the DCP directory `path`:
    DCP's file writer names them `__<rank>_<n>.distcp`; rank 0 also takes every other file."""

    def writer(file: Path) -> int:
        return int(file.name.split("_")[2]) if file.name.startswith("__") else 0

    return {
        file.name: [file.stat().st_size, sha256_of(file)]
        for file in sorted(path.iterdir())
        if file.is_file() and writer(file) == dist.get_rank()
    }


class CheckpointError(RuntimeError):
    pass


def save_failure(tmp: Path, error: Exception) -> str:
    """The message of a failed save: torch's writer often loses the errno of a full disk
    ("unexpected pos ..."), so the free space is compared with the size of a checkpoint."""
    free = shutil.disk_usage(tmp.parent).free
    size = max(
        (sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in tmp.parent.glob("step_*")), default=0
    )
    room = f"{free / 2**20:.1f} MiB free, a checkpoint takes {size / 2**20:.1f} MiB"
    cause = (str(error).strip().splitlines() or [""])[-1]
    return (
        f"checkpoint {tmp} could not be written: {'the disk is full, ' if free < size else ''}{room}; the "
        f"checkpoints before it are intact and a rerun resumes from the latest ({type(error).__name__}: {cause})"
    )


@dataclasses.dataclass
class PendingSave:
    """An async save in flight: `background` finishes DCP's write and hashes this rank's files."""

    step: int
    tmp: Path
    final: Path
    blocking_s: float  # how long `save` held training up
    background: Future  # -> (digests, seconds from `save`'s return to the files hashed)


class Checkpointer:
    """Saves and loads the run's checkpoints. With `async_save` a save blocks training only while
    it waits for the save before it and copies the state into host memory (the stager: pinned where
    there is a GPU, shared with the writer process, reused from save to save); DCP writes the copy
    in the background, in a process of its own per rank (`async_mode` process, DCP's process-based
    checkpointer: no GIL shared with the training loop) or a thread (`thread`), and each rank hashes
    the files it wrote there too. The next save (or the end of the run) publishes it: manifest,
    rename, `latest`."""

    def __init__(
        self, output_dir: str | Path, keep: int, async_save: bool = False, async_mode: str = "process"
    ) -> None:
        self.dir = Path(output_dir) / "checkpoints"
        self.keep = keep
        self.async_save = async_save
        self.async_mode = async_mode
        self._pending: PendingSave | None = None
        self._async_group = dist.new_group(backend="gloo") if async_save else None
        self._stager = None
        self._hasher = None
        if async_save:
            cuda = torch.cuda.is_available()
            options = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=async_mode == "process",
                use_async_staging=False,  # the copy is made before `save` returns: training may change the weights
                use_non_blocking_copy=False,
            )
            self._stager = DefaultStager(options)
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash")
        self.timings: list[dict] = []  # each published save's, for the metrics (`take_timings`)
        if _is_rank0():
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob("step_*.tmp"):
                shutil.rmtree(stale)
        dist.barrier()

    def latest(self) -> Path | None:
        """The last complete, intact checkpoint, or None; damaged ones are reported and skipped.

        Renamed step_N directories are complete (`latest` is written after the rename, so a
        crash in between leaves a complete step_N that it does not name yet)."""
        renamed = [p for p in self.dir.glob("step_*") if p.suffix != ".tmp"]
        for path in sorted(renamed, key=_step_of, reverse=True):
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, checkpoint_problem(path, (dist.get_rank(), dist.get_world_size())))
            problem = next((p for p in problems if p), None)
            if problem is None:
                return path
            if _is_rank0():
                print(f"{path} is damaged, not resumed from: {problem}", flush=True)
        return None

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict, rank_state: dict
    ) -> None:
        """train_state: replicated values (step, samples, tokens, ...); rank_state: this rank's
        own values, stored under `rank<r>` keys (loader position, RNG)."""
        start = time.perf_counter()
        self.wait()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(model))
        model_sd = checkpointed_model_state(model, model_sd)
        state = {
            "model": model_sd,
            "optim": optim_sd,
            "train": train_state,
            "ranks": {f"rank{dist.get_rank()}": rank_state},
        }
        final, tmp = self.dir / f"step_{step}", self.dir / f"step_{step}.tmp"
        if not self.async_save:
            self._complete(lambda: dcp.save(state, checkpoint_id=str(tmp)), tmp, final)
            self._record(step, time.perf_counter() - start, 0.0)
            return
        kind = AsyncCheckpointerType.PROCESS if self.async_mode == "process" else AsyncCheckpointerType.THREAD
        try:
            written = dcp.async_save(
                state,
                checkpoint_id=str(tmp),
                process_group=self._async_group,
                async_checkpointer_type=kind,
                async_stager=self._stager,
            )
        except (Exception, CheckpointException) as e:
            raise CheckpointError(save_failure(tmp, e)) from e
        returned = time.perf_counter()

        def finish_in_background() -> tuple[dict, float]:
            written.result()
            return file_digests(tmp), time.perf_counter() - returned

        background = self._hasher.submit(finish_in_background)
        self._pending = PendingSave(step, tmp, final, returned - start, background)

    def save_running(self) -> bool:
        """Whether an async save is still being written."""
        return self._pending is not None and not self._pending.background.done()

    def wait(self) -> None:
        """Finishes an async save in flight (manifest, rename, latest)."""
        if self._pending is None:
            return
        pending = self._pending
        self._pending = None
        background_s = 0.0

        def write() -> dict:
            nonlocal background_s
            digests, background_s = pending.background.result()
            return digests

        self._complete(write, pending.tmp, pending.final)
        self._record(pending.step, pending.blocking_s, background_s)

    def close(self) -> None:
        """Publishes a save in flight and frees the stager's host copy."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._hasher.shutdown()

    def _record(self, step: int, blocking_s: float, background_s: float) -> None:
        timing = {"step": step, "blocking_s": round(blocking_s, 4), "background_s": round(background_s, 4)}
        self.timings.append(timing)
        if _is_rank0():
            print(
                f"checkpoint step_{step}: training blocked {blocking_s:.2f} s"
                + (f", written in the background in {background_s:.2f} s" if self.async_save else ""),
                flush=True,
            )

    def take_timings(self) -> dict:
        """The metrics of the saves published since the last call (the latest, if several):
        `checkpoint_step`, `checkpoint_blocking_s` (training held up), `checkpoint_background_s`
        (written while training went on); {} if none."""
        if not self.timings:
            return {}
        timing = self.timings[-1]
        self.timings.clear()
        return {
            "checkpoint_step": timing["step"],
            "checkpoint_blocking_s": timing["blocking_s"],
            "checkpoint_background_s": timing["background_s"],
        }

    def _complete(self, write: Callable[[], object], tmp: Path, final: Path) -> None:
        """`write` (the DCP save; async: its result, this rank's digests), then the publish; a
        failure says where and how much room is left."""
        try:
            digests = write()
            self._publish(tmp, final, digests if isinstance(digests, dict) else None)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(save_failure(tmp, e)) from e

    def _publish(self, tmp: Path, final: Path, own_digests: dict | None = None) -> None:
        digests = [None] * dist.get_world_size()
        own = own_digests if own_digests is not None else file_digests(tmp)
        dist.all_gather_object(digests, own)  # also waits for every rank's save
        if _is_rank0():
            manifest = {name: entry for part in digests for name, entry in part.items()}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            marker_tmp = self.dir / "latest.tmp"
            marker_tmp.write_text(final.name)
            os.replace(marker_tmp, self.dir / "latest")
            steps = sorted((p for p in self.dir.glob("step_*") if p.suffix != ".tmp"), key=_step_of)
            for old in steps[: -self.keep]:
                shutil.rmtree(old)
        dist.barrier()

    def load(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict, rank_state: dict | None
    ) -> None:
        """Loads model and optimizer, and fills the `train_state` template (and `rank_state`,
        this rank's template, unless None: the layout changed) in place."""
        options = state_dict_options(model)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        model_sd = checkpointed_model_state(model, model_sd)
        state = {"model": model_sd, "optim": optim_sd, "train": train_state}
        if rank_state is not None:
            state["ranks"] = {f"rank{dist.get_rank()}": rank_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )
        train_state.update(state["train"])
        if rank_state is not None:
            rank_state.update(state["ranks"][f"rank{dist.get_rank()}"])


def state_dict_options(model: nn.Module) -> StateDictOptions:
    """What a checkpoint of `model` holds: with LoRA adapters only the adapters (and their optimizer
    state): the frozen base comes again from the stage's init on resume, so loading leaves it as is
    (not strict; DCP fails on an adapter the checkpoint lacks); else every parameter."""
    adapters = has_adapters(model)
    return StateDictOptions(ignore_frozen_params=adapters, strict=not adapters)


def checkpointed_model_state(model: nn.Module, model_sd: dict) -> dict:
    """The model part of a checkpoint: with LoRA adapters, the adapters alone. `ignore_frozen_params`
    drops frozen parameters by the names `named_parameters()` gives, which hold a tied weight once
    (the embedding's), so a tied LM head would still be written under its own name: a whole frozen
    base matrix in every LoRA checkpoint (1.2 GB in fp32 on the 2B)."""
    if not has_adapters(model):
        return model_sd
    return adapter_state_dict(model_sd)


def final_state(model: nn.Module) -> dict:
    """What final/ holds: `model`, the weights; with LoRA the adapted model's (adapters merged into
    the base weights, so the next stage and the export read a plain model) and, under `adapters`,
    the adapters themselves (the export's peft adapter directory)."""
    state = get_model_state_dict(model)
    if not has_adapters(model):
        return {"model": state}
    return {"model": merged_state_dict(model, state), "adapters": adapter_state_dict(state)}


def save_final(output_dir: str | Path, model: nn.Module, meta: dict) -> None:
    """final/ = the model weights (full logical tensors, keys `model.<name>`; see `final_state`) +
    meta.json, readable with DCP in one process without a process group."""
    output_dir = Path(output_dir)
    final, tmp = output_dir / "final", output_dir / "final.tmp"
    if _is_rank0() and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(final_state(model), checkpoint_id=str(tmp))
    dist.barrier()
    if _is_rank0():
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()


def load_model_weights(model: nn.Module, init_from: str | Path) -> None:
    """Loads a final/ directory (or any DCP checkpoint with `model.*` keys) into the (sharded)
    model: every rank reads only its shards. LoRA adapters are not read: a stage's adapters start fresh
    on the previous stage's (merged) weights."""
    weights = {n: t for n, t in get_model_state_dict(model).items() if not is_adapter(n)}
    state = {"model": weights}
    dcp.load(state, checkpoint_id=str(init_from))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not has_adapters(model)))


class ResumableData(Protocol):
    """A rank's data stream (its micro-batches) as a checkpoint resumes it: its own state under the
    split that wrote it, else a seek to the global rows consumed and the steps taken (a row
    stream's position is its rows; an RL stage's rollouts, the steps)."""

    def __iter__(self) -> Iterator: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def seek(self, rows: int, steps: int) -> None: ...


def resume_latest(
    cfg: TrainConfig,
    out: Path,
    split: BatchSplit,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: ResumableData,
) -> tuple[Checkpointer | None, TrainState]:
    """The checkpointer (None when disabled) and the run's state, resumed from the latest intact
    checkpoint if there is one. `split`: how this run splits the global batch over ranks and
    micro-batches."""
    state = TrainState(split)
    checkpoint = cfg.checkpoint
    checkpointer = (
        Checkpointer(out, checkpoint.keep, checkpoint.async_save, checkpoint.async_mode) if checkpoint.enabled else None
    )
    latest = checkpointer.latest() if checkpointer else None
    if latest is not None:
        resume(checkpointer, latest, model, optimizer, data, state, cfg.allow_global_batch_change)
    if state.step == cfg.steps and _is_rank0():
        print(f"step {cfg.steps} was reached before final/ and done were written: writing them, no training")
    return checkpointer, state


def written_split(path: Path) -> tuple[BatchSplit, bool]:
    """The split the checkpoint at `path` was written with, and whether it records the rows consumed
    (`data_rows`; a checkpoint without them had its split's rows at every step)."""
    unknown = BatchSplit(world_size=0, dp_replicate=0, dp_shard=0, tp=0, grad_accum_steps=0, micro_batch_size=0)
    written = split_state_dict(unknown) | {"data_rows": -1}  # what the checkpoint lacks keeps these values
    dcp.load({"train": written}, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    return split_from_state_dict(written), written["data_rows"] >= 0


def resume(
    checkpointer: Checkpointer,
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: ResumableData,
    state: TrainState,
    allow_global_batch_change: bool = False,
) -> None:
    """Loads model, optimizer and `state` in place, and puts the data where the checkpoint's run
    left it. The data position is global (the rows consumed, `vlmcore.data.load.order`): under another
    split with the same rows per step the stream goes on exactly. The RNG state is per rank and
    comes back only under the split that wrote it, and the data loader's own state with it."""
    split = state.split
    written, counts_rows = written_split(path)
    same_split = written == split
    # A stream whose position is its steps (an RL stage: a step is `prompts_per_step` prompts at
    # any split) goes on at another batch size as it would at the same.
    rows_matter = not getattr(data, "position_is_steps", False)
    new_batch = written.global_batch_rows != split.global_batch_rows
    if not same_split and new_batch and rows_matter and not allow_global_batch_change:
        raise CheckpointError(
            f"{path}: written with {written.global_batch_rows} rows per step ({_split_text(written)}), "
            f"this run takes {split.global_batch_rows} ({_split_text(split)}); keep micro_batch_size x "
            "grad_accum_steps x data-parallel ranks, or set allow_global_batch_change: true to go on from "
            "the rows consumed with the new batch size"
        )
    rank_state = {"rng": rng_state(), "loader": data.state_dict()} if same_split else None
    # The config wins over the checkpoint's group settings (name, lr, weight decay, betas, eps, the
    # fused or foreach kernel): a checkpoint keeps them by group index, and under disjoint layouts
    # the encoder and language ranks' groups share indices, so a rank may read another's settings
    # or none (torch then falls back to AdamW's defaults: no fused kernel after a resume).
    built = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    train_state = state.state_dict()
    if not counts_rows:
        del train_state["data_rows"]
    checkpointer.load(path, model, optimizer, train_state, rank_state)
    state.load_state_dict(train_state)
    for group, settings in zip(optimizer.param_groups, built):
        group.update(settings)
    if not counts_rows:  # every step had the rows of the split that wrote it
        state.data_rows = state.step * written.global_batch_rows
    if rank_state is not None:
        set_rng_state(rank_state["rng"])
        data.load_state_dict(rank_state["loader"])
    else:
        data.seek(state.data_rows, state.step)
        if _is_rank0():
            print(
                f"{path}: written with {_split_text(written)}; model and optimizer resharded, the data goes "
                f"on from global row {state.data_rows}, the RNG restarts"
            )
    if _is_rank0():
        print(f"resumed from {path} at step {state.step}")


def _split_text(split: BatchSplit) -> str:
    return ", ".join(f"{name} {value}" for name, value in dataclasses.asdict(split).items())
