"""PNG plots of the report: scaling, training curves, DPO curves, eval summary.

Figures are built with matplotlib's object API (no pyplot state, no display needed) and saved at
150 dpi. Every axis names its quantity and unit; every plot with more than one series has a legend.
"""

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator, PercentFormatter

DPI = 150
DEVICES_LABEL = "Devices (GPUs, or processes on CPU)"
# Subsets (question kinds, categories) drawn per task in the eval summary; more stay in eval.csv.
MAX_SUBSETS = 8


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def _devices_axis(ax: Axes, world_sizes: Iterable[float]) -> None:
    sizes = sorted(set(int(w) for w in world_sizes))
    if len(sizes) > 1 and sizes[-1] / sizes[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.minorticks_off()
    ax.set_xlabel(DEVICES_LABEL)
    ax.grid(True, alpha=0.3)


def _thousands(ax: Axes) -> None:
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))


def _compact(value: float) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:g}{suffix}"
    return f"{value:g}"


def plot_throughput(table: pd.DataFrame, path: Path, title: str) -> Path:
    """Total tokens/s against devices, with the ideal linear scaling from the smallest point."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    ws = table["world_size"].to_numpy(dtype=float)
    total = (table["tokens_per_s_per_device"] * table["world_size"]).to_numpy(dtype=float)
    ideal = total[0] * ws / ws[0]
    ax.plot(ws, ideal, "--", color="gray", label=f"ideal linear scaling (from {ws[0]:g} devices)")
    ax.plot(ws, total, "o-", color="tab:blue", linewidth=2, label="measured")
    for x, y, eff in zip(ws, total, table["efficiency"]):
        ax.annotate(f"{eff:.0%}", (x, y), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=9)
    _devices_axis(ax, ws)
    if ax.get_xscale() == "log":
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _compact(y)))
    else:
        ax.set_ylim(bottom=0)
        _thousands(ax)
    ax.set_ylabel("Throughput (tokens/s, all devices)")
    ax.set_title(f"{title}\nlabels: scaling efficiency per device")
    ax.legend(loc="upper left")
    return _save(fig, path)


def plot_efficiency(table: pd.DataFrame, path: Path, title: str) -> Path:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    ws = table["world_size"].to_numpy(dtype=float)
    ax.axhline(100, linestyle="--", color="gray", label="ideal (linear scaling)")
    ax.plot(ws, table["efficiency"] * 100, "o-", color="tab:green", linewidth=2, label="measured")
    _devices_axis(ax, ws)
    ax.set_ylim(0, max(110, float(np.nanmax(table["efficiency"] * 100)) + 10))
    ax.yaxis.set_major_formatter(PercentFormatter())
    ax.set_ylabel("Scaling efficiency (tokens/s per device vs smallest run)")
    ax.set_title(title)
    ax.legend(loc="lower left")
    return _save(fig, path)


def plot_flops(table: pd.DataFrame, path: Path, title: str) -> Path:
    """TFLOPS per device (LLM and vision tower apart) and MFU against devices."""
    fig = Figure(figsize=(11, 4.5))
    left, right = fig.subplots(1, 2)
    ws = table["world_size"].to_numpy(dtype=float)
    left.plot(ws, table["tflops_per_device"], "o-", linewidth=2, label="total")
    left.plot(ws, table["llm_tflops_per_device"], "s--", label="language model")
    left.plot(ws, table["vision_tflops_per_device"], "^--", label="vision tower")
    _devices_axis(left, ws)
    left.set_ylim(bottom=0)
    left.set_ylabel("Achieved TFLOPS per device (TFLOP/s)")
    left.set_title("Model FLOPs per device")
    left.legend()
    if table["mfu"].notna().any():
        right.plot(ws, table["mfu"], "o-", color="tab:red", linewidth=2, label="MFU")
        right.set_ylim(0, max(10.0, float(np.nanmax(table["mfu"])) * 1.2))
        right.legend()
    else:
        right.text(
            0.5,
            0.5,
            "MFU not available:\nno peak FLOPS known for this hardware",
            ha="center",
            va="center",
            transform=right.transAxes,
            fontsize=11,
        )
        right.set_ylim(0, 100)
    _devices_axis(right, ws)
    right.set_xlim(left.get_xlim())
    right.yaxis.set_major_formatter(PercentFormatter(decimals=0))
    right.set_ylabel("Model FLOPs utilisation (% of peak)")
    right.set_title("MFU")
    fig.suptitle(title)
    return _save(fig, path)


def plot_memory(table: pd.DataFrame, path: Path, title: str) -> Path:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    labels = [f"{int(w)}" for w in table["world_size"]]
    bars = ax.bar(labels, table["peak_mem_gb"], color="tab:purple", label="peak memory per device")
    ax.bar_label(bars, fmt="%.2f", fontsize=9)
    ax.set_xlabel(DEVICES_LABEL)
    ax.set_ylabel("Peak memory per device (GB)")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_training_curves(stages: dict[str, pd.DataFrame], path: Path) -> Path:
    """Loss, learning rate, grad norm and throughput over the steps of all stages, one after the other."""
    fig = Figure(figsize=(12, 8))
    axes = fig.subplots(2, 2, sharex=True).ravel()
    panels = [
        ("loss", "Training loss (nats/token)"),
        ("lr", "Learning rate"),
        ("grad_norm", "Gradient norm (before clipping)"),
        ("tokens_per_s_per_device", "Throughput (tokens/s per device)"),
    ]
    offset = 0
    for i, (stage, metrics) in enumerate(stages.items()):
        color = f"C{i}"
        steps = metrics["step"] + offset
        for ax, (key, _) in zip(axes, panels):
            if key not in metrics:
                continue
            values = pd.to_numeric(metrics[key], errors="coerce")
            if key == "loss":
                _raw_and_mean(ax, steps, values, color, stage)
            else:
                ax.plot(steps, values, color=color, linewidth=1.5, label=stage)
        if i > 0:
            for ax in axes:
                ax.axvline(offset, color="gray", linestyle=":", linewidth=1)
        offset = int(steps.max())
    for ax, (_, label) in zip(axes, panels):
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=9)
    for ax in axes[2:]:
        ax.set_xlabel("Optimizer step (stages run one after the other)")
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    _thousands(axes[3])
    fig.suptitle("Training curves")
    return _save(fig, path)


def _eval_panel(ax: Axes, rows: pd.DataFrame, runs: list[str]) -> None:
    """One task's main score per run: all samples bold, each subset thin (up to MAX_SUBSETS), its
    chance level and the reference model's published score as horizontal lines."""
    x = np.arange(len(runs))
    overall = rows[rows["subset"] == ""]
    subsets = rows[rows["subset"] != ""]
    if len(subsets) <= MAX_SUBSETS:
        for i, (_, row) in enumerate(subsets.iterrows()):
            values = row[runs].to_numpy(dtype=float) * 100
            ax.plot(x, values, "o-", color=f"C{i + 1}", linewidth=1, markersize=3, alpha=0.7, label=row["subset"])
    for _, row in overall.iterrows():
        values = row[runs].to_numpy(dtype=float) * 100
        ax.plot(x, values, "o-", color="C0", linewidth=2.5, label="all samples")
        for xi, value in zip(x, values):
            if not np.isnan(value):
                ax.annotate(
                    f"{value:.1f}", (xi, value), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8
                )
    levels = overall if not overall.empty else rows
    chance = levels["chance"].dropna()
    if not chance.empty:
        ax.axhline(chance.iloc[0] * 100, color="gray", linestyle="--", linewidth=1, label="chance")
    published = levels["published"].dropna()
    if not published.empty:
        ax.axhline(
            published.iloc[0] * 100, color="black", linestyle=":", linewidth=1.5, label="published (reference model)"
        )
    metric = rows["metric"].iloc[0]
    hidden = f", {len(subsets)} subsets in eval.csv" if len(subsets) > MAX_SUBSETS else ""
    ax.set_title(f"{rows['task'].iloc[0]} ({metric}{hidden})", fontsize=10)
    ax.set_xticks(x, runs, fontsize=9)
    ax.set_xlim(-0.5, len(runs) - 0.5)
    ax.set_ylim(0, 105)
    ax.yaxis.set_major_formatter(PercentFormatter())
    ax.yaxis.set_major_locator(MaxNLocator(6))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def plot_eval_summary(scores: pd.DataFrame, runs: list[str], path: Path) -> Path:
    """Each task's main score across the runs (exported stages, checkpoints), one panel per task
    (vlmcore.report.evaluation.scores_by_run gives the rows)."""
    tasks = list(dict.fromkeys(scores["task"]))
    columns = min(3, max(1, len(tasks)))
    panel_rows = max(1, -(-len(tasks) // columns))
    fig = Figure(figsize=(5.2 * columns + 0.8, 3.9 * panel_rows + 0.6))
    axes = np.atleast_1d(fig.subplots(panel_rows, columns)).ravel()
    if not tasks:
        axes[0].text(
            0.5,
            0.5,
            "no scored tasks (accuracy-type metrics) in the results",
            ha="center",
            va="center",
            transform=axes[0].transAxes,
        )
        return _save(fig, path)
    for ax, task in zip(axes, tasks):
        _eval_panel(ax, scores[scores["task"] == task], runs)
        ax.set_ylabel("Score (%)")
        ax.set_xlabel("Run (exported stage or checkpoint)")
    for ax in axes[len(tasks) :]:
        ax.set_visible(False)
    fig.suptitle("Evaluation across stages")
    return _save(fig, path)


def _raw_and_mean(ax: Axes, steps: pd.Series, values: pd.Series, color: str, label: str) -> None:
    """A noisy per-step series: thin as logged, and bold as a rolling mean once there are 20 steps."""
    if len(values) < 20:
        ax.plot(steps, values, color=color, linewidth=1.5, label=label)
        return
    window = max(5, len(values) // 20)
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
    ax.plot(
        steps,
        values.rolling(window, min_periods=1).mean(),
        color=color,
        linewidth=2,
        label=f"{label} (mean of {window} steps)",
    )


def plot_dpo_curves(stage: str, metrics: pd.DataFrame, path: Path) -> Path:
    """A DPO stage's pair metrics over its steps (metrics.jsonl's `dpo_*` keys): the loss against
    log 2 (the policy equal to its reference), the chosen and rejected rewards, their margin, and
    the accuracy against chance."""
    fig = Figure(figsize=(12, 8))
    loss_ax, reward_ax, margin_ax, accuracy_ax = fig.subplots(2, 2, sharex=True).ravel()
    steps = metrics["step"]

    def values(key: str) -> pd.Series:
        return pd.to_numeric(metrics[key], errors="coerce")

    _raw_and_mean(loss_ax, steps, values("dpo_loss"), "C0", "loss")
    loss_ax.axhline(np.log(2), color="gray", linestyle="--", linewidth=1, label="log 2 (policy = reference)")
    loss_ax.set_ylabel("DPO loss (mean over the step's pairs)")
    _raw_and_mean(reward_ax, steps, values("dpo_chosen_reward"), "C2", "chosen")
    _raw_and_mean(reward_ax, steps, values("dpo_rejected_reward"), "C3", "rejected")
    reward_ax.axhline(0, color="gray", linestyle="--", linewidth=1)
    reward_ax.set_ylabel("Implicit reward (beta x log-ratio to the reference)")
    _raw_and_mean(margin_ax, steps, values("dpo_margin"), "C1", "margin")
    margin_ax.axhline(0, color="gray", linestyle="--", linewidth=1)
    margin_ax.set_ylabel("Reward margin (chosen - rejected)")
    _raw_and_mean(accuracy_ax, steps, values("dpo_accuracy"), "C4", "accuracy")
    accuracy_ax.axhline(0.5, color="gray", linestyle="--", linewidth=1, label="chance")
    accuracy_ax.set_ylim(-0.05, 1.05)
    accuracy_ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))
    accuracy_ax.set_ylabel("Pairs whose chosen reward is the larger")
    for ax in (loss_ax, reward_ax, margin_ax, accuracy_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=9)
    for ax in (margin_ax, accuracy_ax):
        ax.set_xlabel("Optimizer step")
    fig.suptitle(f"DPO stage {stage}: training pairs")
    return _save(fig, path)


def plot_grpo_curves(stage: str, metrics: pd.DataFrame, path: Path) -> Path:
    """A GRPO stage's rollout and update metrics over its steps: the mean reward (and each reward's),
    the KL to the reference (with a reference), the rollout-training gap (mean |rollout - training|
    log-probability: 0 up to rounding on each rollout's first update), the completion length,
    and the shares of tokens clipped below and above."""
    fig = Figure(figsize=(12, 8))
    reward_ax, kl_ax, gap_ax, length_ax, clip_ax, truncated_ax = fig.subplots(2, 3, sharex=True).ravel()
    steps = metrics["step"]

    def values(key: str) -> pd.Series:
        return pd.to_numeric(metrics[key], errors="coerce")

    _raw_and_mean(reward_ax, steps, values("reward_mean"), "C0", "reward")
    for i, key in enumerate(k for k in metrics.columns if k.startswith("reward_mean/")):
        _raw_and_mean(reward_ax, steps, values(key), f"C{i + 5}", key.removeprefix("reward_mean/"))
    reward_ax.set_ylabel("Mean reward of the rollout's completions")
    if "grpo_kl" in metrics:
        _raw_and_mean(kl_ax, steps, values("grpo_kl"), "C1", "KL to the reference (k3)")
    kl_ax.set_ylabel("KL to the reference")
    _raw_and_mean(gap_ax, steps, values("grpo_logp_gap"), "C2", "mean |old - new| log p")
    gap_ax.set_ylabel("Rollout-training log-probability gap")
    _raw_and_mean(length_ax, steps, values("completion_length_mean"), "C3", "completion length")
    length_ax.set_ylabel("Tokens per completion")
    _raw_and_mean(clip_ax, steps, values("grpo_clip_low"), "C4", "clipped low")
    _raw_and_mean(clip_ax, steps, values("grpo_clip_high"), "C8", "clipped high")
    clip_ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))
    clip_ax.set_ylabel("Share of completion tokens clipped")
    _raw_and_mean(truncated_ax, steps, values("truncated_fraction"), "C9", "cut at max_new_tokens")
    truncated_ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))
    truncated_ax.set_ylabel("Share of completions truncated")
    for ax in (reward_ax, kl_ax, gap_ax, length_ax, clip_ax, truncated_ax):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=9)
    for ax in (length_ax, clip_ax, truncated_ax):
        ax.set_xlabel("Optimizer step")
    fig.suptitle(f"GRPO stage {stage}: rollouts and updates")
    return _save(fig, path)


