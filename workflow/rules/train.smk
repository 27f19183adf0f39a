# SLURM geometry of the torchrun jobs (the local executor ignores it): one allocation task
# per rank (`gres` and `cpus_per_task` per rank come from the cluster profile), and the `mpi`
# resource whenever there is more than one rank, so that the jobstep plugin runs the rule body
# in the batch step and launch_torchrun.sh starts its own `srun`, one task per node.
# Node counts and time limits may differ per stage (train.stages.<stage>.nodes / runtime_minutes).


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
        nodes=lambda wc: EXP.stage_nodes(wc.stage),
        nproc=config["train"]["nproc_per_node"],
        restarts=lambda wc: EXP.stage_restarts(wc.stage),
    log:
        f"{R}/logs/train_stage/{{stage}}.log",
    threads: config["train"]["nproc_per_node"]
    resources:
        nodes=lambda wc: EXP.stage_nodes(wc.stage),
        tasks=lambda wc: EXP.stage_ranks(wc.stage),
        mpi=lambda wc: "srun" if EXP.stage_ranks(wc.stage) > 1 else None,
        tasks_per_gpu=0,
        mem_mb=0,
        runtime=lambda wc: EXP.stage_runtime(wc.stage),
        slurm_extra=lambda wc: f"--ntasks-per-node={config['train']['nproc_per_node']}{train_signal(wc)}",
    conda:
        "../envs/vlmcore.yaml"
    # Snakemake empties {log} before every attempt; train/<stage>/train.log keeps the output of
    # all of them (a cut allocation or a node failure stays readable after the retry). tee
    # ignores INT/TERM so that it outlives the trainers saving their checkpoint on SIGTERM.
    # A stage whose trainers wrote `done` is finished even if torchrun then failed: the time
    # limit's signal can reach torchrun after the trainers wrote done, while they exit, and
    # Snakemake would delete final/ and done of a failed job.
    shell:
        "set -o pipefail; mkdir -p {params.dir} && printf '%s\\n' {params.settings} > {params.dir}/stage_config.yaml"
        " && echo \"== vlmcore train_stage attempt $(date -Is), SLURM job ${{SLURM_JOB_ID:-none}} ==\" >> {params.dir}/train.log"
        " && VLMCORE_MAX_RESTARTS={params.restarts} bash {params.launcher} {params.nodes} {params.nproc} {params.dir}/stage_config.yaml 2>&1"
        " | (trap '' INT TERM; tee -a {params.dir}/train.log) >> {log}"
        " || test -f {output.done}"


rule mix_data:
    # A stage on a weighted mix of datasets (train.stages.<stage>.datasets) reads this blend file
    # of their packed datasets (vlmcore.blend; Experiment.stage_blend writes its content).
    input:
        lambda wc: [EXP.path("packed", d) for d in EXP.stage_datasets(wc.stage)],
    output:
        f"{R}/train/{{stage}}/data_mix.yaml",
    params:
        blend=lambda wc: as_yaml_arg(EXP.stage_blend(wc.stage)),
    log:
        f"{R}/logs/mix_data/{{stage}}.log",
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "printf '%s\\n' {params.blend} > {output} 2> {log}"


rule scaling_run:
    input:
        data=EXP.scaling_data(),
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


rule estimate_memory:
    # `snakemake ... memory` before queueing the training jobs: each stage's peak memory per
    # GPU at its rank count, estimated on fake tensors on a CPU (`vlmcore memory`): the model's
    # config.json and the packed dataset's limits are all it reads.
    input:
        model=f"{R}/model/manifest.json",
        data=lambda wc: EXP.stage_inputs(wc.stage)["data"],
    output:
        estimate=f"{R}/memory/{{stage}}.json",
        table=f"{R}/memory/{{stage}}.txt",
    params:
        settings=lambda wc: as_yaml_arg(EXP.stage_config(wc.stage)),
        config=lambda wc: EXP.path("memory", f"{wc.stage}_config.yaml"),
        ranks=lambda wc: EXP.stage_ranks(wc.stage),
        fit=EXP.memory_fit_flags(),
    log:
        f"{R}/logs/estimate_memory/{{stage}}.log",
    resources:
        # One core: about a minute for Qwen3-VL, about 12 for Qwen3.5-9B (docs/performance.md).
        runtime=60,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "printf '%s\\n' {params.settings} > {params.config}"
        # A stage that does not fit fails here; its table stays in the log.
        " && vlmcore memory {params.config} --world-size {params.ranks} {params.fit} --json {output.estimate}"
        " > {output.table} 2> {log} || {{ cat {output.table} >> {log}; exit 1; }}"
