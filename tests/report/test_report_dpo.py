"""The DPO section of `vlmcore report`: per DPO stage a plot of its pair metrics and a table row of
their final values (means of the last steps).

The metrics file is written by the training loop's own writer (`step_record` and `MetricsLogger`)
from real DPO pair losses (`vlmcore.train.dpo`), so the report reads the fields training logs.
tests/distributed/test_train_dpo.py and tests/workflow/test_pipeline_demo.py (the DPO demo) check the section on real runs.
"""

import math
import re
from pathlib import Path

import pytest
import torch
from helpers import dpo_table
from PIL import Image

from vlmcore.parallel.layout import BatchSplit
from vlmcore.report.scaling import DPO_FINAL_STEPS, write_report
from vlmcore.report.tables import read_metrics
from vlmcore.train.dpo import PAIR_SUMS, DPOObjective, pair_losses
from vlmcore.train.metrics_log import Hardware, MetricsLogger, StepTimes, step_record
from vlmcore.train.objective import CrossEntropy
from vlmcore.train.state import TrainState
from vlmcore.train.step import StepResult

STEPS = 24
PAIRS = 4


def write_dpo_metrics(output_dir: Path, steps: int, sft: bool = False) -> Path:
    """metrics.jsonl of a run whose policy moves away from its reference step by step: each step's
    record from real pair losses, through the loop's writer. `sft`: an SFT stage's records instead."""
    output_dir.mkdir(parents=True, exist_ok=True)
    logger = MetricsLogger(output_dir, True, False, False, {}, resume_step=0)
    state = TrainState(BatchSplit(1, 1, 1, 1, 1, PAIRS))
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(2 * PAIRS, generator=generator, dtype=torch.float64)
    pairs = torch.arange(2 * PAIRS).view(PAIRS, 2)
    # The loop's objectives, whose metrics the records hold (an SFT stage's loss: its sum over its tokens).
    objective = CrossEntropy() if sft else DPOObjective(reference=None, beta=0.1, label_smoothing=0.0)
    for step in range(steps):
        shift = torch.randn(2 * PAIRS, generator=generator, dtype=torch.float64) * step
        losses = pair_losses(reference + shift, reference, pairs, beta=0.1)
        sums = [losses.losses.sum(), losses.chosen_rewards.sum(), losses.rejected_rewards.sum(), losses.correct.sum()]
        assert len(sums) == len(PAIR_SUMS)
        result = StepResult(float(sums[0]), 1.0, True, None, [float(value) for value in sums])
        counts = {
            "label_tokens": 100.0,
            "samples": 2.0 * PAIRS,
            "tokens": 400.0,
            "llm_flops": 1e9,
            "vision_flops": 0.0,
            "skipped_samples": 0.0,
            "pairs": float(PAIRS),
        }
        state.count_step(True, int(counts["samples"]), int(counts["tokens"]))
        logger.log(
            step_record(
                state, result, counts, 1e-3, StepTimes(0.5, 0.0), Hardware(torch.device("cpu"), None), objective
            )
        )
    return output_dir / "metrics.jsonl"


def test_report_plots_and_tabulates_each_dpo_stage(tmp_path, one_process_group):
    sft = write_dpo_metrics(tmp_path / "train" / "sft", 12, sft=True)
    dpo = write_dpo_metrics(tmp_path / "train" / "dpo", STEPS)
    md = write_report(tmp_path / "report", train={"sft": sft, "dpo": dpo}).read_text()

    table = dpo_table(md)
    assert list(table) == ["dpo"]  # the SFT stage has no DPO row
    metrics = read_metrics(dpo)
    assert metrics["dpo_loss"].iloc[0] == pytest.approx(math.log(2))  # step 0: policy = reference
    final = metrics.tail(DPO_FINAL_STEPS)
    steps, loss, chosen, rejected, margin, accuracy = table["dpo"]
    assert int(steps) == STEPS
    assert float(loss) == pytest.approx(final["dpo_loss"].mean(), abs=1e-4)
    assert float(chosen) == pytest.approx(final["dpo_chosen_reward"].mean(), abs=1e-4)
    assert float(rejected) == pytest.approx(final["dpo_rejected_reward"].mean(), abs=1e-4)
    assert float(margin) == pytest.approx(final["dpo_margin"].mean(), abs=1e-4)
    assert float(accuracy) == pytest.approx(final["dpo_accuracy"].mean(), abs=1e-3)
    assert 0 < final["dpo_accuracy"].mean() < 1 and abs(final["dpo_margin"].mean()) > 1e-3  # the rows differ

    assert re.search(r"!\[[^]]*\]\(plots/dpo_dpo\.png\)", md)
    assert not (tmp_path / "report" / "plots" / "dpo_sft.png").exists()
    with Image.open(tmp_path / "report" / "plots" / "dpo_dpo.png") as image:
        assert image.width > 1000 and image.height > 600


def test_report_without_dpo_stages_has_no_dpo_section(tmp_path, one_process_group):
    sft = write_dpo_metrics(tmp_path / "train" / "sft", 4, sft=True)
    md = write_report(tmp_path / "report", train={"sft": sft}).read_text()
    assert "## DPO" not in md
    assert not list((tmp_path / "report" / "plots").glob("dpo_*.png"))
