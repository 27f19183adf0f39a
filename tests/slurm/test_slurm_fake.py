"""The SLURM profiles end to end against fake SLURM commands (tests/slurm/fake_slurm): the real
Snakemake and SLURM executor plugin submit a 4-node training stage of the Qwen3-VL-8B recipe
on each cluster, and the test checks the exact sbatch, srun and torchrun command lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
FAKES = REPO / "tests" / "slurm" / "fake_slurm"
LAUNCHER = REPO / "workflow" / "scripts" / "launch_torchrun.sh"

pytestmark = pytest.mark.workflow


def run_stage1(tmp_path, cluster):
    """Submit stage1 of config/experiments/qwen3vl-8b-<cluster>.yaml; returns (calls, root)."""
    recipe = REPO / "config" / "experiments" / f"qwen3vl-8b-{cluster}.yaml"
    config = yaml.safe_load(recipe.read_text())
    root = tmp_path / "results" / config["experiment"]
    # The inputs of stage1 exist already: only the training job is submitted.
    (root / "model").mkdir(parents=True)
    (root / "model" / "manifest.json").write_text("{}")
    (root / "packed" / "llava_pretrain").mkdir(parents=True)
    state = tmp_path / "fake_slurm"
    state.mkdir()
    env = dict(
        os.environ,
        PATH=f"{FAKES}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        FAKE_SLURM_DIR=str(state),
        FAKE_SLURM_ACCOUNT="ehpc01",
        VLMCORE_CLUSTER=cluster,
        VLMCORE_ACCOUNT="ehpc01",
        VLMCORE_QOS_ACC="acc_ehpc",
        VLMCORE_QOS_GPP="gp_ehpc",
    )
    target = f"results/{config['experiment']}/train/stage1/done"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--profile",
            str(REPO / "profiles" / cluster),
            "--configfile",
            str(recipe),
            "--directory",
            str(tmp_path),
            "--slurm-init-seconds-before-status-checks",
            "1",
            "--seconds-between-status-checks",
            "1",
            target,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    logs = "\n".join(p.read_text() for p in tmp_path.glob(".snakemake/slurm_logs/**/*.log"))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    assert (tmp_path / target).is_file()
    calls = [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]
    return calls, root


def only(calls, cmd):
    return [c for c in calls if c["cmd"] == cmd]


@pytest.mark.parametrize(
    "cluster, account_qos, cpus_per_task, cpus_per_node",
    [
        ("mn5", ["-A", "ehpc01", "-p", "acc", "-t", "1440", "--qos=acc_ehpc"], 20, 80),
        ("jupiter", ["-A", "ehpc01", "-p", "booster", "-t", "720"], 72, 288),
    ],
)
def test_four_node_training_stage(tmp_path, cluster, account_qos, cpus_per_task, cpus_per_node):
    calls, root = run_stage1(tmp_path, cluster)

    [sbatch] = only(calls, "sbatch")
    argv = sbatch["argv"]
    run_uuid = argv[argv.index("--job-name") + 1]
    assert argv[:-1] == [
        "--parsable",
        "--job-name",
        run_uuid,
        "--output",
        f"{tmp_path}/.snakemake/slurm_logs/rule_train_stage/stage1/%j.log",
        "--export=ALL",
        "--comment",
        "rule_train_stage_wildcards_stage1",
        *account_qos,
        "--nodes=4",
        "--ntasks=16",
        f"--cpus-per-task={cpus_per_task}",
        "--ntasks-per-node=4",
        "--signal=USR1@600",
        "-D",
        str(tmp_path),
        "--gres=gpu:4",
    ]
    # The batch step runs the rule itself (the `mpi` resource), not inside the plugin's srun.
    assert argv[-1].startswith(f"--wrap={sys.executable} -m snakemake ")
    assert "--executor slurm-jobstep" in argv[-1]

    stage_config = f"results/{root.name}/train/stage1/stage_config.yaml"
    [srun] = only(calls, "srun")
    assert srun["argv"] == [
        "--nodes=4",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus_per_node}",
        "--cpu-bind=none",
        "--kill-on-bad-exit=1",
        "bash",
        str(LAUNCHER),
        "4",
        "4",
        stage_config,
    ]
    # The jobstep plugin strips SLURM's variables from the batch step: the launcher must not need them.
    assert sorted(k for k in srun["env"] if k.startswith("SLURM_")) == ["SLURM_JOBID", "SLURM_JOB_ID"]

    job_id = int(srun["env"]["SLURM_JOB_ID"])
    entry = ["-m", "vlmcore.cli"]
    if cluster == "jupiter":
        entry = [
            "--no-python",
            "bash",
            "-c",
            'exec numactl --cpunodebind="$LOCAL_RANK" --membind="$LOCAL_RANK" python "$@"',
            "numa_bind",
            *entry,
        ]
    torchruns = sorted(only(calls, "torchrun"), key=lambda c: int(c["env"]["SLURM_NODEID"]))
    assert [c["argv"] for c in torchruns] == [
        [
            "--nnodes",
            "4",
            "--node-rank",
            str(rank),
            "--nproc-per-node",
            "4",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"node1:{20000 + job_id % 20000}",
            "--rdzv-id",
            str(job_id),
            "--rdzv-conf",
            f"is_host={int(rank == 0)}",
            "--shutdown-timeout",
            "300",
            "--max-restarts",  # resilience.max_restarts' default: restarts inside the job
            "2",
            *entry,
            "train",
            stage_config,
        ]
        for rank in range(4)
    ]
    for call in torchruns:
        env = call["env"]
        assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == "1"
        assert env["WANDB_MODE"] == "offline"
        assert env["NCCL_SOCKET_IFNAME"] == "ib0"
        assert "SIGUSR1" in env["TORCHELASTIC_SIGNALS_TO_HANDLE"].split(",")

    written = json.loads((tmp_path / stage_config).read_text())
    assert written["output_dir"] == f"results/{root.name}/train/stage1"
    assert written["parallel"]["tp"] == 1
