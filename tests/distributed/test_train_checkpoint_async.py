"""Async checkpoints written by DCP's process-based checkpointer keep the checkpoints' guarantees: a
run killed (the trainer and its writer process, as a node failure kills them) while a save is being
written in the background leaves only a `.tmp` that is never loaded, `latest` still names the save
before it, and the rerun resumes from that one and ends with the weights of an uninterrupted run bit
for bit. Each save's blocking and background times are in metrics.jsonl."""

import os
import signal
import subprocess
import time

import torch
from helpers import command, env, load_dcp, read_metrics, train, write_config

from vlmcore.tiny import tiny_snapshot

STEPS = 20
INTERVAL = 4


def latest(out):
    marker = out / "checkpoints" / "latest"
    return marker.read_text() if marker.exists() else None


def logged_step(out):
    metrics = read_metrics_safely(out)
    return metrics[-1]["step"] if metrics else 0


def read_metrics_safely(out):
    try:
        return read_metrics(out)
    except ValueError:  # a line being written
        return []


def test_run_killed_during_a_background_save_resumes_exactly(tmp_path):
    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    checkpoint = {"interval": INTERVAL, "keep": 2, "async": True, "async_mode": "process"}
    cfg = write_config(tmp_path / "async.yaml", snapshot, tmp_path / "run", steps=STEPS, checkpoint=checkpoint)
    reference = tmp_path / "reference"
    train(1, cfg, f"output_dir={reference}", "checkpoint.async=false")

    out = tmp_path / "run"
    trainer = subprocess.Popen(
        command(1, "train", str(cfg)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(env(), PYTHONUNBUFFERED="1"),
        start_new_session=True,  # the trainer and its checkpoint writer, killed together
    )
    # A save published (`latest`), the next one's files being written (`step_N.tmp`) and training on past it.
    deadline = time.time() + 400
    saving = None
    while trainer.poll() is None and time.time() < deadline:
        published = latest(out)
        pending = sorted((out / "checkpoints").glob("step_*.tmp")) if (out / "checkpoints").exists() else []
        if published and pending:
            step = int(pending[-1].name.removeprefix("step_").removesuffix(".tmp"))
            if logged_step(out) > step:
                saving = pending[-1]
                break
        time.sleep(0.005)
    assert saving is not None, f"no background save was caught:\n{trainer.communicate()[0][-3000:]}"
    os.killpg(trainer.pid, signal.SIGKILL)
    trainer.communicate(timeout=60)
    step = int(saving.name.removeprefix("step_").removesuffix(".tmp"))
    resumable = latest(out)
    assert resumable == f"step_{step - INTERVAL}" and not (out / "checkpoints" / f"step_{step}").exists()

    resumed = train(1, cfg)
    assert f"resumed from {out / 'checkpoints' / resumable} at step {step - INTERVAL}" in resumed.stdout
    assert not list((out / "checkpoints").glob("*.tmp"))
    expected, got = load_dcp(reference / "final"), load_dcp(out / "final")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    # Every save published during a run is in its metrics: training held up, and written behind it.
    timings = [m for m in read_metrics(out) if "checkpoint_step" in m]
    assert timings and all(m["checkpoint_blocking_s"] > 0 and m["checkpoint_background_s"] > 0 for m in timings)
    assert any(m.get("checkpoint_in_background") for m in read_metrics(out))
    assert f"checkpoint step_{STEPS}: training blocked" in resumed.stdout
