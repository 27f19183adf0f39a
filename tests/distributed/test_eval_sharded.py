"""`vlmcore eval` data parallel: under torchrun the samples of each task are split among the
processes (here 2 on CPU, gloo), and the first writes results equal to one process's, sample for
sample."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_hf_snapshot

from vlmcore.data.synthetic.image import generate

pytestmark = pytest.mark.slow
LIMIT = 9


def eval_command(model: Path, raw: Path, out: Path) -> list[str]:
    return [
        "-m",
        "vlmcore.cli",
        "eval",
        "--model",
        str(model),
        "--tasks",
        "demo_vqa,demo_vqa_gen",
        "--vqa-data",
        str(raw / "eval.jsonl"),
        "--out",
        str(out),
        "--limit",
        str(LIMIT),
        "--batch-size",
        "4",
    ]


def samples(out: Path, task: str) -> dict:
    rows = [json.loads(line) for line in (out / f"samples_{task}.jsonl").read_text().splitlines()]
    return {row["doc_id"]: row for row in rows}


def test_two_processes_give_the_results_of_one(tmp_path):
    model = tiny_hf_snapshot("qwen3_vl", tmp_path / "model")
    generate(tmp_path / "raw", num_train=2, num_eval=12, seed=3)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    for launcher, out in ((torchrun, tmp_path / "two"), ([sys.executable], tmp_path / "one")):
        proc = subprocess.run(
            [*launcher, *eval_command(model, tmp_path / "raw", out)], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = json.loads((tmp_path / "one/results.json").read_text())
    two = json.loads((tmp_path / "two/results.json").read_text())
    assert two["results"] == one["results"] and two["breakdown"] == one["breakdown"]
    assert two["n-samples"]["demo_vqa"]["effective"] == LIMIT
    for task in ("demo_vqa", "demo_vqa_gen"):
        by_one = samples(tmp_path / "one", task)
        by_two = samples(tmp_path / "two", task)
        assert sorted(by_two) == list(range(LIMIT))  # each sample once, from both processes
        for doc_id, row in by_one.items():
            assert by_two[doc_id]["filtered_resps"] == row["filtered_resps"], (task, doc_id)
