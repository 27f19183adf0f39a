"""Faults that must not lose compute or leave output that looks complete: a 2-process torchrun
run that loses one rank, then the whole job, then reaches its time limit, each at a random step,
ends with the weights of an uninterrupted run bit for bit; an export killed mid-write leaves no
directory at `--out`, and the rerun finishes it.

The steps are drawn from a seed printed by the test (VLMCORE_FAULT_SEED=<seed> repeats a run)."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, env, load_dcp, read_metrics, tiny_hf_snapshot, train, write_config, write_final_checkpoint
from transformers import AutoModelForCausalLM

from vlmcore.export import export_hf
from vlmcore.tiny import tiny_snapshot

pytestmark = pytest.mark.slow
STEPS = 16
LAUNCHER = REPO / "workflow" / "scripts" / "launch_torchrun.sh"


def last_step(out: Path) -> int:
    """The last step rank 0 logged (a line being written is not counted)."""
    steps = []
    for line in (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            pass
    return steps[-1] if steps else 0


def worker_pids(torchrun: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of the trainer processes torchrun started."""
    children = Path(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        environ = dict(
            item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
        )
        if "RANK" in environ:
            ranks[int(environ["RANK"])] = pid
    return ranks


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    mask = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(mask >> (signum - 1) & 1)


def run_until(cfg: Path, out: Path, step: int, fault, ready=None) -> tuple[subprocess.CompletedProcess, int]:
    """Starts the 2-process run the way the workflow does (launch_torchrun.sh outside SLURM: torchrun
    --standalone), applies `fault(torchrun)` once rank 0 has logged `step` (or once `ready(torchrun)`),
    and returns the finished process and the last step it logged (read once it has ended)."""
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # the launcher runs `torchrun`
    torchrun = subprocess.Popen(
        ["bash", str(LAUNCHER), "1", "2", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env(), PATH=path),
    )
    ready = ready or (lambda t: last_step(out) >= step)
    deadline = time.time() + 240
    while not ready(torchrun) and torchrun.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    reached = last_step(out)
    assert torchrun.poll() is None and reached < STEPS, (
        f"the run ended before step {step}:\n{torchrun.communicate()[1][-3000:]}"
    )
    fault(torchrun)
    stdout, stderr = torchrun.communicate(timeout=240)
    return subprocess.CompletedProcess(torchrun.args, torchrun.returncode, stdout, stderr), last_step(out)


def resumed_step(stdout: str, out: Path) -> int:
    line = next(line for line in stdout.splitlines() if line.startswith(f"resumed from {out / 'checkpoints'}"))
    return int(line.rsplit(" ", 1)[1])


def test_two_process_run_killed_at_random_steps_ends_bit_identical(tmp_path):
    seed = int(os.environ.get("VLMCORE_FAULT_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    print(f"VLMCORE_FAULT_SEED={seed}")
    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    checkpoint = {"interval": 1, "keep": 2}
    reference = write_config(
        tmp_path / "reference.yaml", snapshot, tmp_path / "reference", steps=STEPS, checkpoint=checkpoint
    )
    train(2, reference)
    out = tmp_path / "faulty"
    cfg = write_config(tmp_path / "faulty.yaml", snapshot, out, steps=STEPS, checkpoint=checkpoint)
    why = f"(VLMCORE_FAULT_SEED={seed})"

    # 1. One trainer dies (SIGKILL, as the OOM killer or a lost GPU would): torchrun stops the other.
    rank = rng.choice([0, 1])
    proc, reached = run_until(cfg, out, rng.randint(2, 4), lambda t: os.kill(worker_pids(t)[rank], signal.SIGKILL))
    assert proc.returncode == 1 and "exitcode  : -9" in proc.stderr, (why, proc.stderr[-3000:])
    assert not (out / "done").exists()

    # 2. The whole job dies (node failure): every process at once (the trainers have sessions of their own).
    def kill_all(torchrun):
        for pid in [*worker_pids(torchrun).values(), torchrun.pid]:
            os.kill(pid, signal.SIGKILL)

    proc, reached2 = run_until(cfg, out, reached + rng.randint(1, 3), kill_all)
    assert proc.returncode == -signal.SIGKILL, (why, proc.stderr[-3000:])
    # a step is logged, then saved: the last logged step or the one before it is the last saved one
    assert reached - 1 <= resumed_step(proc.stdout, out) <= reached, why

    # 3. The time limit: SLURM's SIGUSR1 to torchrun; the trainers save at the end of the step and exit.
    proc, reached3 = run_until(cfg, out, reached2 + rng.randint(1, 3), lambda t: t.send_signal(signal.SIGUSR1))
    assert proc.returncode != 0 and not (out / "done").exists(), (why, proc.stderr[-3000:])
    assert reached2 - 1 <= resumed_step(proc.stdout, out) <= reached2, why
    saved = int((out / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert (
        saved == reached3 < STEPS and f"signal {int(signal.SIGUSR1)}: checkpoint saved at step {saved}" in proc.stdout
    ), why

    # 4. The warning comes while the trainers start (a slow model load): they resume, have trained
    # nothing since the checkpoint, and exit at once; SIGUSR1's default action would kill them.
    trainers_catch_it = lambda t: (
        len(pids := worker_pids(t)) == 2 and all(catches(p, signal.SIGUSR1) for p in pids.values())
    )
    proc, reached4 = run_until(cfg, out, 0, lambda t: t.send_signal(signal.SIGUSR1), ready=trainers_catch_it)
    assert proc.returncode != 0 and resumed_step(proc.stdout, out) == saved, (why, proc.stderr[-3000:])
    assert f"signal {int(signal.SIGUSR1)} before the first step at step {saved}" in proc.stdout, (
        why,
        proc.stdout[-3000:],
    )
    assert reached4 == last_step(out) == saved and (out / "checkpoints" / "latest").read_text() == f"step_{saved}", why

    proc = train(2, cfg)
    assert resumed_step(proc.stdout, out) == saved and (out / "done").exists(), why
    expected, got = read_metrics(tmp_path / "reference"), read_metrics(out)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1)), why
    assert [(m["loss"], m["grad_norm"]) for m in got] == [(m["loss"], m["grad_norm"]) for m in expected], why
    ref_weights, weights = load_dcp(tmp_path / "reference" / "final"), load_dcp(out / "final")
    assert weights.keys() == ref_weights.keys() and all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights), (
        why
    )


def test_export_killed_mid_write_leaves_nothing_at_out_and_the_rerun_completes(tmp_path):
    """The export is killed (SIGKILL) after its weights are written and before the snapshot's
    config and tokenizer are copied: `--out` must not exist, and the next export cleans up."""
    snapshot = tiny_hf_snapshot("qwen3", tmp_path / "model")
    final = write_final_checkpoint(AutoModelForCausalLM.from_pretrained(snapshot), tmp_path / "train" / "stage1")
    out = tmp_path / "hf"
    die_at_first_copy = (
        "import os, shutil, signal, sys; "
        "shutil.copy2 = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL); "
        "from vlmcore.cli import main; sys.exit(main())"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            die_at_first_copy,
            "export",
            "--checkpoint",
            str(final),
            "--model",
            str(snapshot),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    (partial,) = tmp_path.glob(".hf.tmp-*")
    assert (partial / "model.safetensors").is_file() and not (partial / "config.json").exists()
    assert not out.exists()

    export_hf(final, snapshot, out)
    assert not list(tmp_path.glob(".hf.tmp-*"))
    assert {"config.json", "model.safetensors", "provenance.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    trained, exported = load_dcp(final), AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(v, trained[f"model.{k}"]) for k, v in exported.items() if k != "lm_head.weight")
