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


# The demo packs each of its 2 datasets in 2 measure jobs, 1 plan job, 2 write jobs and the pack job.
PACK = {"pack_measure": 4, "pack_plan": 2, "pack_write": 4, "pack_data": 2}


@pytest.mark.parametrize(
    "target, expected",
    [
        ("model", {"download_model": 1}),
        ("data", {"synth_data": 1, "prepare_data": 2}),
        ("packed", {"download_model": 1, "synth_data": 1, "prepare_data": 2, **PACK}),
        ("train", {"download_model": 1, "synth_data": 1, "prepare_data": 2, **PACK, "train_stage": 2}),
        ("scaling", {"download_model": 1, "synth_data": 1, "prepare_data": 1, "pack_measure": 2, "pack_plan": 1,
                     "pack_write": 2, "pack_data": 1, "scaling_run": 2}),
        ("train_all", {"download_model": 1, "synth_data": 1, "prepare_data": 2, **PACK, "train_stage": 2,
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
