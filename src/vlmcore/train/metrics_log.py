"""Training metrics: the global batch's counts and FLOPs, MFU, each step's record, and the rank-0
sinks (metrics.jsonl, TensorBoard, offline W&B, one log line per step)."""

import json
import os
import resource
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.load.batch import Batch
from vlmcore.models.flops import llm_flops, vision_flops
from vlmcore.train.objective import Objective
from vlmcore.train.state import TrainState
from vlmcore.train.step import StepResult

# Dense BF16 peak TFLOPS per device (without sparsity); the first matching name wins.
PEAK_TFLOPS = (
    ("GB200", 2500.0),
    ("GB300", 2500.0),
    ("B200", 2250.0),
    ("B300", 2250.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("MI300X", 1307.0),
    ("MI325X", 1307.0),
    ("MI355X", 2500.0),
)


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_TFLOPS if key in name), None)


def batch_flops(config: PretrainedConfig, batch: Batch) -> tuple[float, float]:
    """Training FLOPs (LLM, vision tower) of one packed micro-batch (vlmcore.models.flops)."""
    grids = [g for kind in (batch.images, batch.videos) if kind is not None for g in kind.grids()] or None
    return llm_flops(config, batch.segment_lengths().cpu()), vision_flops(config, grids)


def global_counts(
    host_micro: list[Batch], model_config: PretrainedConfig, peers: int, datasets: Sequence[str] = ()
) -> dict:
    """Label tokens, samples, tokens, FLOPs, bad samples, preference pairs and a rollout's
    completions of the global batch, summed over the ranks on the host (gloo: no GPU wait);
    `peers`: ranks that hold the same batch (tp x cp), hence the division.
    `datasets`: the names of a blend's datasets (the same on every rank), whose rows are counted
    under `dataset_rows` in the same all-reduce."""
    flops = [batch_flops(model_config, b) for b in host_micro]
    skipped = sum((Counter(b.skipped_samples) for b in host_micro), Counter())
    rows_of = Counter(name for b in host_micro for name in b.row_datasets)
    keys = (
        "label_tokens",
        "samples",
        "tokens",
        "llm_flops",
        "vision_flops",
        "skipped_samples",
        "pairs",
        "completions",
    )
    counts = torch.tensor(
        [
            sum(b.label_tokens for b in host_micro),
            sum(b.num_samples for b in host_micro),
            sum(b.tokens for b in host_micro),
            sum(f[0] for f in flops),
            sum(f[1] for f in flops),
            sum(skipped.values()),
            sum(len(b.pairs) for b in host_micro if b.pairs is not None),  # preference pairs (DPO)
            sum(completions(b) for b in host_micro if b.rollout is not None),  # a rollout's completions (GRPO)
            *(rows_of[name] for name in datasets),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(counts)
    totals = (counts / peers).tolist()
    counts = dict(zip(keys, totals))
    if datasets:
        counts["dataset_rows"] = {name: int(n) for name, n in zip(datasets, totals[len(keys) :])}
    # By reason only on steps that have any: every rank sees the same global sum, so all gather or none.
    if counts["skipped_samples"]:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, dict(skipped))
        by_reason = sum(map(Counter, gathered), Counter())
        counts["skipped_samples_by_reason"] = {name: n // peers for name, n in sorted(by_reason.items())}
    return counts


def completions(batch: Batch) -> int:
    """The segments of a host batch with a label token: a rollout batch's completions (each one
    segment, its prompt then its completion, the labels on the completion)."""
    labelled = (batch.labels.reshape(-1) != IGNORE_INDEX).nonzero()[:, 0]
    segment = torch.searchsorted(batch.cu_seqlens[1:].long(), labelled, right=True)
    return len(segment.unique())


def peak_mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


@dataclass
class StepTimes:
    """Host seconds of a step: all of it, and the part spent waiting for its batches."""

    step: float
    data_wait: float


@dataclass
class Hardware:
    """What a step's rates are measured on: the device (its peak memory) and its dense BF16 peak
    TFLOPS (None: unknown, no MFU)."""

    device: torch.device
    peak_tflops: float | None


def step_record(
    state: TrainState,
    result: StepResult,
    counts: dict,
    lr: float,
    times: StepTimes,
    hardware: Hardware,
    objective: Objective,
) -> dict:
    """One line of metrics.jsonl: the objective's metrics (`loss` first) among the step's."""
    world = dist.get_world_size()
    step_time = times.step
    llm_tflops = counts["llm_flops"] / step_time / world / 1e12
    vision_tflops = counts["vision_flops"] / step_time / world / 1e12
    tokens = counts["tokens"]
    objective_metrics = objective.metrics(result.sums, counts)
    return {
        "step": state.step,
        "loss": objective_metrics.pop("loss"),
        "grad_norm": result.grad_norm,
        "lr": lr,
        "tokens": state.tokens,
        "samples": state.samples,
        "data_rows": state.data_rows,  # global rows consumed (vlmcore.data.load.order): which packs the model saw
        "label_tokens": int(counts["label_tokens"]),
        "tokens_per_s": tokens / step_time,
        "tokens_per_s_per_device": tokens / step_time / world,
        "tflops_per_device": llm_tflops + vision_tflops,
        "mfu": 100 * (llm_tflops + vision_tflops) / hardware.peak_tflops if hardware.peak_tflops else None,
        "llm_tflops_per_device": llm_tflops,
        "vision_tflops_per_device": vision_tflops,
        "peak_mem_gb": peak_mem_gb(hardware.device),
        "data_wait_s": times.data_wait,
        "step_time_s": step_time,
        "world_size": world,
        "skipped_steps": state.skipped_steps,
        "skipped_samples": int(counts["skipped_samples"]),
        **({"skipped_samples_by_reason": counts["skipped_samples_by_reason"]} if counts["skipped_samples"] else {}),
        **(result.moe or {}),  # moe_aux_loss, moe_load_imbalance
        **objective_metrics,  # DPO: the rewards, margin and accuracy (vlmcore.train.dpo)
        **mix_metrics(state),
    }


def mix_metrics(state: TrainState) -> dict:
    """A blend's realised mix: the rows each dataset gave since the stage began (`data_mix_rows`)
    and their shares of all rows (`data_mix`); nothing for one dataset."""
    rows = state.dataset_rows
    if not rows:
        return {}
    total = sum(rows.values())
    return {"data_mix_rows": dict(rows), "data_mix": {name: n / total for name, n in rows.items()}}


class MetricsLogger:
    """Rank 0 writes; other ranks get a logger that does nothing."""

    def __init__(
        self, output_dir: str | Path, enabled: bool, tensorboard: bool, wandb: bool, config: dict, resume_step: int
    ) -> None:
        self.enabled = enabled
        self.tb = self.wandb = None
        if not enabled:
            return
        output_dir = Path(output_dir)
        self.path = output_dir / "metrics.jsonl"
        self._truncate_after(resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(output_dir / "tensorboard"), purge_step=resume_step + 1)
        if wandb:
            try:
                import wandb as wandb_lib  # optional dependency
            except ImportError as e:
                raise ImportError("metrics.wandb: true needs the wandb package (pip install wandb)") from e

            os.environ.setdefault("WANDB_MODE", "offline")
            # One W&B run per stage, continued by resumed runs.
            id_file = output_dir / "wandb_run_id"
            run_id = id_file.read_text() if id_file.exists() else uuid.uuid4().hex[:8]
            id_file.write_text(run_id)
            self.wandb = wandb_lib.init(
                dir=str(output_dir),
                config=config,
                id=run_id,
                resume="allow",
                project=os.environ.get("WANDB_PROJECT", "vlmcore"),
            )

    def _truncate_after(self, step: int) -> None:
        """Drops lines of steps a resumed run will redo, so each step is logged once."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except json.JSONDecodeError:  # a line cut short by a killed run
                continue
        self.path.write_text("".join(kept))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"train/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in record.items() if k != "step"}, step=step)
        print(format_line(record), flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def format_line(r: dict) -> str:
    mfu = f" mfu {r['mfu']:.1f}%" if r.get("mfu") is not None else ""
    skipped = f" skipped {r['skipped_steps']}" if r.get("skipped_steps") else ""
    moe = (
        f" aux {r['moe_aux_loss']:.4g} imbalance {r['moe_load_imbalance']:.2f}"
        if r.get("moe_aux_loss") is not None
        else ""
    )
    modules = f" (vision {r['vision_time_s']:.3f}s llm {r['llm_time_s']:.3f}s)" if "vision_time_s" in r else ""
    return (
        f"step {r['step']} loss {r['loss']:.4f} grad_norm {r['grad_norm']:.3f} lr {r['lr']:.2e} "
        f"tok/s/dev {r['tokens_per_s_per_device']:.0f} tflops/dev {r['tflops_per_device']:.2f}{mfu} "
        f"mem {r['peak_mem_gb']:.2f}GB data {r['data_wait_s']:.3f}s step {r['step_time_s']:.3f}s{modules}{moe}{skipped}"
    )
