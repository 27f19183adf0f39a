"""The SLURM path on a real SLURM: the two-node cluster of .ci/slurm_setup.sh (or any cluster
where `sinfo` works and two nodes can run CPU jobs). A training stage runs through the
executor as a 2-node job: `srun` one task per node, torchrun with c10d rendezvous, gloo; and a
stage cut by its time limit resumes in the retry (the video demo through SLURM:
tests/slurm/test_slurm_demo.py).

In CI (CI=true) a missing SLURM is a failure; elsewhere these tests are skipped.
"""

import json
import math

import pytest
import yaml
from helpers import slurm_jobs, snakemake_on_slurm, write_experiment_config

pytestmark = [pytest.mark.workflow, pytest.mark.slow]


def random_data_experiment(tmp_path, name, steps, interval, runtime_minutes):
    """One 2-node stage on random batches: it needs the model (download_model builds it) but
    no data; its packed dataset exists only as an empty folder."""
    configfile, root = write_experiment_config(
        tmp_path,
        name,
        nodes=2,
        nproc_per_node=1,
        runtime_minutes=runtime_minutes,
        **{
            "stages": {"stage1": {"dataset": "random", "steps": steps, "trainable": []}},
            "common": {
                "data": {"kind": "random", "seq_len": 128},
                "checkpoint": {"interval": interval, "keep": 2},
                "precision": {"param_dtype": "float32", "reduce_dtype": "float32"},
            },
        },
    )
    config = yaml.safe_load(configfile.read_text())
    config["data"] = {"datasets": {"random": {"sources": ["text:unused.jsonl"]}}}
    config["scaling"] = {"world_sizes": [2]}
    configfile.write_text(yaml.safe_dump(config))
    (root / "packed" / "random").mkdir(parents=True)
    return configfile, root


def metric_steps(root):
    return [json.loads(line)["step"] for line in (root / "train" / "stage1" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_node_stage(slurm, tmp_path_factory):
    """A 12-step training stage as one 2-node SLURM job; the time-limit test also reads its
    step time to size a run that cannot fit in one allocation on this machine."""
    tmp_path = tmp_path_factory.mktemp("slurm2n")
    configfile, root = random_data_experiment(tmp_path, "slurm2n", steps=12, interval=0, runtime_minutes=10)
    snakemake_on_slurm(tmp_path, configfile, "results/slurm2n/train/stage1/done")
    return tmp_path, root


def test_training_stage_runs_as_two_node_srun_torchrun_job(two_node_stage):
    tmp_path, root = two_node_stage
    [job] = slurm_jobs(tmp_path, "train_stage").values()
    assert (job["NumNodes"], job["NumTasks"], job["JobState"]) == ("2", "2", "COMPLETED")
    log = (root / "logs" / "train_stage" / "stage1.log").read_text()
    records = [json.loads(line) for line in (root / "train" / "stage1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert {r["world_size"] for r in records} == {2}, log
    assert (root / "train" / "stage1" / "final").is_dir()


def test_stage_cut_by_time_limit_resumes_in_retry(two_node_stage, tmp_path):
    # 3-minute allocations: SIGUSR1 is asked for 30 s before the limit (SLURM may send it up to
    # 60 s earlier), the trainers checkpoint and exit, and Snakemake's retry resumes. After a
    # start-up of 25-40 s an allocation trains for 50-125 s, never 150 s. The steps take 150 s at
    # the fastest pace measured, so no allocation can run them all from scratch, even on a machine
    # quieter than when the pace was measured (up to 1.2 times faster): the first allocation that
    # trains a step is cut and saves a checkpoint, and a later one resumes it, also when the first
    # allocation is cut while its trainers start and saves nothing. That is 2 or 3 allocations on a
    # quiet machine, more on a busy one. A fixed step count does not work (300 steps fit in one
    # allocation on a quiet CI machine, 7 on a busy one); 2-minute allocations trained for 0-75 s
    # each (CI once took 5 of them, 570 s, for 150 s of steps).
    step_times = [
        json.loads(line)["step_time_s"]
        for line in (two_node_stage[1] / "train" / "stage1" / "metrics.jsonl").read_text().splitlines()
    ]
    fastest = min(step_times[2:])
    steps = max(60, math.ceil(150 / fastest))
    configfile, root = random_data_experiment(tmp_path, "slurmcut", steps=steps, interval=0, runtime_minutes=3)
    snakemake_on_slurm(tmp_path, configfile, "results/slurmcut/train/stage1/done", "--retries", "20", timeout=3600)

    jobs = list(slurm_jobs(tmp_path, "train_stage").values())
    assert len(jobs) >= 2, f"{steps} steps at {fastest:.3f} s/step or slower fit in one allocation"
    # Every cut job ended by itself before the limit (the signal), not by SLURM killing it.
    assert [(j["JobState"], j["Reason"]) for j in jobs[:-1]] == [("FAILED", "NonZeroExitCode")] * (len(jobs) - 1)
    assert jobs[-1]["JobState"] == "COMPLETED"
    # Checkpoints are saved only on the signal (interval 0), and each step ran exactly once
    # over all allocations: every retry resumed where the cut job stopped.
    assert metric_steps(root) == list(range(1, steps + 1))
    log = (root / "logs" / "train_stage" / "stage1.log").read_text()
    assert "resumed from" in log, f"{len(jobs)} allocations, {steps} steps at {fastest:.3f} s/step:\n{log[-3000:]}"
    assert (root / "train" / "stage1" / "done").is_file()
    # The stage's train.log holds every allocation's output, each under its SLURM job id.
    attempts = (root / "train" / "stage1" / "train.log").read_text().split("== vlmcore train_stage attempt ")[1:]
    assert [a.split("SLURM job ")[1].split()[0] for a in attempts] == [j["JobId"] for j in jobs]
    # An allocation resumes once an earlier one saved a checkpoint, also when the signal comes
    # while its trainers start (they resume and exit at once). Only trainers the signal reached
    # before they ran (no `kernels:` line: torchrun still starting) resume nothing.
    started = ["kernels:" in a for a in attempts]
    saved_before = [any("checkpoint saved at step" in b for b in attempts[:i]) for i in range(len(attempts))]
    assert sum(saved_before) >= 1 and [("resumed from" in a) for a in attempts] == [
        st and sb for st, sb in zip(started, saved_before)
    ]
