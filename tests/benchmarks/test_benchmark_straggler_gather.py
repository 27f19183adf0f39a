"""benchmarks/straggler_gather.py, the cost of the straggler gather, runs end to end at its smallest
setting (2 gloo ranks, 20 gathers) and writes its table and results file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_straggler_gather_is_timed_on_two_ranks(tmp_path):
    script = REPO / "benchmarks" / "straggler_gather.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(
        [*command, "--gathers", "20", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "straggler gather, 2 gloo ranks, 20 gathers" in proc.stdout
    assert "per step, interval 10 (us)" in proc.stdout
    result = json.loads((tmp_path / "straggler_gather_2ranks.json").read_text())
    assert result["gathers"] == 20 and result["world_size"] == 2 and result["torch"] == torch.__version__
    assert 0 < result["median_s"] <= result["p90_s"] < 5
