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
