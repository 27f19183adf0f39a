"""A rank lost in the middle of a stage restarts inside its SLURM allocation: a 2-node stage (one
rank a node, srun -> torchrun with c10d rendezvous, gloo) whose rank 1 kills itself (SIGKILL) before
step 4 on its first start. torchrun restarts both nodes' ranks (resilience.max_restarts: 1), they
resume from the step-2 checkpoint, and the stage finishes in the same job, with the weights of an
uninterrupted run of the same stage config.

In CI (CI=true) a missing SLURM is a failure; elsewhere this test is skipped.
"""

import json

import pytest
import torch
import yaml
from helpers import load_dcp, read_metrics, slurm_jobs, train
from helpers import snakemake_on_slurm as snakemake
from helpers import write_experiment_config as write_config

pytestmark = [pytest.mark.workflow, pytest.mark.slow]
STEPS = 6
KILLED_AT = 4


def test_a_killed_rank_restarts_inside_the_allocation_and_ends_as_an_uninterrupted_run(slurm, tmp_path, monkeypatch):
    configfile, root = write_config(
        tmp_path,
        "slurmrestart",
        nodes=2,
        nproc_per_node=1,
        runtime_minutes=10,
        **{
            "stages": {"stage1": {"dataset": "random", "steps": STEPS, "trainable": []}},
            "common": {
                "data": {"kind": "random", "seq_len": 64},
                "checkpoint": {"interval": 2, "keep": 2},
                "precision": {"param_dtype": "float32", "reduce_dtype": "float32"},
                "resilience": {"max_restarts": 1},
                "metrics": {"tensorboard": False},
            },
        },
    )
    config = yaml.safe_load(configfile.read_text())
    config["data"] = {"datasets": {"random": {"sources": ["text:unused.jsonl"]}}}
    config["scaling"] = {"world_sizes": [2]}
    configfile.write_text(yaml.safe_dump(config))
    (root / "packed" / "random").mkdir(parents=True)

    # The test-only fault hook (vlmcore.train.resilience), passed through sbatch, srun and torchrun.
    monkeypatch.setenv("VLMCORE_TEST_FAULT", f"kill rank=1 step={KILLED_AT}")
    snakemake(tmp_path, configfile, "results/slurmrestart/train/stage1/done")
    monkeypatch.delenv("VLMCORE_TEST_FAULT")

    stage = root / "train" / "stage1"
    [job] = slurm_jobs(tmp_path, "train_stage").values()  # one allocation, no retry
    assert (job["NumNodes"], job["JobState"]) == ("2", "COMPLETED")
    log = (stage / "train.log").read_text()
    assert log.count("== vlmcore train_stage attempt ") == 1, log[-3000:]
    assert "restart 1 of at most 1 inside this job" in log, log[-3000:]
    assert "resumed from results/slurmrestart/train/stage1/checkpoints/step_2 at step 2" in log, log[-3000:]
    assert [m["step"] for m in read_metrics(stage)] == list(range(1, STEPS + 1))

    # The same stage config, uninterrupted, as 2 processes on this machine.
    reference = json.loads((stage / "stage_config.yaml").read_text())
    reference.update(model_path=str(tmp_path / reference["model_path"]), output_dir=str(tmp_path / "reference"))
    (tmp_path / "reference.yaml").write_text(yaml.safe_dump(reference))
    train(2, tmp_path / "reference.yaml")
    expected, got = load_dcp(tmp_path / "reference" / "final"), load_dcp(stage / "final")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    losses = [m["loss"] for m in read_metrics(stage)]
    assert losses == [m["loss"] for m in read_metrics(tmp_path / "reference")]
