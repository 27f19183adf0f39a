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
        runtime=config["train"]["runtime_minutes"],
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
        runtime=30,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        # A scaling point is a fresh measurement: never resume an earlier one.
        "rm -rf {params.dir} && mkdir -p {params.dir}"
        " && printf '%s\\n' {params.settings} > {params.dir}/stage_config.yaml"
        " && bash {params.launcher} {params.nodes} {params.nproc} {params.dir}/stage_config.yaml > {log} 2>&1"
