"""benchmarks/eval_throughput.py, the command that takes the evaluation speed figures, runs end to
end at its smallest size (CPU, the demo's tiny model): a row per task, batch size, count of video
decoding workers and generator; the free-form answers of vlmcore's native decoder equal those of
transformers' `generate` (the before and after of the table), and the video tasks' answers with
two decoding workers equal those decoded in process. Nothing here is timed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATORS = ["transformers", "vlmcore"]


@pytest.mark.slow
def test_smallest_run_writes_every_row_and_generators_agree(tmp_path):
    # One batch size of two: batched scoring and generation, each task evaluated once per
    # generator and count of workers (every evaluation pays lm-eval's start-up of several seconds).
    command = [sys.executable, str(REPO / "benchmarks/eval_throughput.py"), "--limit", "3", "--batch-sizes", "2"]
    command += ["--video-workers", "0,2"]
    proc = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "eval_throughput_cpu.json").read_text())
    rows = {(row["task"], row["batch_size"], row["video_workers"], row["generator"]): row for row in result["rows"]}
    expected = [("demo_vqa", 2, 0, "-")] + [("demo_vqa_gen", 2, 0, g) for g in GENERATORS]
    expected += [("demo_video_qa", 2, w, "-") for w in (0, 2)]
    expected += [("bench_video_qa_gen", 2, w, g) for w in (0, 2) for g in GENERATORS]
    assert sorted(rows) == sorted(expected)
    for row in rows.values():
        assert row["questions"] == 3
        assert row["questions_per_s"] > 0 and row["model_seconds"] > 0
        assert row["same_answers_as_first_run"]
    # A multiple-choice question asks once per choice; a free-form one once.
    assert rows[("demo_vqa", 2, 0, "-")]["requests"] > 3
    for workers in (0, 2):
        for generator in GENERATORS:
            assert rows[("bench_video_qa_gen", 2, workers, generator)]["requests"] == 3
    comparisons = {(c["task"], c["video_workers"]): c for c in result["native_vs_transformers"]}
    assert sorted(comparisons) == [("bench_video_qa_gen", 0), ("bench_video_qa_gen", 2), ("demo_vqa_gen", 0)]
    for (task, workers), c in comparisons.items():
        assert c["same_answers"] and c["questions"] == 3 and c["batch_size"] == 2
        assert c["vlmcore_questions_per_s"] == rows[(task, 2, workers, "vlmcore")]["questions_per_s"]
        assert c["transformers_questions_per_s"] == rows[(task, 2, workers, "transformers")]["questions_per_s"]
        assert c["speedup"] > 0
    assert "transformers' generate (before) vs vlmcore's decoder (after)" in proc.stdout
    assert "bench_video_qa_gen" in proc.stdout
