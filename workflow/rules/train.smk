# SLURM geometry of the torchrun jobs (the local executor ignores it): one allocation task
# per rank (`gres` and `cpus_per_task` per rank come from the cluster profile), and the `mpi`
# resource whenever there is more than one rank, so that the jobstep plugin runs the rule body
# in the batch step and launch_torchrun.sh starts its own `srun`, one task per node.
TRAIN_RANKS = config["train"]["nodes"] * config["train"]["nproc_per_node"]
# SIGUSR1 before the time limit: the trainers save a checkpoint and exit, and Snakemake's retry
# resumes. Only for `mpi` jobs: a single rank runs inside the plugin's own `srun`, where the
# signal would also kill the Snakemake process waiting for it.
TRAIN_SIGNAL = f" --signal=USR1@{min(600, config['train']['runtime_minutes'] * 10)}" if TRAIN_RANKS > 1 else ""


rule train_stage:
    # Checkpoints under train/<stage>/checkpoints are deliberately not outputs: Snakemake
    # deletes the outputs of a failed job, and a killed or timed-out job must keep them so
    # that the retry (or the next run) resumes from the latest one.
    input:
        unpack(lambda wc: EXP.stage_inputs(wc.stage)),
    output:
        final=directory(f"{R}/train/{{stage}}/final"),
        done=f"{R}/train/{{stage}}/done",
    params:
        settings=lambda wc: as_yaml_arg(EXP.stage_config(wc.stage)),
        dir=lambda wc: EXP.path("train", wc.stage),
        launcher=LAUNCHER,
        nodes=config["train"]["nodes"],
        nproc=config["train"]["nproc_per_node"],
    log:
        f"{R}/logs/train_stage/{{stage}}.log",
    threads: config["train"]["nproc_per_node"]
    resources:
        nodes=config["train"]["nodes"],
        tasks=TRAIN_RANKS,
        mpi="srun" if TRAIN_RANKS > 1 else None,
        tasks_per_gpu=0,
        mem_mb=0,
        runtime=config["train"]["runtime_minutes"],
        slurm_extra=f"--ntasks-per-node={config['train']['nproc_per_node']}{TRAIN_SIGNAL}",
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "mkdir -p {params.dir} && printf '%s\\n' {params.settings} > {params.dir}/stage_config.yaml"
        " && bash {params.launcher} {params.nodes} {params.nproc} {params.dir}/stage_config.yaml >> {log} 2>&1"


rule scaling_run:
    input:
        data=f"{R}/packed/{EXP.scaling_dataset()}",
        model=f"{R}/model/manifest.json",
    output:
        metrics=f"{R}/scaling/ws{{ws}}/metrics.jsonl",
    params:
        settings=lambda wc: as_yaml_arg(EXP.scaling_config(int(wc.ws))),
        dir=lambda wc: EXP.path("scaling", f"ws{wc.ws}"),
        launcher=LAUNCHER,
        nodes=lambda wc: scaling_geometry(int(wc.ws))[0],
        nproc=lambda wc: scaling_geometry(int(wc.ws))[1],
    log:
        f"{R}/logs/scaling_run/ws{{ws}}.log",
    threads: lambda wc: scaling_geometry(int(wc.ws))[1]
    resources:
        nodes=lambda wc: scaling_geometry(int(wc.ws))[0],
        tasks=lambda wc: int(wc.ws),
        mpi=lambda wc: "srun" if int(wc.ws) > 1 else None,
        tasks_per_gpu=0,
        mem_mb=0,
        runtime=30,
        # A scaling point is not resumed: no checkpoint signal.
        slurm_extra=lambda wc: f"--ntasks-per-node={scaling_geometry(int(wc.ws))[1]}",
    conda:
        "../envs/vlmcore.yaml"
    shell:
        # A scaling point is a fresh measurement: never resume an earlier one.
        "rm -rf {params.dir} && mkdir -p {params.dir}"
        " && printf '%s\\n' {params.settings} > {params.dir}/stage_config.yaml"
        " && bash {params.launcher} {params.nodes} {params.nproc} {params.dir}/stage_config.yaml > {log} 2>&1"
