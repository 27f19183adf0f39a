"""benchmarks/post_training.py, the command that takes the LoRA and DPO step figures, runs end to end
at its smallest size (CPU, tiny model, 256 tokens, one timed step): the table and the JSON hold every
row with sane fields. Nothing here is timed against a bound."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RANKS = (4, 16)


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("post_training")
    command = [sys.executable, str(REPO / "benchmarks" / "post_training.py"), "--seq-len", "256"]
    command += ["--steps", "1", "--warmup", "1", "--ranks", *map(str, RANKS), "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads((out / "post_training_cpu_tiny.json").read_text())


@pytest.mark.slow
def test_lora_rows_match_peft_at_step_0(benchmark):
    """Both families (the MoE one through peft's target_parameters): the same adapters on both
    sides, the same first loss (the same row, images and weights)."""
    stdout, result = benchmark
    assert "LoRA step, vlmcore vs peft" in stdout and "step-0 loss" in stdout
    assert [case["family"] for case in result["lora"]] == ["qwen3_vl", "qwen3_vl_moe"]
    for case in result["lora"]:
        assert case["rank"] == RANKS[0]
        assert case["adapter_params"] == case["peft_adapter_params"] > 0
        assert abs(case["first_loss"]["vlmcore"] - case["first_loss"]["peft"]) < 1e-4
        assert set(case["results"]) == {"vlmcore", "peft"}
        for r in case["results"].values():
            assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["vs_peft"] > 0


@pytest.mark.slow
def test_checkpoint_holds_the_trained_parameters_and_their_adamw_state(benchmark):
    """Per LoRA rank and full fine-tuning: the checkpoint's trained tensors are the trained parameters,
    its optimizer tensors their two AdamW moments (and a step count each), and more adapters make a
    larger checkpoint; a LoRA checkpoint writes at most the tied LM head of the base (see the next test)."""
    stdout, result = benchmark
    assert "Optimizer step and checkpoint" in stdout
    rows = result["cost"]
    assert [r["rank"] for r in rows] == [*RANKS, 0]
    for r in rows:
        tensors = r["checkpoint_tensors"]["elements"]
        if r["rank"]:
            assert tensors["trained"] == r["trained_params"]
        else:  # full fine-tuning writes the tied embedding twice, under lm_head.weight too
            assert tensors["trained"] >= r["trained_params"]
        assert 2 * r["trained_params"] <= tensors["optimizer_state"] <= 2 * r["trained_params"] + 1000
        assert r["optimizer_s"] > 0 and r["save_s"] > 0 and r["checkpoint_bytes"] > 0
    lora = rows[:-1]
    assert lora[0]["trained_params"] < lora[1]["trained_params"] < rows[-1]["trained_params"]
    assert lora[0]["checkpoint_bytes"] < lora[1]["checkpoint_bytes"] < rows[-1]["checkpoint_bytes"]


@pytest.mark.slow
def test_a_lora_checkpoint_holds_no_base_weights(benchmark):
    """Not even the tied LM head, whose second name `ignore_frozen_params` does not drop."""
    _, result = benchmark
    for r in result["cost"][:-1]:
        assert r["checkpoint_tensors"]["base_weight_names"] == []


@pytest.mark.slow
def test_dpo_rows_compare_the_step_with_its_flops_prediction(benchmark):
    """Both references; the prediction is the SFT step's time plus a forward at its rate: 4/3 of the
    SFT step under full fine-tuning, more under LoRA (whose step has no frozen weight gradients)."""
    stdout, result = benchmark
    assert "DPO step vs its FLOPs" in stdout
    rows = {r["reference"]: r for r in result["dpo"]}
    assert set(rows) == {"copy", "adapters_off"}
    assert rows["copy"]["rank"] == 0 and rows["adapters_off"]["rank"] == RANKS[0]
    for r in rows.values():
        assert r["pairs"] == 2 and r["sft_step_s"] > 0 and r["dpo_step_s"] > 0
        assert r["measured_over_predicted"] == pytest.approx(r["dpo_step_s"] / r["dpo_predicted_s"])
    copy = rows["copy"]
    assert copy["dpo_predicted_s"] == pytest.approx(4 / 3 * copy["sft_step_s"])
    lora = rows["adapters_off"]
    assert 4 / 3 < lora["dpo_predicted_s"] / lora["sft_step_s"] < 3 / 2
