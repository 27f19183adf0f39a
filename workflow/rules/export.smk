rule export_hf:
    input:
        done=f"{R}/train/{EXP.last_stage}/done",
        model=f"{R}/model/manifest.json",
    output:
        directory(f"{R}/hf"),
    params:
        checkpoint=f"{R}/train/{EXP.last_stage}/final",
        model=lambda wc, input: os.path.dirname(input.model),
        stage_configs=" ".join(f"--stage-config {EXP.path('train', s, 'config.yaml')}" for s in STAGES),
        data_stats=" ".join(f"--data-stats {EXP.path('packed', d, 'stats.json')}" for d in DATASETS),
        max_shard_size=config["export"]["max_shard_size"],
        # The video sampling the last stage's data was packed with (pack.video), for the export.
        packed=EXP.path("packed", config["train"]["stages"][EXP.last_stage]["dataset"]),
    log:
        f"{R}/logs/export_hf.log",
    resources:
        runtime=60,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore export --checkpoint {params.checkpoint} --model {params.model} --out {output}"
        " {params.stage_configs} {params.data_stats} --packed-data {params.packed}"
        " --max-shard-size {params.max_shard_size} > {log} 2>&1"
