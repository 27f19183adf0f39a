"""Whether the checkpoints in a stage's output directory belong to the run being started.

Resuming is automatic, but only a run with the same settings may continue: a stage that
Snakemake reruns because its settings changed, or because the user forced it (its `final/`
and `done` are then deleted but its checkpoints are not), must start from scratch. The
earlier run is moved aside to `previous/`, never deleted, so nothing is lost by mistake.

A checkpoint of the last step alone does not say which: a run that crashed after saving it but
before writing `final/` and `done` must be finished, not redone. The `unfinished` marker tells
them apart: it exists from a run's start until just before its `done` is written.
"""

import shutil
from pathlib import Path

import torch.distributed as dist
import yaml

from vlmcore.blend import RUN_RECORD, read_blend
from vlmcore.config import TrainConfig, save_config, to_dict

# Settings that may change between the attempts of one run: how long it runs, how often it
# saves, how it is logged and fed, and how it is laid out over the GPUs (the next job of a stage
# may get another number of nodes: the model and optimizer reshard and the data stream follows
# the global batch, which `vlmcore.train.checkpoint.resume` checks). Anything else (data, model,
# optimizer, hyperparameters) makes it another run.
RESUMABLE_CHANGES = {
    "steps",
    "checkpoint",
    "metrics",
    "num_workers",
    "output_dir",
    "parallel",
    "micro_batch_size",
    "grad_accum_steps",
    "global_batch_rows",
    "allow_global_batch_change",
}
UNFINISHED = "unfinished"


def blend_record(cfg: TrainConfig) -> dict | None:
    """What the run's blend file says (its datasets, weights or repetitions), or None: one dataset.
    The run directory keeps it (vlmcore.blend.RUN_RECORD): the blend's path in data_path stays the
    same when its weights change (the workflow's train/<stage>/data_mix.yaml), and a run on other
    weights has another row order, so it is another run."""
    path = Path(cfg.data_path or "")
    if cfg.data.kind != "packed" or not path.is_file():
        return None
    return read_blend(path).record()


def stale_run_reason(out: str | Path, cfg: TrainConfig) -> str | None:
    """Why the checkpoints in `out` must not be resumed by `cfg`, or None when they may."""
    out = Path(out)
    latest = out / "checkpoints" / "latest"
    if not latest.is_file():
        return None
    step = int(latest.read_text().strip().removeprefix("step_"))
    finished = not (out / UNFINISHED).exists()
    if step > cfg.steps or (step == cfg.steps and finished):
        return f"the run in {out} already reached step {step} of {cfg.steps} and its outputs were removed: starting a new run"
    saved = out / "config.yaml"
    if saved.is_file():
        before = yaml.safe_load(saved.read_text()) or {}
        now = to_dict(cfg)
        changed = sorted(
            k for k in set(before) | set(now) if k not in RESUMABLE_CHANGES and before.get(k) != now.get(k)
        )
        if changed:
            return f"settings changed since the checkpoints in {out} were written ({', '.join(changed)}): starting a new run"
    saved_blend = out / RUN_RECORD
    before = yaml.safe_load(saved_blend.read_text()) if saved_blend.is_file() else None
    if before != blend_record(cfg):
        return f"the blend of data_path changed since the checkpoints in {out} were written: starting a new run"
    return None


def archive_stale_run(out: str | Path, cfg: TrainConfig) -> str | None:
    """Moves an earlier, non-resumable run to `out/previous/` (replacing an older one)."""
    out = Path(out)
    reason = stale_run_reason(out, cfg)
    if reason is None:
        return None
    previous = out / "previous"
    shutil.rmtree(previous, ignore_errors=True)
    previous.mkdir(parents=True)
    # train.log (all attempts, written by the workflow) stays: it is open while this runs.
    for name in ["checkpoints", "metrics.jsonl", "config.yaml", RUN_RECORD, "tensorboard", "wandb", "wandb_run_id"]:
        if (out / name).exists():
            shutil.move(out / name, previous / name)
    return reason


def mark_unfinished(out: str | Path) -> None:
    (Path(out) / UNFINISHED).touch()


def mark_done(out: str | Path) -> None:
    """`done`, after removing the marker: a crash in between leaves a run that counts as finished."""
    (Path(out) / UNFINISHED).unlink(missing_ok=True)
    (Path(out) / "done").touch()


def prepare_output_dir(cfg: TrainConfig, out: Path) -> None:
    """Rank 0 moves another run's checkpoints aside, marks the run unfinished and saves its config."""
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        reason = archive_stale_run(out, cfg)
        if reason:
            print(reason)
        mark_unfinished(out)
        save_config(cfg, out / "config.yaml")
        blend = blend_record(cfg)
        if blend is not None:
            (out / RUN_RECORD).write_text(yaml.safe_dump(blend, sort_keys=False))
    dist.barrier()
