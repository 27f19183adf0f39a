rule evaluate:
    input:
        hf=f"{R}/hf",
        vqa=f"{R}/raw/eval.jsonl" if EXP.uses_synthetic_data else [],
    output:
        results=f"{R}/eval/results.json",
    params:
        out=lambda wc, output: os.path.dirname(output.results),
        tasks=",".join(config["eval"]["tasks"]),
        vqa=f"--vqa-data {R}/raw/eval.jsonl" if EXP.uses_synthetic_data else "",
        limit=f"--limit {config['eval']['limit']}" if config["eval"]["limit"] else "",
        batch_size=config["eval"]["batch_size"],
        device=config["eval"]["device"],
    log:
        f"{R}/logs/evaluate.log",
    resources:
        runtime=120,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore eval --model {input.hf} --tasks {params.tasks} --out {params.out} {params.vqa} {params.limit}"
        " --batch-size {params.batch_size} --device {params.device} > {log} 2>&1"
