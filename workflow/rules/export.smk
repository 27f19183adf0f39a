rule export_hf:
    # Every exported stage (export.stage and the stages before it) gets its own directory; a LoRA
    # stage's export also holds its adapters as a peft adapter directory, hf/<stage>/peft_adapter,
    # whose base is the export of the stage it started from. The provenance is the stage's lineage
    # (init_from after init_from): the inputs are its stages' done markers.
    input:
        unpack(lambda wc: EXP.export_inputs(wc.stage)),
    output:
        directory(f"{R}/hf/{{stage}}"),
    params:
        checkpoint=lambda wc: EXP.path("train", wc.stage, "final"),
        model=lambda wc, input: os.path.dirname(input.model),
        stage_configs=lambda wc: " ".join(f"--stage-config {p}" for p in EXP.export_provenance(wc.stage)["stage_configs"]),
        data_stats=lambda wc: " ".join(f"--data-stats {p}" for p in EXP.export_provenance(wc.stage)["data_stats"]),
        max_shard_size=config["export"]["max_shard_size"],
        # The video sampling the stage's data was packed with (pack.video), for the export.
        packed=lambda wc: EXP.export_provenance(wc.stage)["packed"],
        peft_adapter=lambda wc: EXP.export_adapter_args(wc.stage),
    log:
        f"{R}/logs/export_hf/{{stage}}.log",
    resources:
        runtime=60,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore export --checkpoint {params.checkpoint} --model {params.model} --out {output}"
        " {params.stage_configs} {params.data_stats} --packed-data {params.packed}"
        " --max-shard-size {params.max_shard_size} {params.peft_adapter} > {log} 2>&1"
