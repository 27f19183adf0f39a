"""The workflow's shape: lint-clean, every target plans the right jobs, without running them."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def snakemake(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, capture_output=True, text=True)


def job_stats(output: str) -> dict:
    table = output.split("Job stats:")[1].split("total")[0]
    rows = [line.split() for line in table.strip().splitlines()[2:]]
    return {row[0]: int(row[1]) for row in rows if len(row) == 2}


def test_lint_is_clean():
    proc = snakemake("--lint")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "target, expected",
    [
        ("model", {"download_model": 1}),
        ("data", {"synth_data": 1, "prepare_data": 2}),
        ("packed", {"download_model": 1, "synth_data": 1, "prepare_data": 2, "pack_measure": 4, "pack_data": 2}),
        ("train", {"download_model": 1, "synth_data": 1, "prepare_data": 2, "pack_measure": 4, "pack_data": 2,
                   "train_stage": 2}),
        ("scaling", {"download_model": 1, "synth_data": 1, "prepare_data": 1, "pack_measure": 2, "pack_data": 1,
                     "scaling_run": 2}),
        ("train_all", {"download_model": 1, "synth_data": 1, "prepare_data": 2, "pack_measure": 4, "pack_data": 2,
                       "train_stage": 2,
                       "export_hf": 1, "evaluate": 1, "scaling_run": 2, "scaling_report": 1}),
    ],
)
def test_each_target_plans_its_stages(tmp_path, target, expected):
    proc = snakemake("-n", "--profile", str(REPO / "profiles/local"), "--snakefile", str(REPO / "Snakefile"),
                     "--configfile", str(REPO / "config/config.yaml"), "--directory", str(tmp_path), target)
    assert proc.returncode == 0, proc.stderr
    stats = job_stats(proc.stdout)
    stats.pop(target, None)
    assert stats == expected


def test_moe_demo_plans_the_demo_with_a_tiny_moe_model(tmp_path):
    """config/demo-moe.yaml: the demo's whole DAG, its tiny model a Qwen3-VL-MoE."""
    proc = snakemake("-n", "-p", "--profile", str(REPO / "profiles/local"), "--snakefile", str(REPO / "Snakefile"),
                     "--configfile", str(REPO / "config/demo-moe.yaml"), "--directory", str(tmp_path), "train_all")
    assert proc.returncode == 0, proc.stderr
    stats = job_stats(proc.stdout)
    stats.pop("train_all", None)
    assert stats == {"download_model": 1, "synth_data": 1, "prepare_data": 2, "pack_measure": 4, "pack_data": 2,
                     "train_stage": 2, "export_hf": 1, "evaluate": 1, "scaling_run": 2, "scaling_report": 1}
    assert "vlmcore download --tiny --tiny-family qwen3_vl_moe " in proc.stdout
    assert "results/demo-moe/model" in proc.stdout
