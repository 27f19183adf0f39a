"""benchmarks/train_step.py, the command that takes the GPU figures, runs end to end (CPU, tiny)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_benchmark_prints_the_table_and_writes_json(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "train_step.py"), "--preset", "tiny",
                           "--family", "qwen3_vl", "--steps", "1", "--warmup", "1", "--memory-estimate",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for engine in ("vlmcore ", "transformers", "vlmcore train", "real loop / bare step time"):
        assert engine in proc.stdout, proc.stdout
    (result,) = json.loads((tmp_path / "train_step_cpu_tiny_qwen3_vl.json").read_text())["cases"]
    assert set(result["results"]) == {"vlmcore", "transformers", "vlmcore train"}
    assert result["results"]["vlmcore"]["estimated_peak_gib"] > 0
    assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 for r in result["results"].values())
