"""`vlmcore report`: scaling.csv, PNG plots and SCALABILITY.md.

Inputs: this experiment's scaling runs (`--scaling ws2=scaling/ws2`), points imported from runs
done elsewhere (`--import`, see vlmcore/report/tables.py), the training stages' metrics
(`--train stage1=train/stage1/metrics.jsonl`) and eval results (`--eval [label=]eval/<stage>`, one per
exported stage or checkpoint, in order; vlmcore/report/evaluation.py).

Output directory:
  scaling.csv            one row per scaling point (columns: vlmcore.report.tables.SCALING_COLUMNS)
  training.csv           one row per training stage (when --train is given)
  eval.csv               tidy eval table across runs (when --eval is given): one row per run, task,
                         subset and metric
  layouts.csv            predicted step time of each per-module layout, per training stage with
                         module times (vlmcore.report.layouts)
  plots/*.png            scaling_throughput, scaling_efficiency, scaling_flops, scaling_memory,
                         training_curves, dpo_<stage> (each DPO stage), grpo_<stage> (each GRPO
                         stage), rank_times_<run> (each stage or scaling run that gathered
                         per-rank step times), eval_summary
  SCALABILITY.md         tables, plots, hardware and the exact settings of every run
"""

import argparse
import math
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

import vlmcore
from vlmcore.provenance import git_commit
from vlmcore.report import plots
from vlmcore.report.evaluation import gather_runs, scores_by_run
from vlmcore.report.layouts import Cluster, compare, measured_workload
from vlmcore.report.tables import (
    blend_of,
    import_points,
    point_from_metrics,
    read_metrics,
    scaling_table,
    settings_of,
)


def parse_labelled(values: list[str], option: str, default_label: Callable[[str], str] | None = None) -> dict[str, str]:
    """["a=path", ...] -> {"a": "path"}; without `=`, the label comes from `default_label(path)`."""
    pairs = {}
    for value in values:
        label, sep, path = value.partition("=")
        if not sep:
            if default_label is None:
                raise ValueError(f"{option} {value!r}: expected LABEL=PATH")
            label = default_label(value)
            path = value
        if label in pairs:
            raise ValueError(f"{option}: label {label!r} given twice")
        pairs[label] = path
    return pairs


def eval_label(path: str) -> str:
    """results/<experiment>/eval/results.json -> "<experiment>"; other layouts -> the directory name."""
    directory = Path(path).resolve()
    directory = directory.parent if directory.suffix == ".json" else directory
    return directory.parent.name if directory.name == "eval" else directory.name


def fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def markdown_table(rows: list[dict], columns: dict[str, tuple[str, str]]) -> str:
    """columns: key -> (header, format spec; "" = as text)."""
    lines = [
        "| " + " | ".join(header for header, _ in columns.values()) + " |",
        "|" + "|".join("---" if not spec else "---:" for _, spec in columns.values()) + "|",
    ]
    for row in rows:
        cells = [fmt(row.get(key), spec) if spec else str(row.get(key, "")) for key, (_, spec) in columns.items()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SCALING_MD_COLUMNS = {
    "world_size": ("devices", "d"),
    "label": ("run", ""),
    "layout": ("layout (dp_replicate × dp_shard × tp)", ""),
    "tokens_per_s": ("tokens/s (all)", ",.0f"),
    "tokens_per_s_per_device": ("tokens/s per device", ",.0f"),
    "tflops_per_device": ("TFLOPS per device", ".3g"),
    "mfu": ("MFU %", ".1f"),
    "peak_mem_gb": ("peak mem GB", ".2f"),
    "step_time_s": ("step s", ".3f"),
    "data_wait_s": ("data wait s", ".3f"),
    "speedup": ("speedup", ".2f"),
    "efficiency": ("efficiency", ".0%"),
}
TRAINING_MD_COLUMNS = {
    "stage": ("stage", ""),
    "steps": ("steps", "d"),
    "first_loss": ("first loss", ".3f"),
    "final_loss": ("final loss (mean of last 10)", ".3f"),
    "tokens": ("tokens", ",d"),
    "tokens_per_s_per_device": ("tokens/s per device", ",.0f"),
    "world_size": ("devices", "d"),
    "skipped_steps": ("skipped steps", "d"),
}
# Mixture-of-experts stages only (metrics.jsonl has these keys for MoE models).
MOE_KEYS = {
    "moe_aux_loss": ("MoE aux loss (mean of last 10)", ".4g"),
    "moe_load_imbalance": ("expert load imbalance, max/mean (mean of last 10)", ".2f"),
}
# DPO stages (metrics.jsonl has the pair metrics of vlmcore.train.dpo.pair_metrics): final values
# are the means of the last DPO_FINAL_STEPS steps, as the training table's final loss.
DPO_FINAL_STEPS = 10
DPO_MD_COLUMNS = {
    "stage": ("stage", ""),
    "steps": ("steps", "d"),
    "dpo_loss": ("loss", ".4f"),
    "dpo_chosen_reward": ("chosen reward", ".4f"),
    "dpo_rejected_reward": ("rejected reward", ".4f"),
    "dpo_margin": ("margin", ".4f"),
    "dpo_accuracy": ("accuracy", ".3f"),
}
# GRPO stages (metrics.jsonl has the rollout's figures of vlmcore.train.rollout_data and the
# objective's of vlmcore.train.grpo): the first and the final value (the mean of the last
# GRPO_FINAL_STEPS steps) of each.
GRPO_FINAL_STEPS = 10
GRPO_MD_COLUMNS = {
    "stage": ("stage", ""),
    "steps": ("steps", "d"),
    "first_reward": ("first reward", ".3f"),
    "final_reward": ("final reward", ".3f"),
    "grpo_kl": ("KL to the reference", ".4f"),
    "first_update_gap": ("rollout-training gap, first updates", ".2e"),
    "completion_length_mean": ("completion tokens", ".2f"),
    "clipped": ("clipped tokens", ".3f"),
}
# Stages on a mix of datasets (metrics.jsonl has data_mix_rows: vlmcore.train.metrics_log.mix_metrics).
MIX_MD_COLUMNS = {
    "stage": ("stage", ""),
    "dataset": ("dataset", ""),
    "weight": ("weight (share of the weights)", ".3f"),
    "rows": ("rows", ",d"),
    "realised": ("realised share of the rows", ".3f"),
}
LAYOUT_MD_COLUMNS = {
    "layout": ("layout", ""),
    "vision_s": ("vision s", ".3f"),
    "llm_s": ("LLM s", ".3f"),
    "bridge_s": ("bridge s", ".3f"),
    "step_s": ("predicted step s", ".3f"),
    "speedup": ("speed-up", ".2f"),
}
EVAL_MD_COLUMNS = {
    "task": ("task", ""),
    "subset": ("subset", ""),
    "metric": ("metric", ""),
}


def training_summary(stages: dict[str, pd.DataFrame]) -> list[dict]:
    rows = []
    for stage, m in stages.items():
        last = m.iloc[-1]
        # Throughput leaves out the first step (compilation, first data loads).
        throughput = float(m["tokens_per_s_per_device"].iloc[1:].mean()) if len(m) > 1 else float("nan")
        moe = {key: float(pd.to_numeric(m[key], errors="coerce").tail(10).mean()) for key in MOE_KEYS if key in m}
        rows.append(
            {
                "stage": stage,
                "steps": int(last["step"]),
                "first_loss": float(m["loss"].iloc[0]),
                "final_loss": float(m["loss"].tail(10).mean()),
                "tokens": int(last["tokens"]) if "tokens" in m else None,
                "tokens_per_s_per_device": throughput,
                "world_size": int(last["world_size"]) if "world_size" in m else None,
                "skipped_steps": int(last["skipped_steps"]) if "skipped_steps" in m else 0,
                **moe,
            }
        )
    return rows


def dpo_summary(stage: str, metrics: pd.DataFrame) -> dict:
    """A DPO stage's row of the DPO table: its steps and each pair metric's mean over the last
    DPO_FINAL_STEPS steps."""
    row = {"stage": stage, "steps": int(metrics["step"].iloc[-1])}
    for key in DPO_MD_COLUMNS:
        if key.startswith("dpo_"):
            row[key] = float(pd.to_numeric(metrics[key], errors="coerce").tail(DPO_FINAL_STEPS).mean())
    return row


def dpo_section(stages: dict[str, pd.DataFrame], out: Path) -> list[str]:
    """Plots each DPO stage's pair metrics (plots/dpo_<stage>.png); returns the markdown of the DPO
    section (empty without DPO stages): the table of final values and the plots."""
    dpo_stages = {stage: m for stage, m in stages.items() if "dpo_loss" in m}
    if not dpo_stages:
        return []
    rows = [dpo_summary(stage, m) for stage, m in dpo_stages.items()]
    md = [
        "## DPO",
        "",
        "Per DPO stage, its training pairs' metrics: the loss, the implicit rewards beta x (policy - reference) "
        "log-probability of the chosen and the rejected answers, their margin, and the accuracy (the share of pairs "
        f"whose chosen reward is the larger); final values are means of the last {DPO_FINAL_STEPS} steps. On the "
        "first step the policy is its reference: loss log 2 = 0.693, rewards 0 (docs/post-training.md).",
        "",
        markdown_table(rows, DPO_MD_COLUMNS),
        "",
    ]
    for stage, metrics in dpo_stages.items():
        plots.plot_dpo_curves(stage, metrics, out / f"plots/dpo_{stage}.png")
        md += [f"![DPO stage {stage}: loss, rewards, margin and accuracy](plots/dpo_{stage}.png)", ""]
    return md


def grpo_summary(stage: str, metrics: pd.DataFrame) -> dict:
    """A GRPO stage's row of the GRPO table."""

    def values(key: str) -> pd.Series:
        return pd.to_numeric(metrics[key], errors="coerce") if key in metrics else pd.Series([float("nan")])

    first_updates = metrics["rollouts"].diff().fillna(1) > 0  # each rollout's first step
    return {
        "stage": stage,
        "steps": int(metrics["step"].iloc[-1]),
        "first_reward": float(values("reward_mean").iloc[0]),
        "final_reward": float(values("reward_mean").tail(GRPO_FINAL_STEPS).mean()),
        "grpo_kl": float(values("grpo_kl").tail(GRPO_FINAL_STEPS).mean()),
        "first_update_gap": float(values("grpo_logp_gap")[first_updates].max()),
        "completion_length_mean": float(values("completion_length_mean").tail(GRPO_FINAL_STEPS).mean()),
        "clipped": float((values("grpo_clip_low") + values("grpo_clip_high")).tail(GRPO_FINAL_STEPS).mean()),
    }


def grpo_section(stages: dict[str, pd.DataFrame], out: Path) -> list[str]:
    """Plots each GRPO stage's rollout and update metrics (plots/grpo_<stage>.png); returns the
    markdown of the GRPO section (empty without GRPO stages)."""
    grpo_stages = {stage: m for stage, m in stages.items() if "reward_mean" in m and "grpo_ratio" in m}
    if not grpo_stages:
        return []
    md = [
        "## GRPO",
        "",
        "Per GRPO stage, its rollouts' mean reward (first step, and the mean of the last "
        f"{GRPO_FINAL_STEPS}), the KL to the reference, the largest rollout-training log-probability gap on a "
        "rollout's first update (rounding: the policy samples itself), the completion length and the share of "
        "completion tokens whose ratio was clipped (docs/post-training.md).",
        "",
        markdown_table([grpo_summary(stage, m) for stage, m in grpo_stages.items()], GRPO_MD_COLUMNS),
        "",
    ]
    for stage, metrics in grpo_stages.items():
        plots.plot_grpo_curves(stage, metrics, out / f"plots/grpo_{stage}.png")
        md += [f"![GRPO stage {stage}: reward, KL, gap, length, clipping](plots/grpo_{stage}.png)", ""]
    return md


def mix_rows(stage: str, metrics: pd.DataFrame, blend: dict | None) -> list[dict]:
    """A mixed stage's rows of the mix table: per dataset its configured share (its weight over the
    weights' sum; unknown without the run's blend record, or for an epochized blend, whose shares
    follow the datasets' sizes) against the rows it gave over the whole stage."""
    rows = metrics["data_mix_rows"].dropna().iloc[-1]
    total = sum(rows.values())
    weights = {}
    if blend and blend.get("weights"):
        weights = {name: w / sum(blend["weights"]) for name, w in zip(blend["datasets"], blend["weights"])}
    return [
        {"stage": stage, "dataset": name, "weight": weights.get(name), "rows": n, "realised": n / total}
        for name, n in rows.items()
    ]


def mix_section(stages: dict[str, pd.DataFrame], train: Mapping[str, str | Path]) -> list[str]:
    """The markdown of the data mix section (empty without a stage on a mix): per mixed stage and
    dataset the configured weight against the realised share of the rows."""
    rows = [
        row
        for stage, metrics in stages.items()
        if "data_mix_rows" in metrics
        for row in mix_rows(stage, metrics, blend_of(train[stage]))
    ]
    if not rows:
        return []
    return [
        "## Data mix",
        "",
        "Per stage on a weighted mix of datasets (train.stages.<name>.datasets): each dataset's weight as a share "
        "of the weights, which is the probability that a row is drawn from it, against the rows it gave over the "
        "whole stage and their share of all its rows (metrics.jsonl's data_mix_rows and data_mix). The shares "
        "differ from the weights by chance alone, about sqrt(w (1 - w) / rows).",
        "",
        markdown_table(rows, MIX_MD_COLUMNS),
        "",
    ]


def ranks_section(stages: dict[str, pd.DataFrame], out: Path) -> list[str]:
    """Plots each run's per-rank busy times (plots/rank_times_<run>.png, the stages and scaling runs
    that gathered them); returns the markdown: the plots and the stragglers named, by rank and host."""
    gathered = {stage: m for stage, m in stages.items() if "rank_busy_s" in m}
    if not gathered:
        return []
    md = [
        "## Ranks",
        "",
        "Every rank's busy time a step (its step time less its wait for the other ranks at the step's start), "
        "gathered every `resilience.straggler_interval` steps; a rank busier than the median rank by more than "
        "`resilience.straggler_margin` is named a straggler (docs/hpc.md section 6).",
        "",
    ]
    for stage, metrics in gathered.items():
        plots.plot_rank_times(stage, metrics, out / f"plots/rank_times_{stage}.png")
        named = [s for found in metrics.get("stragglers", pd.Series(dtype=object)).dropna() for s in found]
        by_rank = {}
        for s in named:
            by_rank.setdefault((s["rank"], s["host"]), []).append(s["over_median"])
        gathers = int(metrics["rank_busy_s"].notna().sum())
        if by_rank:
            listed = "; ".join(
                f"rank {rank} on {host}: {len(over)} of {gathers} gathers, +{100 * max(over):.0f}% at most"
                for (rank, host), over in sorted(by_rank.items())
            )
            md += [f"`{stage}`: stragglers named: {listed}.", ""]
        else:
            md += [f"`{stage}`: no straggler in {gathers} gathers.", ""]
        md += [f"![{stage}: per-rank step time](plots/rank_times_{stage}.png)", ""]
    return md


def layout_section(stages: dict, warmup_steps: int, cluster: Cluster) -> tuple[list[str], list[dict]]:
    """Markdown and layouts.csv rows: for each stage with module times, the candidate layouts at
    its world size, fastest first (vlmcore.report.layouts)."""
    md = []
    rows = []
    for stage, (metrics, settings) in stages.items():
        try:
            workload = measured_workload(metrics, settings or {}, warmup_steps)
        except ValueError as e:
            md += [f"Stage `{stage}`: no prediction, {e}.", ""]
            continue
        if workload is None:
            continue
        world = int(metrics["world_size"].iloc[0])
        predictions = [vars(p) for p in compare(workload, cluster, world)]
        rows += [{"stage": stage, "world_size": world, **p} for p in predictions]
        best = predictions[0]
        vision, llm = workload.vision_s / world, workload.llm_s / world
        md += [
            f"### Stage `{stage}` at {world} devices",
            "",
            f"Measured per step and device: vision tower {vision:.3f} s, LLM {llm:.3f} s "
            f"({vision / (vision + llm):.0%} vision), {workload.patches:,.0f} patches per step.",
            "",
            markdown_table(predictions, LAYOUT_MD_COLUMNS),
            "",
            f"Recommended: **{best['layout']}**, predicted {best['step_s']:.3f} s per step, "
            f"{best['speedup']:.2f}x the current layout (colocated, vision TP 1).",
            "",
        ]
    if md:
        md = [
            "## Per-module layouts",
            "",
            "Predicted step time of each way to place the vision tower and the LLM on the devices, from the "
            f"measured per-module times (means after the first {warmup_steps} steps) and the cost model of "
            '`vlmcore.report.layouts` (docs/hpc.md, "Choosing a per-module layout"): '
            f"{cluster.gpus_per_node} GPUs per node, {cluster.intra_node_gbs:g} GB/s per GPU inside a node, "
            f"{cluster.inter_node_gbs:g} GB/s between nodes, TP efficiency {cluster.tp_efficiency:g} per doubling. "
            "Speed-up is against the current layout; memory is not modelled.",
            "",
        ] + md
    return md, rows


def eval_section(evals: Mapping[str, str | Path], out: Path) -> list[str]:
    """Writes eval.csv and the plot across runs; returns the markdown of the Evaluation section:
    each task's main score (and its subsets') per run, with chance and published score."""
    table = gather_runs(evals)
    table.to_csv(out / "eval.csv", index=False)
    runs = list(evals)
    scores = scores_by_run(table)
    plots.plot_eval_summary(scores, runs, out / "plots/eval_summary.png")
    columns = EVAL_MD_COLUMNS | {run: (run, ".3f") for run in runs}
    columns |= {"chance": ("chance", ".3f"), "published": ("published (reference model)", ".3f")}
    return [
        "## Evaluation",
        "",
        f"Each task's main score per run ({', '.join(runs)}), over all its samples (subset blank) and per "
        "subset, on a 0..1 scale; chance is the level of guessing, published the reference model's score "
        "where one is known (its record, vlmcore/eval/benchmarks/<task>.py). Every metric, with its standard error "
        "and sample count, is in eval.csv.",
        "",
        markdown_table(scores.to_dict("records"), columns),
        "",
        "![Evaluation across stages](plots/eval_summary.png)",
        "",
    ]


def generated_line(code: dict) -> str:
    """When and by which vlmcore (its commit, if known) the report was written."""
    commit = ""
    if code["commit"]:
        dirty = ", uncommitted changes" if code["dirty"] else ""
        commit = f" (commit `{code['commit'][:12]}`{dirty})"
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"Generated {now} by vlmcore {vlmcore.__version__}{commit}."


def write_report(
    out: str | Path,
    scaling: Mapping[str, str | Path] | None = None,
    imports: Iterable[str | Path] = (),
    train: Mapping[str, str | Path] | None = None,
    evals: Mapping[str, str | Path] | None = None,
    hardware: str = "unknown",
    warmup_steps: int = 1,
    title: str = "Scaling",
    cluster: Cluster | None = None,
) -> Path:
    """Writes everything listed in the module docstring; returns the path of SCALABILITY.md."""
    out = Path(out)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    scaling = scaling or {}
    train = train or {}
    evals = evals or {}
    cluster = cluster or Cluster()
    points = [point_from_metrics(path, label, warmup_steps) for label, path in scaling.items()]
    for path in imports:
        points += import_points(path, warmup_steps)
    md = [
        f"# {title} report",
        "",
        generated_line(git_commit()),
        "",
        "## Hardware",
        "",
        hardware,
        "",
    ]

    if points:
        table = scaling_table(points)
        table.to_csv(out / "scaling.csv", index=False)
        plots.plot_throughput(table, out / "plots/scaling_throughput.png", f"{title}: throughput")
        plots.plot_efficiency(table, out / "plots/scaling_efficiency.png", f"{title}: scaling efficiency")
        plots.plot_flops(table, out / "plots/scaling_flops.png", f"{title}: FLOPs and MFU")
        plots.plot_memory(table, out / "plots/scaling_memory.png", f"{title}: memory")
        md += [
            "## Scaling",
            "",
            f"Each point is a fixed-step training run; figures are means over its steps after the first {warmup_steps} "
            "(warm-up), peak memory is the maximum. Efficiency = tokens/s per device relative to the smallest run "
            "(1.0 = linear scaling); speedup = total tokens/s relative to the smallest run. MFU uses the dense BF16 "
            "peak of the device (n/a where unknown, e.g. CPUs).",
            "",
            markdown_table(table.to_dict("records"), SCALING_MD_COLUMNS),
            "",
            "![Throughput against devices](plots/scaling_throughput.png)",
            "",
            "![Scaling efficiency](plots/scaling_efficiency.png)",
            "",
            "![TFLOPS and MFU per device](plots/scaling_flops.png)",
            "",
            "![Peak memory per device](plots/scaling_memory.png)",
            "",
        ]

    if train:
        stages = {stage: read_metrics(path) for stage, path in train.items()}
        rows = training_summary(stages)
        pd.DataFrame(rows).to_csv(out / "training.csv", index=False)
        plots.plot_training_curves(stages, out / "plots/training_curves.png")
        columns = TRAINING_MD_COLUMNS | {k: v for k, v in MOE_KEYS.items() if any(k in row for row in rows)}
        md += [
            "## Training",
            "",
            markdown_table(rows, columns),
            "",
            "![Loss, learning rate, gradient norm and throughput per stage](plots/training_curves.png)",
            "",
        ]
        md += dpo_section(stages, out)
        md += grpo_section(stages, out)
        md += mix_section(stages, train)
        layout_md, layout_rows = layout_section(
            {stage: (m, settings_of(train[stage])) for stage, m in stages.items()}, warmup_steps, cluster
        )
        if layout_rows:
            pd.DataFrame(layout_rows).to_csv(out / "layouts.csv", index=False)
        md += layout_md

    # Per-rank step times of the scaling runs (this experiment's) and of the stages.
    runs = {f"scaling_{label}": read_metrics(path) for label, path in scaling.items()}
    md += ranks_section(runs | {stage: read_metrics(path) for stage, path in train.items()}, out)

    if evals:
        md += eval_section(evals, out)

    md += ["## Exact settings", ""]
    sources = [(f"scaling run `{p['label']}` ({p['world_size']} devices)", p["source"]) for p in points]
    sources += [(f"training stage `{stage}`", path) for stage, path in train.items()]
    for what, path in sources:
        settings = None if str(path).endswith(".csv") else settings_of(path)
        md += [f"- {what}: metrics `{path}`"]
        if settings:
            md += [
                "",
                "<details><summary>config.yaml</summary>",
                "",
                "```yaml",
                yaml.safe_dump(settings, sort_keys=False).rstrip(),
                "```",
                "",
                "</details>",
                "",
            ]
    (out / "SCALABILITY.md").write_text("\n".join(md).rstrip() + "\n")
    return out / "SCALABILITY.md"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vlmcore.cli import existing_path, non_negative_int

    parser.add_argument(
        "--scaling",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="a scaling run's metrics.jsonl or its directory, e.g. ws4=scaling/ws4 (repeatable)",
    )
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="PATH",
        type=existing_path,
        help="points from runs done elsewhere: a scaling.csv, a metrics.jsonl, or a directory searched for metrics.jsonl (repeatable)",
    )
    parser.add_argument(
        "--train",
        action="append",
        default=[],
        metavar="STAGE=PATH",
        help="a training stage's metrics.jsonl, in stage order (repeatable)",
    )
    parser.add_argument(
        "--eval",
        action="append",
        default=[],
        metavar="[LABEL=]PATH",
        help="results.json of `vlmcore eval`, its directory, or an eval/<stage> directory of <task>/results.json, "
        "optionally labelled; repeat in stage order",
    )
    parser.add_argument("--hardware", default="unknown", help="hardware description for SCALABILITY.md")
    parser.add_argument(
        "--warmup-steps", type=non_negative_int, default=1, help="first steps of each scaling run left out of the means"
    )
    parser.add_argument("--title", default="Scaling", help="title of the report and its plots")
    parser.add_argument("--out", required=True, help="report directory")


def run(args: argparse.Namespace) -> int:
    from vlmcore.cli import UsageError

    try:
        scaling = parse_labelled(args.scaling, "--scaling")
        train = parse_labelled(args.train, "--train")
        evals = parse_labelled(args.eval, "--eval", default_label=eval_label)
    except ValueError as e:
        raise UsageError(str(e)) from e
    for option, pairs in (("--scaling", scaling), ("--train", train), ("--eval", evals)):
        missing = [path for path in pairs.values() if not Path(path).exists()]
        if missing:
            raise UsageError(f"{option}: {', '.join(missing)} does not exist")
    md = write_report(args.out, scaling, args.imports, train, evals, args.hardware, args.warmup_steps, args.title)
    print(f"wrote {md}")
    return 0
