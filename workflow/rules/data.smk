# The image demo also writes preference pairs on its images (DPO data, and their held-out half)
# and RL prompts on them (GRPO data, and theirs).
SYNTH_PREFERENCE = (
    {
        "preference": f"{R}/raw/preference.jsonl",
        "preference_eval": f"{R}/raw/preference_eval.jsonl",
        "prompts": f"{R}/raw/prompts.jsonl",
        "prompts_eval": f"{R}/raw/prompts_eval.jsonl",
    }
    if config["data"].get("synthetic", {}).get("kind") == "image"
    else {}
)


rule synth_data:
    output:
        captions=f"{R}/raw/captions.jsonl",
        conversations=f"{R}/raw/conversations.jsonl",
        eval=f"{R}/raw/eval.jsonl",
        meta=f"{R}/raw/meta.json",
        **SYNTH_PREFERENCE,
    params:
        out=lambda wc, output: os.path.dirname(output.meta),
        cfg=config["data"].get("synthetic", {}),
    log:
        f"{R}/logs/synth_data.log",
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore synth --kind {params.cfg[kind]} --out {params.out} --num-train {params.cfg[num_train]}"
        " --num-eval {params.cfg[num_eval]} --seed {params.cfg[seed]} --min-size {params.cfg[min_size]}"
        " --max-size {params.cfg[max_size]} > {log} 2>&1"


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
WRITE_JOBS = config["pack"]["write_jobs"]
# The settings that decide the packs' bytes, the same in every job of a dataset's pack.
PACK_SETTINGS = "--seq-len {seq_len} --max-patches {max_patches} --overlong {overlong} --shard-size {shard_size}".format(
    **config["pack"]
) + "".join(f" --video-{key.replace('_', '-')} {value}" for key, value in config["pack"].get("video", {}).items())


# The markers of the scattered steps of a dataset's pack (none for a step in one job).
MEASURED = expand(f"{R}/packed/{{dataset}}.measured/group-{{group}}-of-{MEASURE_JOBS}.done",
                  group=range(MEASURE_JOBS), allow_missing=True) if MEASURE_JOBS > 1 else []
WRITTEN = expand(f"{R}/packed/{{dataset}}.partial/plan/write-{{group}}-of-{WRITE_JOBS}.done",
                 group=range(WRITE_JOBS), allow_missing=True) if WRITE_JOBS > 1 else []


# A pack split into jobs (docs/hpc.md section 12), each a `vlmcore pack` of the same settings:
# pack_measure (pack.measure_jobs > 1): each fills its share of packed/<dataset>.measured;
# pack_plan (pack.write_jobs > 1): one global packing of all the measurements into
# packed/<dataset>.partial/plan; pack_write: each writes its share of the output shards; pack_data
# finishes (measures, plans or writes whatever is left first) and renames the output into place.
# Their markers are temp() and lie in folders that pack_data removes: once it is done nothing
# reruns for them.
rule pack_measure:
    input:
        data=f"{R}/data/{{dataset}}",
        model=f"{R}/model/manifest.json",
    output:
        temp(f"{R}/packed/{{dataset}}.measured/group-{{group}}-of-{MEASURE_JOBS}.done"),
    params:
        model=lambda wc, input: os.path.dirname(input.model),
        out=lambda wc: f"{R}/packed/{wc.dataset}",
        settings=PACK_SETTINGS,
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
        "vlmcore pack --data {input.data} --model {params.model} --out {params.out} {params.settings} --workers {threads}"
        " --measure-group {wildcards.group}/{params.groups} > {log} 2>&1 && touch {output}"


rule pack_plan:
    input:
        data=f"{R}/data/{{dataset}}",
        model=f"{R}/model/manifest.json",
        measured=MEASURED,
    output:
        temp(f"{R}/packed/{{dataset}}.partial/plan/planned.done"),
    params:
        model=lambda wc, input: os.path.dirname(input.model),
        out=lambda wc: f"{R}/packed/{wc.dataset}",
        settings=PACK_SETTINGS,
    log:
        f"{R}/logs/pack_plan/{{dataset}}.log",
    threads: 2
    resources:
        runtime=120,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore pack --data {input.data} --model {params.model} --out {params.out} {params.settings} --workers {threads}"
        " --plan-only > {log} 2>&1 && touch {output}"


rule pack_write:
    input:
        data=f"{R}/data/{{dataset}}",
        model=f"{R}/model/manifest.json",
        plan=f"{R}/packed/{{dataset}}.partial/plan/planned.done",
    output:
        temp(f"{R}/packed/{{dataset}}.partial/plan/write-{{group}}-of-{WRITE_JOBS}.done"),
    params:
        model=lambda wc, input: os.path.dirname(input.model),
        out=lambda wc: f"{R}/packed/{wc.dataset}",
        settings=PACK_SETTINGS,
        groups=WRITE_JOBS,
    log:
        f"{R}/logs/pack_write/{{dataset}}-{{group}}.log",
    wildcard_constraints:
        group=r"\d+",
    threads: 2
    resources:
        runtime=120,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore pack --data {input.data} --model {params.model} --out {params.out} {params.settings} --workers {threads}"
        " --write-group {wildcards.group}/{params.groups} > {log} 2>&1 && touch {output}"


rule pack_data:
    input:
        data=f"{R}/data/{{dataset}}",
        model=f"{R}/model/manifest.json",
        steps=WRITTEN or MEASURED,
    output:
        directory(f"{R}/packed/{{dataset}}"),
    params:
        model=lambda wc, input: os.path.dirname(input.model),
        settings=PACK_SETTINGS,
    log:
        f"{R}/logs/pack_data/{{dataset}}.log",
    threads: 2
    resources:
        runtime=120,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore pack --data {input.data} --model {params.model} --out {output}"
        " {params.settings} --workers {threads} > {log} 2>&1"
