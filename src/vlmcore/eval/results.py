"""Tidy tables of `vlmcore eval` results: one row per task, subset and metric.

`gather({"demo/stage1": "results/demo/eval-stage1/results.json", ...})` stacks several runs
(stages, experiments) into one table with a `run` column, for comparisons and the report.
"""

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

COLUMNS = ["task", "subset", "metric", "filter", "value", "stderr", "chance", "n_samples"]


def results_table(result: dict) -> pd.DataFrame:
    """Rows from lm-eval's `results` (keys "<metric>,<filter>") plus vlmcore's per-kind breakdown
    and the count of questions whose video did not decode, per reason."""
    rows = []
    for task, metrics in result["results"].items():
        n_samples = result.get("n-samples", {}).get(task, {}).get("effective")
        chance = result.get("chance", {}).get(task)
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            rows.append(
                {
                    "task": task,
                    "subset": "",
                    "metric": metric,
                    "filter": filter_name,
                    "value": float(value),
                    "stderr": stderr if isinstance(stderr, (int, float)) else None,
                    "chance": chance if metric in ("acc", "acc_norm") else None,
                    "n_samples": n_samples,
                }
            )
    for task, kinds in result.get("breakdown", {}).items():
        for kind, figures in kinds.items():
            rows.append(
                {
                    "task": task,
                    "subset": kind,
                    "metric": figures["metric"],
                    "filter": "none",
                    "value": figures["value"],
                    "stderr": None,
                    "chance": figures["chance"],
                    "n_samples": figures["n"],
                }
            )
    for task, by_reason in result.get("undecodable_videos", {}).items():
        for reason, count in by_reason.items():
            rows.append(
                {
                    "task": task,
                    "subset": f"undecodable_video/{reason}",
                    "metric": "undecodable_videos",
                    "filter": "none",
                    "value": float(count),
                    "stderr": None,
                    "chance": None,
                    "n_samples": count,
                }
            )
    return pd.DataFrame(rows, columns=COLUMNS)


def jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, object) of each non-blank line of a JSON-lines file; a line that is not JSON
    raises ValueError naming it."""
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not JSON ({e})") from None
        yield line_no, record


def read_results(path: str | Path) -> dict:
    """results.json, or the results.json inside a directory."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise ValueError(f"{path}: no eval results (expected results.json written by `vlmcore eval`)")
    result = json.loads(path.read_text())
    if "results" not in result:
        raise ValueError(f"{path}: no `results` key; not an lm-eval / vlmcore eval output")
    return result


def gather(runs: Mapping[str, str | Path]) -> pd.DataFrame:
    """{run label: results.json or eval dir} -> one table with a leading `run` column."""
    tables = [results_table(read_results(path)).assign(run=label) for label, path in runs.items()]
    if not tables:
        return pd.DataFrame(columns=["run", *COLUMNS])
    return pd.concat(tables, ignore_index=True)[["run", *COLUMNS]]
