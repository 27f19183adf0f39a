# One target per stage (named after the results/<experiment>/ folder it builds) and train_all.


rule train_all:
    default_target: True
    input:
        EXP.eval_results(),
        f"{R}/report/SCALABILITY.md",


rule model:
    input:
        f"{R}/model/manifest.json",


rule data:
    input:
        expand(f"{R}/data/{{dataset}}", dataset=DATASETS),


rule packed:
    input:
        expand(f"{R}/packed/{{dataset}}", dataset=DATASETS),


rule train:
    input:
        expand(f"{R}/train/{{stage}}/done", stage=STAGES),


rule hf:
    input:
        expand(f"{R}/hf/{{stage}}", stage=EXPORTED),


rule benchmarks:
    # The public benchmarks of eval.tasks, staged on the login node (part of eval and train_all).
    input:
        [f"{R}/benchmarks/{task}/manifest.json" for task in TASKS if task in BENCHMARKS],


rule eval:
    input:
        EXP.eval_results(),


rule scaling:
    input:
        expand(f"{R}/scaling/ws{{ws}}/metrics.jsonl", ws=WORLD_SIZES),


rule report:
    input:
        f"{R}/report/SCALABILITY.md",


rule memory:
    # Not part of train_all: run it before a cluster run (results/<experiment>/memory/<stage>.txt).
    input:
        expand(f"{R}/memory/{{stage}}.txt", stage=STAGES),