# Up to this many ranks get a line each in the per-rank plot; more are drawn as their median and range.
RANK_LINES = 16


def plot_rank_times(run: str, metrics: pd.DataFrame, path: Path) -> Path:
    """Each rank's busy time a step (metrics.jsonl's `rank_busy_s`, gathered every
    resilience.straggler_interval steps: its step time less its wait for the others), with the
    stragglers the run named marked."""
    rows = metrics.dropna(subset=["rank_busy_s"])
    steps = rows["step"].to_numpy()
    busy = np.array(rows["rank_busy_s"].tolist(), dtype=float)  # (gathers, ranks)
    fig = Figure(figsize=(9, 4.5))
    ax = fig.add_subplot()
    if busy.shape[1] <= RANK_LINES:
        for rank in range(busy.shape[1]):
            ax.plot(steps, busy[:, rank], "o-", markersize=3, linewidth=1.2, label=f"rank {rank}")
    else:
        ax.fill_between(steps, busy.min(axis=1), busy.max(axis=1), color="tab:blue", alpha=0.2, label="all ranks")
        ax.plot(steps, np.median(busy, axis=1), color="tab:blue", linewidth=2, label="median rank")
    named = [(step, s) for step, found in zip(steps, rows.get("stragglers", [])) for s in found or []]
    if named:
        ax.scatter(
            [step for step, _ in named],
            [s["busy_s"] for _, s in named],
            marker="x",
            s=60,
            color="black",
            zorder=3,
            label="named a straggler",
        )
    ax.set_xlabel("Optimizer step (mean over the steps since the last gather)")
    ax.set_ylabel("Busy time a step (s)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.suptitle(f"{run}: per-rank step time")
    return _save(fig, path)
