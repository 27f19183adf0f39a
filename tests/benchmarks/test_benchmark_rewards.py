"""benchmarks/rewards.py, what the reward workers cost against the same rewards inline, runs end
to end at its smallest setting (batches of 1 and 64, 2 repeats) and writes its table and results
file."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import env

REPO = Path(__file__).resolve().parents[2]


def test_the_reward_workers_are_timed_against_inline_calls(tmp_path):
    script = REPO / "benchmarks" / "rewards.py"
    command = [sys.executable, str(script), "--completions", "1", "64", "--repeats", "2", "--out", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reward workers, rewards ['math', 'format']" in proc.stdout
    assert "overhead us/completion" in proc.stdout
    result = json.loads((tmp_path / "rewards.json").read_text())
    assert [row["completions"] for row in result["batches"]] == [1, 64]
    for row in result["batches"]:
        assert row["inline_s"] > 0 and 0 < row["one_worker_s"] < 10 and 0 < row["two_workers_s"] < 10
    assert 0 < result["start_two_workers_s"] < 60 and 0 < result["replace_worker_s"] < 60
