rule download_model:
    output:
        manifest=f"{R}/model/manifest.json",
    params:
        args=EXP.download_args(),
        out=lambda wc, output: os.path.dirname(output.manifest),
    log:
        f"{R}/logs/download_model.log",
    retries: 2
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore download {params.args} --out {params.out} > {log} 2>&1"


rule download_benchmark:
    # A public benchmark of eval.tasks, staged on the login node for the offline evaluation jobs
    # (vlmcore/eval/staging.py): downloaded into a hub cache shared by the experiments of
    # results_dir, or verified from eval.staged_benchmarks/<name> where the login nodes are offline.
    output:
        manifest=f"{R}/benchmarks/{{benchmark}}/manifest.json",
    params:
        source=lambda wc: EXP.benchmark_source(wc.benchmark),
        out=lambda wc, output: os.path.dirname(output.manifest),
    log:
        f"{R}/logs/download_benchmark/{{benchmark}}.log",
    retries: 2
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore stage-benchmark {wildcards.benchmark} {params.source} --out {params.out} > {log} 2>&1"
