"""The memory levers against the default path: `parallel.offload` (FSDP2's CPUOffloadPolicy) bit for
bit on one and two processes (data parallel and tensor parallel), `optimizer.moments_dtype:
bfloat16` within a stated tolerance over 50 steps; and the layouts offload cannot take, refused by
key before any work. One launch per world size (`train_cases`)."""

from pathlib import Path

import pytest
import torch
from helpers import load_dcp, read_metrics, train_cases, write_config

from vlmcore.config import ConfigError, load_config
from vlmcore.parallel.checks import check_run
from vlmcore.tiny import tiny_snapshot

# bfloat16 moments against float32 ones, tiny Qwen3, 50 steps at lr 1e-3: measured 3.2e-5 of the
# loss and 7.7e-4 of a weight tensor's norm (2-core CPU, torch 2.13.0); the bounds leave room.
BF16_LOSS_REL = 2e-4
BF16_WEIGHT_REL = 3e-3


def configs(tmp: Path, model: Path, cases: dict[str, dict], steps: int) -> list[Path]:
    return [write_config(tmp / f"{name}.yaml", model, tmp / name, steps=steps, **over) for name, over in cases.items()]


def assert_same_run(tmp: Path, a: str, b: str) -> None:
    """The same losses, gradient norms and final weights, bit for bit."""
    ma, mb = read_metrics(tmp / a), read_metrics(tmp / b)
    assert [(m["loss"], m["grad_norm"]) for m in ma] == [(m["loss"], m["grad_norm"]) for m in mb]
    wa, wb = load_dcp(tmp / a / "final"), load_dcp(tmp / b / "final")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_one_process_offload_exact_and_bf16_moments_close(tmp_path):
    vl = tiny_snapshot("qwen3_vl", tmp_path / "vl")
    text = tiny_snapshot("qwen3", tmp_path / "text")
    bf16 = {"optimizer": {"lr": 1.0e-3, "moments_dtype": "bfloat16"}}
    runs = configs(
        tmp_path, vl, {"plain": {}, "offload": {"parallel": {"offload": True, "one_rank_cast": False}}}, steps=6
    )
    runs += configs(tmp_path, text, {"moments32": {}, "moments16": bf16}, steps=50)
    train_cases(1, runs)
    assert_same_run(tmp_path, "plain", "offload")

    m32, m16 = read_metrics(tmp_path / "moments32"), read_metrics(tmp_path / "moments16")
    assert len(m32) == len(m16) == 50
    assert max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(m32, m16)) < BF16_LOSS_REL
    w32, w16 = load_dcp(tmp_path / "moments32" / "final"), load_dcp(tmp_path / "moments16" / "final")
    drift = {k: ((w32[k] - w16[k]).norm() / w32[k].norm()).item() for k in w32}
    assert 0 < max(drift.values()) < BF16_WEIGHT_REL, drift  # rounded moments, a small drift
    # The checkpoint holds the moments in bfloat16, the step counts as torch's AdamW keeps them.
    state = load_dcp(tmp_path / "moments16" / "checkpoints" / "step_50")
    moments = {k: v.dtype for k, v in state.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments and set(moments.values()) == {torch.bfloat16}
    assert {v.dtype for k, v in state.items() if k.startswith("model.")} == {torch.float32}


def test_two_processes_offload_exact_under_fsdp_and_tp(tmp_path):
    vl = tiny_snapshot("qwen3_vl", tmp_path / "vl")
    cases = {
        "fsdp": {},
        "fsdp_offload": {"parallel": {"offload": True}},
        "tp": {"parallel": {"tp": 2}},
        "tp_offload": {"parallel": {"tp": 2, "offload": True}},
    }
    train_cases(2, configs(tmp_path, vl, cases, steps=4))
    assert_same_run(tmp_path, "fsdp", "fsdp_offload")
    assert_same_run(tmp_path, "tp", "tp_offload")


@pytest.mark.parametrize(
    ("sets", "world", "message"),
    [
        (["parallel.offload=true"], 1, "parallel.one_rank_cast: true replaces"),
        (
            [
                "parallel.offload=true",
                "parallel.modules.vision.ranks=[0, 1]",
                "parallel.modules.language.ranks=[1, 2]",
            ],
            2,
            "disjoint module layouts",
        ),
    ],
)
def test_offload_refused_where_it_cannot_apply(tmp_path, sets, world, message):
    vl = tiny_snapshot("qwen3_vl", tmp_path / "vl")
    cfg = load_config(write_config(tmp_path / "c.yaml", vl, tmp_path / "out"), sets)
    with pytest.raises(ConfigError, match=message) as error:
        check_run(cfg, world)
    assert error.value.key == "parallel.offload"
    assert not (tmp_path / "out").exists()
