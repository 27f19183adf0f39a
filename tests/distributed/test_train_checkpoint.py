"""Checkpoints: atomic layout, resume after SIGTERM / SIGUSR1 and after SIGKILL bit for bit, a
crash between the last checkpoint and final/, a truncated or bit-flipped latest checkpoint, a
save on a full disk, and resharding to other world sizes and TP degrees."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import REPO, env, load_dcp, read_metrics, start_train, train, write_config
from safetensors.torch import load_file

from vlmcore.tiny import tiny_snapshot
from vlmcore.train.checkpoint import checkpoint_problem

pytestmark = pytest.mark.slow
STEPS = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ckpt")
    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    cfg = write_config(tmp_path / "full.yaml", snapshot, tmp_path / "full", steps=STEPS)
    train(1, cfg)
    return tmp_path, snapshot


def interrupted_run(tmp_path, snapshot, name, sig, interval, wait_for):
    out = tmp_path / name
    cfg = write_config(tmp_path / f"{name}.yaml", snapshot, out, steps=STEPS, checkpoint={"interval": interval})
    proc = start_train(cfg)
    deadline = time.time() + 120
    while not wait_for(out) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before it could be interrupted:\n{proc.communicate()[1][-3000:]}"
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    return cfg, out, proc.returncode, stdout


def assert_same_run(tmp_path, out):
    reference = read_metrics(tmp_path / "full")
    resumed = read_metrics(out)
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in reference]
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in reference]
    ref_weights, weights = load_dcp(tmp_path / "full" / "final"), load_dcp(out / "final")
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def test_signal_saves_and_resume_is_bit_exact(setup):
    """SIGUSR1 is what SLURM sends before the time limit (SIGTERM takes the same path)."""
    tmp_path, snapshot = setup
    sig = signal.SIGUSR1
    cfg, out, code, stdout = interrupted_run(
        tmp_path, snapshot, f"signal{int(sig)}", sig, interval=0, wait_for=lambda out: len(read_metrics(out)) >= 3
    )
    assert code == 128 + sig
    step = int((out / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert 3 <= step < STEPS and not (out / "done").exists()
    assert f"checkpoint saved at step {step}" in stdout
    train(1, cfg)
    assert (out / "done").exists()
    assert_same_run(tmp_path, out)


def test_sigkill_resumes_from_the_last_complete_checkpoint(setup):
    tmp_path, snapshot = setup
    cfg, out, code, _ = interrupted_run(
        tmp_path,
        snapshot,
        "killed",
        signal.SIGKILL,
        interval=4,
        wait_for=lambda out: (out / "checkpoints" / "latest").exists() and len(read_metrics(out)) >= 6,
    )
    assert code == -signal.SIGKILL
    # A half-written step (as left by a kill during a save) is never loaded, and is cleaned up.
    (out / "checkpoints" / "step_999.tmp").mkdir()
    proc = train(1, cfg)
    assert "resumed from" in proc.stdout and not (out / "checkpoints" / "step_999.tmp").exists()
    assert_same_run(tmp_path, out)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["latest", "step_20", f"step_{STEPS}"]  # keep: 2
    assert (out / "checkpoints" / "latest").read_text() == f"step_{STEPS}"


@pytest.fixture(scope="module")
def crashed(setup):
    """A run that saved its last step (every step checkpointed, keep 2), then died writing final/."""
    tmp_path, snapshot = setup
    out = tmp_path / "crashed"
    cfg = write_config(tmp_path / "crashed.yaml", snapshot, out, steps=STEPS, checkpoint={"interval": 1, "keep": 2})
    out.mkdir()
    (out / "final.tmp").write_text("a file where save_final wants a directory: it raises")
    proc = train(1, cfg, check=False)
    assert proc.returncode == 1 and "NotADirectoryError" in proc.stderr, proc.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text() == f"step_{STEPS}"
    assert not (out / "final").exists() and not (out / "done").exists()
    (out / "final.tmp").unlink()
    return out


def copy_of_crashed(setup, crashed, name):
    tmp_path, snapshot = setup
    out = tmp_path / name
    shutil.copytree(crashed, out)
    cfg = write_config(tmp_path / f"{name}.yaml", snapshot, out, steps=STEPS, checkpoint={"interval": 1, "keep": 2})
    return cfg, out


def test_crash_before_final_is_finished_without_retraining(setup, crashed):
    tmp_path, _ = setup
    cfg, out = copy_of_crashed(setup, crashed, "finished")
    proc = train(1, cfg)
    assert f"resumed from {out / 'checkpoints' / f'step_{STEPS}'} at step {STEPS}" in proc.stdout
    assert "no training" in proc.stdout and "loss" not in proc.stdout
    assert (out / "done").exists() and not (out / "previous").exists()
    assert_same_run(tmp_path, out)


def cut_in_half(data):
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)


def change_a_byte(data):
    """Same size, other bytes (a bad copy, a storage fault): only the manifest's sha256 sees it."""
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize(
    "damage, problem", [(cut_in_half, "is truncated"), (change_a_byte, "does not match its sha256")]
)
def test_damaged_latest_checkpoint_falls_back_to_the_one_before(setup, crashed, damage, problem):
    tmp_path, _ = setup
    cfg, out = copy_of_crashed(setup, crashed, damage.__name__)
    (data,) = (out / "checkpoints" / f"step_{STEPS}").glob("*.distcp")
    damage(data)
    proc = train(1, cfg)
    assert f"step_{STEPS} is damaged, not resumed from: {data.name} {problem}" in proc.stdout
    assert f"resumed from {out / 'checkpoints' / f'step_{STEPS - 1}'} at step {STEPS - 1}" in proc.stdout
    assert_same_run(tmp_path, out)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["latest", f"step_{STEPS - 1}", f"step_{STEPS}"]


