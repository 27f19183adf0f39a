rule scaling_report:
    input:
        scaling=expand(f"{R}/scaling/ws{{ws}}/metrics.jsonl", ws=WORLD_SIZES),
        train=expand(f"{R}/train/{{stage}}/done", stage=STAGES),
        eval=EXP.eval_results(),
    output:
        md=report(f"{R}/report/SCALABILITY.md", category="Scaling"),
        csv=report(f"{R}/report/scaling.csv", category="Scaling"),
        training=report(f"{R}/report/training.csv", category="Training"),
        eval=report(f"{R}/report/eval.csv", category="Evaluation"),
        plots=report(
            directory(f"{R}/report/plots"),
            patterns=["{name}.png"],
            category="Plots",
        ),
    params:
        scaling=" ".join(f"--scaling ws{ws}={R}/scaling/ws{ws}/metrics.jsonl" for ws in WORLD_SIZES),
        train=" ".join(f"--train {s}={R}/train/{s}/metrics.jsonl" for s in STAGES),
        # Each exported stage's results, one results.json per task below eval/<stage>, in stage order.
        evals=" ".join(f"--eval {s}={R}/eval/{s}" for s in EXPORTED),
        imports=" ".join(f"--import {p}" for p in config["report"]["import"]),
        hardware=config["report"]["hardware"],
        out=lambda wc, output: os.path.dirname(output.md),
    log:
        f"{R}/logs/scaling_report.log",
    conda:
        "../envs/vlmcore.yaml"
    shell:
        "vlmcore report {params.scaling} {params.train} {params.evals} {params.imports}"
        " --hardware '{params.hardware}' --out {params.out} > {log} 2>&1"
