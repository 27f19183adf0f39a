# One job per exported stage and task: adding a task to eval.tasks runs only that task's jobs, and
# a job cut short reruns only its own task. With eval.nproc > 1 the job's task is split over that
# many processes, one GPU each (torchrun, data parallel over the samples).
# The jobs run with the hubs switched off (compute nodes are offline); a public benchmark reads
# the copy that download_benchmark staged on the login node, checked against its manifest before
# the model is loaded.


rule evaluate:
    input:
        unpack(lambda wc: EXP.eval_inputs(wc.stage, wc.task, BENCHMARKS)),
    output:
        results=f"{R}/eval/{{stage}}/{{task}}/results.json",
    params:
        out=lambda wc, output: os.path.dirname(output.results),
        vqa=f"--vqa-data {R}/raw/eval.jsonl" if EXP.uses_synthetic_data else "",
        benchmark_data=lambda wc: f"--benchmark-data {R}/benchmarks" if wc.task in BENCHMARKS else "",
        limit=f"--limit {config['eval']['limit']}" if config["eval"]["limit"] else "",
        batch_size=config["eval"]["batch_size"],
        video_workers=config["eval"]["video_workers"],
        device=config["eval"]["device"],
        launcher=EXP.eval_launcher(),
    log:
        f"{R}/logs/evaluate/{{stage}}/{{task}}.log",
    threads: config["eval"]["nproc"]
    resources:
        runtime=120,
        # One GPU per process on the cluster; none asked for on CPU (the demo, CI's SLURM).
        gres=f"gpu:{config['eval']['nproc']}" if config["eval"]["device"].startswith("cuda") else None,
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1"
        " {params.launcher} eval --model {input.hf} --tasks {wildcards.task} --out {params.out} {params.vqa}"
        " {params.benchmark_data} {params.limit} --batch-size {params.batch_size}"
        " --video-workers {params.video_workers} --device {params.device} > {log} 2>&1"
