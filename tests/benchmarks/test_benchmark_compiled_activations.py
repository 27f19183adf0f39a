"""benchmarks/compiled_activations.py, what torch.compile saves of a decoder layer's activations,
runs on CPU and its model of the compiled peak agrees with the H200's measured peaks."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_compiled_layer_saves_less_and_predicts_the_h200_peaks(tmp_path):
    command = [sys.executable, str(REPO / "benchmarks" / "compiled_activations.py"), "--preset", "2b"]
    proc = subprocess.run(
        [*command, "--seq-len", "64", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "compiled_activations_cpu_2b.json").read_text())
    # The partitioner recomputes the elementwise ops: about 60% of the eager bytes are kept.
    assert 0.5 < result["ratio"] < 0.7, result
    assert result["eager_bytes_per_token"] > result["compiled_bytes_per_token"] > 0
    # Both families' H200 peaks (the results files in benchmarks/results) predicted within 10%.
    assert {row["family"] for row in result["predictions"]} == {"qwen3", "qwen3_vl"}
    for row in result["predictions"]:
        assert abs(row["error"]) < 0.10, row
    assert "| one layer |" in proc.stdout