def test_full_disk_during_a_save_keeps_the_checkpoint_before_it(setup, crashed):
    """The run resumes at step 23 on a disk with room for less than one more checkpoint: saving
    step 24 fails with a message that says so, step 23 stays intact, and once there is room the
    rerun resumes from it and ends bit for bit like the uninterrupted run."""
    tmp_path, snapshot = setup
    disk = tmp_path / "small_disk"
    disk.mkdir()
    used = sum(f.stat().st_size for f in crashed.rglob("*") if f.is_file() and f"step_{STEPS}" not in f.parts)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={used + 2**20}", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here (needs root): {mount.stderr.strip()}")
    try:
        out = disk / "run"
        shutil.copytree(crashed, out, ignore=shutil.ignore_patterns(f"step_{STEPS}"))
        (out / "checkpoints" / "latest").write_text(f"step_{STEPS - 1}")
        cfg = write_config(
            tmp_path / "full_disk.yaml", snapshot, out, steps=STEPS, checkpoint={"interval": 1, "keep": 2}
        )
        proc = train(1, cfg, check=False)
        failed = out / "checkpoints" / f"step_{STEPS}.tmp"
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert f"error: checkpoint {failed} could not be written: the disk is full" in proc.stderr
        assert (out / "checkpoints" / "latest").read_text() == f"step_{STEPS - 1}"
        assert checkpoint_problem(out / "checkpoints" / f"step_{STEPS - 1}", (0, 1)) is None
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        proc = train(1, cfg)
        assert f"resumed from {out / 'checkpoints' / f'step_{STEPS - 1}'} at step {STEPS - 1}" in proc.stdout
        assert_same_run(tmp_path, out)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_done_stage_exits_at_once(setup):
    tmp_path, _ = setup
    proc = train(1, tmp_path / "full.yaml")
    assert "already trained" in proc.stdout


def dump_state(nproc, cfg, out_file):
    args = [str(REPO / "tests" / "helpers.py"), "dump-state", str(cfg), str(out_file)]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert proc.returncode == 0, proc.stderr[-5000:]
    return load_file(out_file)


def test_checkpoint_of_two_processes_reshards(setup):
    """Written by 2 FSDP processes; loaded by 1 process and by 4 (dp 2 x tp 2): the same model
    and optimizer state, and the model is the one the writer finished with. In bf16 compute, so the
    one process is the one-rank cast's plain module (vlmcore.parallel.fsdp.OneRankMixedPrecision;
    the other way round in tests/parallel/test_parallel_fsdp_one_rank.py)."""
    tmp_path, snapshot = setup
    out = tmp_path / "reshard"
    bf16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    cfg = write_config(tmp_path / "reshard.yaml", snapshot, out, steps=3, checkpoint={"interval": 0}, precision=bf16)
    train(2, cfg)
    one = dump_state(1, cfg, tmp_path / "one.safetensors")
    assert int(one["train.step"]) == 3 and any(k.endswith("exp_avg_sq") for k in one)
    final = load_dcp(out / "final")
    assert all(torch.equal(one[k], final[k]) for k in final)
    four_cfg = write_config(tmp_path / "reshard_tp.yaml", snapshot, out, steps=3, parallel={"tp": 2}, precision=bf16)
    four = dump_state(4, four_cfg, tmp_path / "four.safetensors")
    assert four.keys() == one.keys()
    assert all(torch.equal(four[k], one[k]) for k in one)
