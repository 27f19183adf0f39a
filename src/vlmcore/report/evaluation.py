"""The report's evaluation: every task's score per exported stage, beside its chance level and
the reference model's published score.

`--eval LABEL=PATH` names one run (an exported stage, or a checkpoint) in the order the report
shows them; PATH is a results.json of `vlmcore eval`, a directory holding one, or the workflow's
eval/<stage> directory, whose results are one results.json per task (eval/<stage>/<task>/).

eval.csv is the tidy table of all of them: one row per run, task, subset (question kind,
category, duration, ...) and metric, the values as the results give them. A public benchmark's
main score is the headline metric of its record (vlmcore/eval/benchmarks/<task>.py); its rows carry
the record's chance level where the results have none (free-form answers) and its published score
(`published`, on a 0..1 scale). The report's table across runs puts every main score on a 0..1
scale (a benchmark's by its record's `scale`: lmms-eval gives some in percent).
"""

from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from vlmcore.eval.benchmarks.registry import BENCHMARKS
from vlmcore.eval.results import COLUMNS, read_results, results_table

# Scores on a 0..1 scale, in the order that picks the main score of a task that is no public
# benchmark (lm-eval's, the demo's); other metrics (perplexities) stay in eval.csv only.
SCORE_METRICS = ["acc", "acc_norm", "exact_match", "relaxed_accuracy", "anls", "f1"]
SCORE_WORDS = ("acc", "score", "match", "anls", "relaxed")
EVAL_CSV_COLUMNS = ["run", *COLUMNS, "published"]


def result_files(path: str | Path) -> list[Path]:
    """The results.json files of one run: the file itself, the one in a directory, or those of
    the directory's task subdirectories; raises ValueError naming a path that has none."""
    path = Path(path)
    if path.is_file() or (path / "results.json").is_file():
        return [path]
    files = sorted(path.glob("*/results.json")) if path.is_dir() else []
    if not files:
        raise ValueError(f"{path}: no eval results (results.json, or <task>/results.json, written by `vlmcore eval`)")
    return files


def published_score(task: str) -> float | None:
    """The reference model's published score of a public benchmark on a 0..1 scale (its record
    gives them in percent, as model cards do); None where the record has none. With several, the first."""
    benchmark = BENCHMARKS.get(task)
    if benchmark is None or not benchmark.published:
        return None
    return next(iter(benchmark.published.values())) / 100


def main_metric(task: str, metrics: pd.Series) -> str | None:
    """A task's main score: a public benchmark's headline metric (its record's); for another task,
    or a benchmark's results without that metric, the first of SCORE_METRICS among its metrics,
    else the first whose name says it is a score; None: no score on a 0..1 scale."""
    present = list(dict.fromkeys(metrics))
    benchmark = BENCHMARKS.get(task)
    if benchmark is not None and benchmark.metric in present:
        return benchmark.metric
    known = next((m for m in SCORE_METRICS if m in present), None)
    return known or next((m for m in present if any(word in m for word in SCORE_WORDS)), None)


def add_reference_levels(table: pd.DataFrame) -> pd.DataFrame:
    """Fills the chance level from the registry where the results have none, and the published
    score, on the rows of each task's main score over all its samples (subset "")."""
    table = table.copy()
    table["published"] = float("nan")
    for task, rows in table.groupby("task"):
        metric = main_metric(task, rows["metric"])
        if metric is None:
            continue
        main = (table["task"] == task) & (table["subset"] == "") & (table["metric"] == metric)
        benchmark = BENCHMARKS.get(task)
        if benchmark is not None and benchmark.chance is not None:
            table.loc[main & table["chance"].isna(), "chance"] = benchmark.chance
        published = published_score(task)
        if published is not None:
            table.loc[main, "published"] = published
    return table


def gather_runs(runs: Mapping[str, str | Path]) -> pd.DataFrame:
    """{run label: results path} -> eval.csv's table, runs in the order given."""
    tables = [
        results_table(read_results(path)).assign(run=label)
        for label, run_path in runs.items()
        for path in result_files(run_path)
    ]
    if not tables:
        return pd.DataFrame(columns=EVAL_CSV_COLUMNS)
    table = pd.concat(tables, ignore_index=True)
    return add_reference_levels(table)[EVAL_CSV_COLUMNS]


def score_scale(task: str, metric: str) -> float:
    """What a task's metric is divided by to be on a 0..1 scale: a benchmark's record's `scale`
    for its headline metric, else 1."""
    benchmark = BENCHMARKS.get(task)
    return benchmark.scale if benchmark is not None and metric == benchmark.metric else 1.0


def scores_by_run(table: pd.DataFrame) -> pd.DataFrame:
    """One row per task and subset with its main score in one column per run (in order), then the
    chance level and the published score: the report's table and plot across stages."""
    runs = list(dict.fromkeys(table["run"]))
    rows = []
    ordered = table.sort_values(["task", "subset"], kind="stable")  # each task, its overall score first
    for (task, subset), group in ordered.groupby(["task", "subset"], sort=False):
        metric = main_metric(task, group["metric"])
        if metric is None:
            continue
        scored = group[group["metric"] == metric].drop_duplicates("run", keep="last").set_index("run")
        row = {"task": task, "subset": subset, "metric": metric}
        scale = score_scale(task, metric)
        for run in runs:
            row[run] = scored["value"].get(run, float("nan")) / scale
        row["chance"] = scored["chance"].dropna().iloc[0] if scored["chance"].notna().any() else float("nan")
        row["published"] = scored["published"].dropna().iloc[0] if scored["published"].notna().any() else float("nan")
        rows.append(row)
    return pd.DataFrame(rows, columns=["task", "subset", "metric", *runs, "chance", "published"])
