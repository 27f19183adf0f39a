# Validation and paths. The logic lives in vlmcore.workflow so it is tested without Snakemake.
import os

from vlmcore.workflow import Experiment, as_yaml_arg, validate_config

validate_config(config, workflow.source_path("../schemas/config.schema.yaml"))
EXP = Experiment(config)
R = EXP.root
STAGES = EXP.stages
DATASETS = list(config["data"]["datasets"])
WORLD_SIZES = config["scaling"]["world_sizes"]
LAUNCHER = f"{workflow.basedir}/workflow/scripts/launch_torchrun.sh"


def scaling_geometry(world_size):
    """(nodes, processes per node) of one scaling point."""
    per_node = min(world_size, config["train"]["nproc_per_node"])
    if world_size % per_node:
        raise ValueError(f"scaling.world_sizes: {world_size} is not a multiple of train.nproc_per_node={per_node}")
    return world_size // per_node, per_node


wildcard_constraints:
    stage="|".join(STAGES),
    dataset="|".join(DATASETS),
    ws=r"\d+",


localrules:
    download_model,
    scaling_report,
    train_all,
