"""metrics.profile_steps (vlmcore.train.profiling): the real loop traces the chosen steps and says
where their time went."""

import gzip
import json

import pytest
import torch
from helpers import train, write_config
from torch.profiler import ProfilerActivity, profile

from vlmcore.config import ConfigError, from_dict
from vlmcore.tiny import tiny_snapshot
from vlmcore.train.profiling import busy_time_us, device_figures, idle_gaps_us, summarize


def test_busy_time_is_the_union_of_the_intervals():
    # Overlapping kernels on two streams count once; a gap counts not at all.
    assert busy_time_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert busy_time_us([(3, 4), (0, 10)]) == 10
    assert busy_time_us([]) == 0
    assert idle_gaps_us([(0, 10), (5, 15), (20, 25), (21, 22), (30, 31)]) == [5, 5]
    assert idle_gaps_us([]) == []


def test_the_gpu_figures_read_the_trace():
    """The CUDA branch on trace events as torch.profiler exports them on a GPU (the categories
    and names seen in an H200 trace): two steps, kernels on two streams, one copy to the host."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst", "ts": 0, "dur": 400},
        {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel", "ts": 300, "dur": 200},  # another stream
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "ts": 2500, "dur": 10},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 2530, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "multi_tensor_apply_kernel", "ts": 2560, "dur": 40},
        *[
            {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": 0, "dur": 1}
            for name in (
                "cudaLaunchKernel",
                "cudaLaunchKernel",
                "cuLaunchKernel",
                "cudaStreamSynchronize",
                "cudaMemcpyAsync",
            )
        ],
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
    ]
    assert device_figures(events, wall_s=0.004, steps=2) == [
        "gpu_busy_s 0.0006 (14.2% of wall)",  # 0-500, 2500-2510, 2530-2550, 2560-2600: 570 us
        "gpu_idle_s 0.0020 between the first and last device operation: 0.0020 in gaps of 1 ms or more, "
        "0.0000 in gaps under 50 us",
        "host_syncs 0.5 a step",
        "copies_to_host 0.5 a step",
        "launches 2 a step",
    ]


def test_the_summary_of_a_cpu_profile():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    text = summarize(prof, [], wall_s=0.5, steps=2, cuda=False)
    assert text.startswith("profiled steps: 2, wall_s 0.5000 (0.2500 a step)") and "aten::mm" in text
    assert "gpu_busy_s" not in text
    # The GPU's table sort key exists on a CPU profile too.
    assert "aten::mm" in summarize(prof, [], wall_s=0.5, steps=2, cuda=True)


def test_profile_steps_are_checked():
    with pytest.raises(ConfigError, match="metrics.profile_steps"):
        from_dict({"model_path": "m", "output_dir": "o", "metrics": {"profile_steps": [0, 2]}})
    with pytest.raises(ConfigError, match=r"metrics.profile_steps: must be steps the run reaches \(<= steps\)"):
        from_dict(
            {
                "model_path": "m",
                "output_dir": "o",
                "steps": 3,
                "data": {"kind": "random"},
                "metrics": {"profile_steps": [3, 4]},
            }
        )


def test_the_loop_traces_the_chosen_steps(tmp_path):
    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    out = tmp_path / "run"
    train(
        1,
        write_config(
            tmp_path / "run.yaml",
            snapshot,
            out,
            steps=3,
            save_final=False,
            checkpoint={"enabled": False},
            metrics={"tensorboard": False, "profile_steps": [2, 3]},
        ),
    )
    summary = (out / "profile" / "rank0_summary.txt").read_text()
    assert summary.startswith("profiled steps: 2, wall_s ")
    trace = json.loads(gzip.decompress((out / "profile" / "rank0_trace.json.gz").read_bytes()))
    names = [e.get("name", "") for e in trace["traceEvents"]]
    # Two whole steps, from the data to the optimizer: two optimizer steps, the forward passes' matmuls.
    # (The optimizer is vlmcore.train.optim.LocalShardAdamW, torch's AdamW on the local shards.)
    assert sum(n.startswith("Optimizer.step#LocalShardAdamW.step") for n in names) == 2
    assert any(n == "aten::mm" for n in names)
