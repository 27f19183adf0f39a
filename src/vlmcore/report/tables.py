"""Reading training metrics and turning scaling runs into one table.

A scaling point is one fixed-step training run (`metrics.jsonl`, one JSON object per step with
the keys listed in docs/internals.md). Its figures are means over the steps after the warm-up
steps (compilation, allocator growth and the first data loads distort those), except the memory
peak (the maximum).

Points come from this experiment (`--scaling ws4=scaling/ws4`) or are imported from runs done
elsewhere: a `scaling.csv` written by another report, a `metrics.jsonl`, or a directory searched
for `metrics.jsonl` files (for example the output directories of cluster jobs at 16..256 GPUs).
"""

from pathlib import Path

import pandas as pd
import yaml

from vlmcore.blend import RUN_RECORD
from vlmcore.eval.results import jsonl_records

# Columns of scaling.csv, in order; `efficiency` and `speedup` are relative to the smallest point.
SCALING_COLUMNS = [
    "label",
    "world_size",
    "layout",
    "steps_measured",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "llm_tflops_per_device",
    "vision_tflops_per_device",
    "mfu",
    "peak_mem_gb",
    "step_time_s",
    "data_wait_s",
    "speedup",
    "efficiency",
    "source",
]
MEAN_KEYS = [
    "tokens_per_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "llm_tflops_per_device",
    "vision_tflops_per_device",
    "mfu",
    "step_time_s",
    "data_wait_s",
]
REQUIRED_IMPORT_COLUMNS = ["world_size", "tokens_per_s_per_device"]


def read_metrics(path: str | Path) -> pd.DataFrame:
    """metrics.jsonl (or the one inside a directory) as a DataFrame, one row per step."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no metrics file")
    records = []
    for line_no, record in jsonl_records(path):
        if "step" not in record:
            raise ValueError(f"{path}:{line_no}: no `step` key")
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no metrics recorded")
    # A resumed run may have logged a step twice; the later line wins.
    return pd.DataFrame(records).drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True)


def summarize_point(metrics: pd.DataFrame, label: str, source: str, warmup_steps: int) -> dict:
    """One scaling point: means over the steps after `warmup_steps`, peak memory as the maximum."""
    if "world_size" not in metrics:
        raise ValueError(f"{source}: metrics have no `world_size`")
    if metrics["world_size"].nunique() != 1:
        raise ValueError(f"{source}: world_size changes within the run ({sorted(metrics['world_size'].unique())})")
    measured = metrics.iloc[warmup_steps:]
    if measured.empty:
        raise ValueError(f"{source}: {len(metrics)} steps recorded, all within the {warmup_steps} warm-up steps")
    row = {
        "label": label,
        "world_size": int(metrics["world_size"].iloc[0]),
        "steps_measured": len(measured),
        "source": source,
    }
    for key in MEAN_KEYS:
        row[key] = pd.to_numeric(measured[key], errors="coerce").mean() if key in measured else float("nan")
    row["peak_mem_gb"] = (
        pd.to_numeric(measured["peak_mem_gb"], errors="coerce").max() if "peak_mem_gb" in measured else float("nan")
    )
    return row


def settings_of(metrics_path: str | Path) -> dict | None:
    """The config.yaml written next to a metrics.jsonl, if any."""
    path = Path(metrics_path)
    config = (path if path.is_dir() else path.parent) / "config.yaml"
    return yaml.safe_load(config.read_text()) if config.is_file() else None


def blend_of(metrics_path: str | Path) -> dict | None:
    """The blend a stage trained on, as its run directory records it next to its metrics.jsonl
    (vlmcore.blend.RUN_RECORD: datasets, weights or repetitions), if any."""
    path = Path(metrics_path)
    record = (path if path.is_dir() else path.parent) / RUN_RECORD
    return yaml.safe_load(record.read_text()) if record.is_file() else None


def parallel_layout(settings: dict | None, world_size: int) -> str:
    """ "1×4×2, micro-batch 1" from a training config.yaml; "" when unknown."""
    if not settings or "parallel" not in settings:
        return ""
    parallel = settings["parallel"]
    replicate = parallel.get("dp_replicate", 1)
    tp = parallel.get("tp", 1)
    shard = parallel.get("dp_shard", -1)
    shard = world_size // (replicate * tp) if shard == -1 else shard
    return f"{replicate}×{shard}×{tp}, micro-batch {settings.get('micro_batch_size', '?')}"


def point_from_metrics(path: str | Path, label: str, warmup_steps: int) -> dict:
    """A scaling point from a metrics.jsonl (or its directory), with the layout of its config.yaml."""
    point = summarize_point(read_metrics(path), label, str(path), warmup_steps)
    return point | {"layout": parallel_layout(settings_of(path), point["world_size"])}


def import_points(path: str | Path, warmup_steps: int) -> list[dict]:
    """Scaling points from a scaling.csv, a metrics.jsonl, or a directory of metrics.jsonl files."""
    path = Path(path)
    if path.suffix == ".csv":
        table = pd.read_csv(path, dtype={"label": str, "layout": str, "source": str})
        missing = [c for c in REQUIRED_IMPORT_COLUMNS if c not in table]
        if missing:
            raise ValueError(f"--import {path}: missing columns {missing} (expected a scaling.csv)")
        table["source"] = table["source"].fillna(str(path)) if "source" in table else str(path)
        table["layout"] = table["layout"].fillna("") if "layout" in table else ""
        if "label" not in table:
            table["label"] = [f"ws{int(ws)}" for ws in table["world_size"]]
        return table.drop(columns=["speedup", "efficiency"], errors="ignore").to_dict("records")
    if path.is_file():
        return [point_from_metrics(path, path.parent.name, warmup_steps)]
    if path.is_dir():
        files = sorted(path.rglob("metrics.jsonl"))
        if not files:
            raise ValueError(f"--import {path}: no metrics.jsonl below this directory")
        return [
            point_from_metrics(f, str(f.parent.relative_to(path)) if f.parent != path else path.name, warmup_steps)
            for f in files
        ]
    raise ValueError(f"--import {path}: no such file or directory")


def scaling_table(points: list[dict]) -> pd.DataFrame:
    """Points sorted by world size, with speedup and per-device efficiency against the smallest.

    Efficiency = tokens/s per device at N / tokens/s per device at the smallest N, the weak-scaling
    efficiency for a fixed per-device batch (1.0 = linear scaling).
    """
    table = pd.DataFrame(points)
    repeated = sorted(table["label"][table["label"].duplicated()]) if not table.empty else []
    if repeated:
        raise ValueError(f"scaling points with the same label {repeated}: each run may be given or imported once")
    for column in SCALING_COLUMNS:
        if column not in table:
            table[column] = "" if column in ("layout", "source") else float("nan")
    table = table.sort_values(["world_size", "label"]).reset_index(drop=True)
    if not table.empty:
        base = table.iloc[0]
        total = table["tokens_per_s_per_device"] * table["world_size"]
        table["speedup"] = total / (base["tokens_per_s_per_device"] * base["world_size"])
        table["efficiency"] = table["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
        table["tokens_per_s"] = table["tokens_per_s"].fillna(total)
    return table[SCALING_COLUMNS]
