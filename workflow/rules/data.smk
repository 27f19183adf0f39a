rule synth_data:
    output:
        captions=f"{R}/raw/captions.jsonl",
        conversations=f"{R}/raw/conversations.jsonl",
        eval=f"{R}/raw/eval.jsonl",
        meta=f"{R}/raw/meta.json",
    params:
        out=lambda wc, output: os.path.dirname(output.meta),
        cfg=config["data"].get("synthetic", {}),
    log:
        f"{R}/logs/synth_data.log",
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore synth --out {params.out} --num-train {params.cfg[num_train]}"
        " --num-eval {params.cfg[num_eval]} --seed {params.cfg[seed]} > {log} 2>&1"


rule prepare_data:
    input:
        lambda wc: EXP.dataset_input_files(wc.dataset),
    output:
        directory(f"{R}/data/{{dataset}}"),
    params:
        sources=lambda wc: " ".join(f"--source {s}" for s in EXP.dataset_sources(wc.dataset)),
        shard_size=lambda wc: config["data"]["datasets"][wc.dataset]["shard_size"],
        max_bad=lambda wc: config["data"]["datasets"][wc.dataset]["max_bad_fraction"],
    log:
        f"{R}/logs/prepare_data/{{dataset}}.log",
    threads: 2
    resources:
        runtime=60,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore prepare {params.sources} --out {output} --shard-size {params.shard_size}"
        " --max-bad-fraction {params.max_bad} --workers {threads} > {log} 2>&1"


MEASURE_JOBS = config["pack"]["measure_jobs"]


# The measure pass scattered over pack.measure_jobs jobs (only when > 1): each fills its share of
# packed/<dataset>.measured, which pack_data gathers and removes. temp(): once pack_data is done,
# the markers are gone and nothing reruns for them.
rule pack_measure:
    input:
        data=f"{R}/data/{{dataset}}",
        model=f"{R}/model/manifest.json",
    output:
        temp(f"{R}/packed/{{dataset}}.measured/group-{{group}}-of-{MEASURE_JOBS}.done"),
    params:
        model=lambda wc, input: os.path.dirname(input.model),
        out=lambda wc: f"{R}/packed/{wc.dataset}",
        pack=config["pack"],
        groups=MEASURE_JOBS,
    log:
        f"{R}/logs/pack_measure/{{dataset}}-{{group}}.log",
    wildcard_constraints:
        group=r"\d+",
    threads: 2
    resources:
        runtime=120,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore pack --data {input.data} --model {params.model} --out {params.out}"
        " --seq-len {params.pack[seq_len]} --max-patches {params.pack[max_patches]}"
        " --overlong {params.pack[overlong]} --workers {threads}"
        " --measure-group {wildcards.group}/{params.groups} > {log} 2>&1 && touch {output}"


rule pack_data:
    input:
        data=f"{R}/data/{{dataset}}",
        model=f"{R}/model/manifest.json",
        measured=lambda wc: [f"{R}/packed/{wc.dataset}.measured/group-{g}-of-{MEASURE_JOBS}.done"
                             for g in range(MEASURE_JOBS)] if MEASURE_JOBS > 1 else [],
    output:
        directory(f"{R}/packed/{{dataset}}"),
    params:
        model=lambda wc, input: os.path.dirname(input.model),
        pack=config["pack"],
    log:
        f"{R}/logs/pack_data/{{dataset}}.log",
    threads: 2
    resources:
        runtime=120,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore pack --data {input.data} --model {params.model} --out {output}"
        " --seq-len {params.pack[seq_len]} --max-patches {params.pack[max_patches]}"
        " --overlong {params.pack[overlong]} --workers {threads} > {log} 2>&1"
