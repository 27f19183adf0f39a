"""Does the GRPO demo learn from its rewards? config/demo-grpo.yaml's stages (stage1, sft_short,
grpo) through the real DAG, beside a control stage `grpo_control`: grpo's settings with each
group's rewards permuted among its completions (`grpo.shuffle_rewards`), so that the advantages
carry no information about which answer earned them. The held-out mean reward (demo_vqa_gen:
exact match of the generated answer, per question kind) before GRPO (sft_short), after it, and
after the control.

    python benchmarks/grpo_demo.py                 # seed 0
    python benchmarks/grpo_demo.py --seeds 0 1 2

A seed is the demo's every seed at once (the tiny model, the synthetic data, training), as in
benchmarks/demo_learning.py. Each seed runs in a fresh copy of the workflow; only the stages the
three evaluations need run (not stage2 or the report). Writes benchmarks/results/grpo_demo.json
(--out, or $OUT) and prints a table.
"""

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import REPO, RESULTS, print_table, write_results

STAGES = ("sft_short", "grpo", "grpo_control")
TASK = "demo_vqa_gen"


def run_seed(seed: int, work: Path) -> dict:
    for name in ("Snakefile", "workflow", "profiles", "config"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, work / name)
    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    overlay = yaml.safe_load((REPO / "config" / "demo-grpo.yaml").read_text())
    control = copy.deepcopy(overlay["train"]["stages"]["grpo"])
    control["grpo"]["shuffle_rewards"] = True
    overlay["train"]["stages"]["grpo_control"] = control
    overlay["model"] = {"tiny": {"seed": seed}}
    overlay["data"]["synthetic"] = {"seed": seed}
    overlay["train"]["common"] = {"seed": seed}
    (work / "overlay.yaml").write_text(yaml.safe_dump(overlay, sort_keys=False))
    root = Path(base["results_dir"]) / base["experiment"]
    targets = [str(root / "eval" / stage / TASK / "results.json") for stage in STAGES]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    command = [sys.executable, "-m", "snakemake", "--profile", "profiles/local", "--configfile", "config/config.yaml"]
    start = time.time()
    proc = subprocess.run([*command, "overlay.yaml", "--", *targets], cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the GRPO demo at seed {seed} failed:\n{proc.stderr[-3000:]}")
    row = {"seed": seed, "wall_s": round(time.time() - start)}
    for stage in STAGES:
        results = json.loads((work / root / "eval" / stage / TASK / "results.json").read_text())
        row[stage] = results["results"][TASK]["exact_match,none"]
        for kind, figures in results["breakdown"][TASK].items():
            row[f"{stage}/{kind}"] = figures["value"]
    # The training reward (the rollouts' mean, sampled at temperature 1): its first and last ten steps.
    lines = (work / root / "train" / "grpo" / "metrics.jsonl").read_text().splitlines()
    rewards = [json.loads(line)["reward_mean"] for line in lines if line.strip()]
    row["train_reward_first10"] = round(sum(rewards[:10]) / 10, 4)
    row["train_reward_last10"] = round(sum(rewards[-10:]) / 10, 4)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", RESULTS)))
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(prefix="grpo_demo_") as tmp:
            rows.append(run_seed(seed, Path(tmp)))
    kinds = sorted({key.split("/", 1)[1] for key in rows[0] if key.startswith("grpo/")})
    columns = [("seed", ">4"), ("stage", ">14"), ("held-out", ">10.3f")] + [(kind, ">8.3f") for kind in kinds]
    table = []
    for row in rows:
        for stage, name in zip(STAGES, ("before (sft)", "grpo", "control")):
            table.append([row["seed"], name, row[stage], *(row.get(f"{stage}/{kind}") for kind in kinds)])
    print(f"GRPO demo, held-out mean reward ({TASK}) before GRPO, after it, after the shuffled-reward control")
    print_table(columns, table)
    for row in rows:
        print(
            f"seed {row['seed']}: grpo's training reward {row['train_reward_first10']:.3f} over its first ten "
            f"steps, {row['train_reward_last10']:.3f} over its last ten"
        )
    write_results(args.out / "grpo_demo.json", {"machine": f"{os.cpu_count()} CPU cores", "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
