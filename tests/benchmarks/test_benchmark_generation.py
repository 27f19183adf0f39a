"""benchmarks/generation.py, the command that takes the generation speed figures, runs end to end
at its smallest size (CPU, the tiny Qwen3-VL and Qwen3.5): a row per preset with both
implementations' prefill and decode rates, and vlmcore's tokens equal transformers'. Nothing here
is timed."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_tiny_run_writes_both_rows_and_the_tokens_agree(tmp_path):
    out = tmp_path / "generation.json"
    command = [sys.executable, str(REPO / "benchmarks/generation.py"), "--preset", "tiny", "--repeats", "1"]
    proc = subprocess.run([*command, "--batch", "3", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["preset"] for row in result["rows"]] == ["tiny-qwen3_vl", "tiny-qwen3_5"]
    for row in result["rows"]:
        assert row["same_tokens"], row["preset"]
        assert row["batch"] == 3
        for impl in ("transformers", "vlmcore"):
            assert row[impl]["prefill_tokens_per_s"] > 0 and row[impl]["decode_tokens_per_s"] > 0
    assert "speed-up" in proc.stdout and result["machine"]["torch"]
