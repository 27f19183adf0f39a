"""benchmarks/cp_step.py, the command that takes the GPU step times under context parallelism,
runs end to end at its CPU scale (--tiny: 2 gloo processes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cp_step_tiny_runs_the_loop_at_each_cp_and_writes_json(tmp_path):
    """The real `vlmcore train` loop at cp 1 (dp_shard 2) and cp 2 (dp_shard 1) on one row length
    (the --tiny default has two: 50 s here), one table and the JSON with a figure per case."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "cp_step.py"),
            "--tiny",
            "--lengths",
            "256",
            "--cache",
            str(tmp_path / "cache"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("tiny Qwen3-VL shape, 2 x CPU")[-1]
    assert "seq_len  cp dp_shard   step s  tokens/s/GPU" in table and table.count("\n     256   ") == 2
    written = json.loads((tmp_path / "cp_step_cpu_tiny.json").read_text())
    assert written["complete"] and written["nproc"] == 2 and written["torch"] == torch.__version__
    assert [(c["seq_len"], c["cp"], c["dp_shard"], c["status"]) for c in written["cases"]] == [
        (256, 1, 2, "ok"),
        (256, 2, 1, "ok"),
    ]
    for case in written["cases"]:
        assert case["step_s"] > 0 and case["tokens_per_s_per_gpu"] > 0 and case["peak_gib"] > 0
