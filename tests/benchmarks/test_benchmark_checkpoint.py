"""benchmarks/checkpoint.py runs on CPU through the trainer's own Checkpointer: a synchronous save and
the process-based async one, the async one holding training up for less than the synchronous save
takes, its probe steps run beside the writer, and the results file has every row."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_checkpoint_benchmark_measures_blocking_and_background_time(tmp_path):
    out = tmp_path / "checkpoint.json"
    command = [sys.executable, str(REPO / "benchmarks" / "checkpoint.py"), "--sizes", "4e6"]
    proc = subprocess.run(
        [*command, "--modes", "sync", "process", "--dir", str(tmp_path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src")),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["mode"] for row in rows] == ["sync", "process"]
    sync, process = rows
    assert sync["parameters"] == process["parameters"] == 2048**2  # 4e6 parameters: one 2048 x 2048 layer
    # fp32 weights and two fp32 moments in the rank's files, a step count per weight and the rest
    assert 12 * sync["parameters"] <= sync["bytes_rank0_files"] < 12 * sync["parameters"] * 1.01
    assert sync["blocking_s"] == sync["total_s"] and sync["ratio_to_sync"] == 1.0
    assert 0 < process["blocking_s"] < process["total_s"] and process["ratio_to_sync"] > 0
    assert " process blocking " in proc.stdout
