"""Hangs leave a trace and slow ranks are named: one 2-process run, started the way the workflow
starts a stage (launch_torchrun.sh, torchrun with one restart allowed), whose rank 1 sleeps before
every step (a straggler) and stops joining collectives at step 3 on the first start (a hang). Rank
0's collective times out after resilience.collective_timeout_s, both ranks dump their flight
recorders, torchrun restarts the ranks and they finish the stage from the latest checkpoint."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, env, read_metrics, write_config
from PIL import Image

from vlmcore.report.scaling import write_report
from vlmcore.tiny import tiny_snapshot

pytestmark = pytest.mark.slow
LAUNCHER = REPO / "workflow" / "scripts" / "launch_torchrun.sh"
STEPS = 6
HANG_STEP = 3
INTERVAL = 2  # resilience.straggler_interval


@pytest.fixture(scope="module")
def hung_then_restarted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resilience")
    out = tmp / "stage"
    cfg = write_config(
        tmp / "stage.yaml",
        tiny_snapshot("qwen3", tmp / "model"),
        out,
        steps=STEPS,
        checkpoint={"interval": 1, "keep": 2},
        resilience={
            "max_restarts": 1,
            "collective_timeout_s": 5,
            "straggler_interval": INTERVAL,
            "straggler_margin": 0.3,
        },
    )
    faults = f"hang rank=1 step={HANG_STEP}; slow rank=1 seconds=0.4"
    proc = subprocess.run(
        ["bash", str(LAUNCHER), "1", "2", str(cfg)],
        capture_output=True,
        text=True,
        timeout=400,
        env=dict(
            env(),
            PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            VLMCORE_MAX_RESTARTS="1",
            VLMCORE_TEST_FAULT=faults,
        ),
    )
    return proc, out


def test_the_restart_takes_over_after_the_hang(hung_then_restarted):
    proc, out = hung_then_restarted
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "restart 1 of at most 1 inside this job" in proc.stdout
    assert f"resumed from {out / 'checkpoints' / f'step_{HANG_STEP - 1}'} at step {HANG_STEP - 1}" in proc.stdout
    assert [m["step"] for m in read_metrics(out)] == list(range(1, STEPS + 1))
    assert (out / "done").exists()


def test_the_hang_leaves_each_ranks_last_collectives_naming_the_stuck_one(hung_then_restarted):
    proc, out = hung_then_restarted
    assert "rank 0: a collective failed" in proc.stdout and "Timed out waiting 5000ms" in proc.stdout, proc.stdout
    # One folder per start of the ranks: only the first start failed.
    [dumps] = [d for d in (out / "flight_recorder").iterdir() if any(d.iterdir())]
    assert dumps.name.endswith("_restart0") and sorted(p.name for p in dumps.iterdir()) == ["rank_0", "rank_1"]
    # torch's own analyser reads them and names the collective rank 1 never joined.
    analysis = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = analysis.stdout + analysis.stderr
    assert analysis.returncode == 0, report
    assert "Not all ranks joining collective" in report and "missing ranks: {1}" in report, report
    assert "collective: gloo:all_reduce" in report and "global_counts" in report, report


def test_the_slow_rank_is_named_with_its_host_in_the_metrics_and_the_log(hung_then_restarted):
    proc, out = hung_then_restarted
    gathers = [m for m in read_metrics(out) if m["step"] % INTERVAL == 0]
    assert [m["step"] for m in gathers] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    host = socket.gethostname()
    for m in gathers:
        busy = m["rank_busy_s"]
        assert len(busy) == 2 and busy[1] - busy[0] > 0.3, m  # rank 1's sleep, and none of rank 0's wait
        [straggler] = m["stragglers"]
        assert (straggler["rank"], straggler["host"]) == (1, host), m
        assert straggler["busy_s"] == busy[1] and straggler["over_median"] > 0.3
    assert not any("stragglers" in m for m in read_metrics(out) if m["step"] % INTERVAL)
    assert f"step {INTERVAL}: stragglers: rank 1 on {host} (" in proc.stdout, proc.stdout


def test_the_report_plots_each_ranks_step_time_and_names_the_straggler(hung_then_restarted, tmp_path):
    _, out = hung_then_restarted
    # The same run as a training stage and as a scaling point of this experiment.
    metrics = out / "metrics.jsonl"
    report = write_report(tmp_path / "report", scaling={"ws2": metrics}, train={"stage1": metrics}).read_text()
    gathers = STEPS // INTERVAL
    host = socket.gethostname()
    for run in ("scaling_ws2", "stage1"):
        assert f"`{run}`: stragglers named: rank 1 on {host}: {gathers} of {gathers} gathers" in report, report
        assert f"![{run}: per-rank step time](plots/rank_times_{run}.png)" in report
        with Image.open(tmp_path / "report" / "plots" / f"rank_times_{run}.png") as image:
            assert image.width > 500 and image.height > 300
