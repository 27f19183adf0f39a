"""benchmarks/eval_throughput.py, the command that takes the evaluation speed figures, runs end to
end at its smallest size (CPU, the demo's tiny model): a row per task and batch size, and our
generated answers equal transformers' `generate` on the same prompts, and the video tasks' answers
with two decoding workers equal those decoded in process. Nothing here is timed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGE_TASKS = ["demo_vqa", "demo_vqa_gen"]
VIDEO_TASKS = ["demo_video_qa", "bench_video_qa_gen"]


@pytest.mark.slow
def test_smallest_run_writes_every_row_and_generations_agree(tmp_path):
    # One batch size of two: batched scoring and generation, each task evaluated once (every
    # evaluation pays lm-eval's start-up of several seconds).
    # The video tasks also with two decoding workers.
    command = [sys.executable, str(REPO / "benchmarks/eval_throughput.py"), "--limit", "3", "--batch-sizes", "2"]
    command += ["--video-workers", "0,2"]
    proc = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "eval_throughput_cpu.json").read_text())
    rows = {(row["task"], row["batch_size"], row["video_workers"]): row for row in result["rows"]}
    expected = [(task, 2, 0) for task in IMAGE_TASKS] + [(task, 2, w) for task in VIDEO_TASKS for w in (0, 2)]
    assert sorted(rows) == sorted(expected)
    for row in rows.values():
        assert row["questions"] == 3
        assert row["questions_per_s"] > 0 and row["model_seconds"] > 0
        assert row["same_answers_as_first_run"]
    # A multiple-choice question asks once per choice; a free-form one once.
    assert rows[("demo_vqa", 2, 0)]["requests"] > 3
    assert rows[("bench_video_qa_gen", 2, 0)]["requests"] == 3
    assert rows[("bench_video_qa_gen", 2, 2)]["requests"] == 3
    comparisons = result["generation_vs_transformers"]
    assert [c["batch_size"] for c in comparisons] == [2]
    for comparison in comparisons:
        assert comparison["same_answers"] == comparison["questions"] == 3, comparison["differing"]
        assert comparison["faster"] in ("vlmcore eval", "transformers generate")
    assert "free-form image answers" in proc.stdout and "bench_video_qa_gen" in proc.stdout
