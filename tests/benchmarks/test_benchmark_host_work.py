"""benchmarks/host_work.py, the CPU count of the training step's host work, runs end to end at its
smallest setting (--structure tiny: 2 layers, 2 vision blocks, 2 gloo ranks)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import env

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from host_work import SOURCES  # noqa: E402  (the benchmark is a script, not a package)


def run_host_work(*args: str) -> subprocess.CompletedProcess:
    """benchmarks/host_work.py with `args`, which must succeed."""
    command = [sys.executable, str(REPO / "benchmarks" / "host_work.py"), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env(), check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_host_work_counts_the_loop_step_by_source(tmp_path):
    """The real loop's step, profiled on 2 ranks: one table with a row per source and the total,
    and the JSON whose figures add up and show each source's work where the step has it."""
    proc = run_host_work("--structure", "tiny", "--out", str(tmp_path))
    assert "qwen3_vl, tiny structure (2 layers, 2 vision blocks" in proc.stdout
    table = proc.stdout.split("source ")[1].split("against the H200")[0]
    assert [line.split("  ")[0] for line in table.splitlines()[1:]] == [*SOURCES, "total"]

    written = json.loads((tmp_path / "host_work_cpu_tiny.json").read_text())
    assert written["complete"] and written["torch"] == torch.__version__ and written["step"] == "loop"
    (case,) = written["cases"]
    assert case["family"] == "qwen3_vl" and case["layers"] == 2 and case["vision_depth"] == 2
    # Two decoder blocks, the vision tower and the root: one FSDP group each.
    assert case["fsdp_groups"] == 4
    sources = case["sources"]
    assert list(sources) == list(SOURCES)
    for row in sources.values():
        assert row["copies"] + row["fills"] <= row["kernels"]
        assert row["host_ms"] >= 0
    # Every part of the step that dispatches work is seen where it runs.
    for source in ("FSDP all-gather", "FSDP reduce-scatter", "optimizer", "grad norm", "loss", "data"):
        assert sources[source]["kernels"] > 0, source
    compute = sources["forward/backward compute"]
    assert compute["ops"] == max(row["ops"] for row in sources.values())
    # Each FSDP group gathers its weights (a copy in and a copy out) at least once a step and reduces
    # its gradients once (one chunk_cat copy-in each); the optimizer runs the fused kernel.
    assert sources["FSDP all-gather"]["copies"] >= 2 * case["fsdp_groups"]
    assert case["ops_by_name"]["aten::_chunk_cat"] == case["fsdp_groups"]
    assert case["ops_by_name"]["aten::_fused_adamw_"] > 0
    # The optimizer steps the local shards: none of its calls goes through DTensor's dispatch.
    assert sources["optimizer"]["dtensor"] == 0
    # The sources' host times add up to the profiled step's (each event's own time counted once).
    assert sum(row["host_ms"] for row in sources.values()) == pytest.approx(case["step_ms"], rel=1e-6)


@pytest.mark.slow
def test_host_work_counts_the_moe_block_by_part_and_the_one_rank_cast(tmp_path):
    """The MoE step (--structure tiny-moe: 2 layers of 8 experts, the bare step on one rank): the
    block's forward counted by part, and the grouped GEMM, which the CPU runs expert by expert,
    counted as one kernel a call, as a GPU launches it. On one rank in bf16 there are no FSDP
    units: the weights' cast is one copy a step, the gradients' one per chunk (issue 43 item 3;
    its arithmetic in tests/parallel/test_parallel_fsdp_one_rank.py, the 2B presets' counts in docs/performance.md)."""
    from vlmcore.parallel.fsdp import GRAD_CAST_CHUNKS

    run_host_work("--structure", "tiny-moe", "--bare", "--nproc", "1", "--out", str(tmp_path))
    (case,) = json.loads((tmp_path / "host_work_cpu_tiny-moe_bare_1ranks.json").read_text())["cases"]
    assert case["family"] == "qwen3_vl_moe" and case["layers"] == 2
    assert case["fsdp_groups"] == 0
    weights = case["sources"]["FSDP all-gather"]
    grads = case["sources"]["FSDP reduce-scatter"]
    assert (weights["kernels"], weights["copies"]) == (1, 1)
    # One micro-batch a step: each chunk's gradients are cast into the weights' gradients, no sum.
    # (At most GRAD_CAST_CHUNKS: a weight larger than a chunk's share takes more than one's.)
    assert 1 < grads["kernels"] == grads["copies"] <= GRAD_CAST_CHUNKS
    assert case["ops_by_name"]["aten::_foreach_copy_"] == 1 + grads["kernels"]
    for part in ("MoE routing", "MoE experts", "MoE dispatch and combine"):
        assert case["sources"][part]["kernels"] > 0, part
    # Two grouped GEMMs a layer forward, more in backward; each one kernel, its per-expert
    # matmuls inside it none.
    grouped = case["kernels_by_name"]["aten::_grouped_mm"]
    assert grouped >= 2 * case["layers"] and grouped == case["ops_by_name"]["aten::_grouped_mm"]
    assert case["kernels_by_name"].get("aten::mm", 0) < case["ops_by_name"]["aten::mm"]
