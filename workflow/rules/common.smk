# Validation and paths. The logic lives in vlmcore.workflow so it is tested without Snakemake.
import os
import re

from vlmcore.eval.benchmarks.registry import BENCHMARKS
from vlmcore.workflow import Experiment, as_yaml_arg, check_kernels, validate_config

validate_config(config, workflow.source_path("../schemas/config.schema.yaml"))
EXP = Experiment(config)
# The GPU kernels' versions for the cluster's GPU, here on the login node: never after the queue wait.
check_kernels(config, {stage: EXP.stage_config(stage) for stage in EXP.stages})
R = EXP.root
STAGES = EXP.stages
DATASETS = list(config["data"]["datasets"])
WORLD_SIZES = config["scaling"]["world_sizes"]
EXPORTED = EXP.exported_stages
TASKS = EXP.eval_tasks
LAUNCHER = f"{workflow.basedir}/workflow/scripts/launch_torchrun.sh"


def scaling_geometry(world_size):
    """(nodes, processes per node) of one scaling point (validate_config checked that it divides)."""
    per_node = min(world_size, config["train"]["nproc_per_node"])
    return world_size // per_node, per_node


def train_signal(wc):
    """SIGUSR1 before the time limit: the trainers save a checkpoint and exit, and Snakemake's
    retry resumes. Only for `mpi` jobs: a single rank runs inside the plugin's own `srun`,
    where the signal would also kill the Snakemake process waiting for it."""
    if EXP.stage_ranks(wc.stage) == 1:
        return ""
    return f" --signal=USR1@{min(600, EXP.stage_runtime(wc.stage) * 10)}"


wildcard_constraints:
    stage="|".join(STAGES),
    dataset="|".join(DATASETS),
    ws=r"\d+",
    task="|".join(map(re.escape, TASKS)),
    benchmark="|".join(map(re.escape, BENCHMARKS)),


localrules:
    download_model,
    mix_data,
    download_benchmark,
    scaling_report,
    train_all,
