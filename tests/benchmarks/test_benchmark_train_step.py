"""benchmarks/train_step.py, the command that takes the GPU figures, runs end to end (CPU, tiny)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_benchmark_prints_the_table_and_writes_json(tmp_path):
    """`--all --family qwen3_vl`: that family's part of the GPU table, compiled first, then eager;
    each case printed and written as it finishes, each with its own memory estimate (from a
    process of their own): the compiled case's models what compile saves; `--profile`: two bare
    steps and two of the loop traced, a summary beside each."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "train_step.py"),
            "--preset",
            "tiny",
            "--all",
            "--family",
            "qwen3_vl",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--profile",
            "--loop-set",
            "metrics.module_times=false",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for engine in ("vlmcore ", "transformers", "vlmcore train", "real loop / bare step time"):
        assert engine in proc.stdout, proc.stdout
    assert proc.stdout.count("tiny preset, CPU") == 3  # after each case, then the whole table
    written = json.loads((tmp_path / "train_step_cpu_tiny_all_qwen3_vl.json").read_text())
    assert written["complete"] and written["torch"] == torch.__version__
    assert [(c["family"], c["compile"]) for c in written["cases"]] == [("qwen3_vl", True), ("qwen3_vl", False)]
    for case in written["cases"]:
        assert set(case["results"]) == {"vlmcore", "transformers", "vlmcore train"}
        assert case["results"]["vlmcore"]["estimated_peak_gib"] > 0
        assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 for r in case["results"].values())
    compiled_estimate, eager_estimate = (c["results"]["vlmcore"]["estimated_peak_gib"] for c in written["cases"])
    assert compiled_estimate < eager_estimate
    assert written["cases"][0]["flops_per_step"] == written["cases"][1]["flops_per_step"]  # the same batch
    for kind, steps in (("bare", 2), ("loop", 1)):  # the loop traces the --steps 1 after its warmup
        for case in ("qwen3_vl_compile", "qwen3_vl"):
            folder = tmp_path / f"profile_{kind}_{case}"
            assert (folder / "rank0_summary.txt").read_text().startswith(f"profiled steps: {steps}, ")
            assert (folder / "rank0_trace.json.gz").stat().st_size > 0


@pytest.mark.slow
def test_benchmark_runs_a_moe_model_against_transformers(tmp_path):
    """The MoE case (8 experts, top-2, on CPU): the native step and transformers' on the same batch,
    FLOPs from the active parameters."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "train_step.py"),
            "--preset",
            "tiny",
            "--family",
            "qwen3_moe",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--skip-loop",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads((tmp_path / "train_step_cpu_tiny_qwen3_moe.json").read_text())["cases"]
    assert set(result["results"]) == {"vlmcore", "transformers"}
    assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 for r in result["results"].values())
    # 4 layers of attention (256 x 64 x 12) and router + 2 of 8 experts (256 x 8 + 2 x 3 x 256 x 384),
    # the LM head (256 x 4096): 6 FLOPs per weight and token; attention over the row's 2 random-length
    # segments costs 12 x layers x heads x head_dim x (sum of squared lengths), between 2 x 512^2 and
    # 1024^2. Counting all 8 experts would add 43 GFLOP, more than that whole range.
    active = 4 * (256 * 64 * 12 + 256 * 8 + 2 * 3 * 256 * 384) + 256 * 4096
    per_pair = 12 * 4 * 4 * 64
    assert (
        6 * active * 1024 + per_pair * 2 * 512**2 <= result["flops_per_step"] <= 6 * active * 1024 + per_pair * 1024**2
    )
