"""Does the embedded demo learn, whatever its seed and its pack shard size? The whole demo
pipeline (`snakemake --profile profiles/local train_all`, config/config.yaml) at several seeds and
pack shard sizes: held-out accuracy per kind of question, and the wall time of each run.

    python benchmarks/demo_learning.py                          # seeds 0 1 2 x shard sizes 16 1000
    python benchmarks/demo_learning.py --seeds 0 --shard-sizes 16 --config config/demo-moe.yaml

A seed is the demo's every seed at once: the tiny model's weights and tokenizer corpus
(model.tiny.seed), the synthetic images and questions (data.synthetic.seed) and training
(train.common.seed: the data order and anything random in the step). Each run works in a fresh
copy of the workflow. Writes benchmarks/results/demo_learning.json and prints a table.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
KINDS = ("color", "shape", "side")


def run_demo(config_path: Path, seed: int, shard_size: int, work: Path) -> dict:
    for name in ("Snakefile", "workflow", "profiles", "config"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, work / name)
    config = yaml.safe_load(config_path.read_text())
    config["model"]["tiny"]["seed"] = seed
    config["data"]["synthetic"]["seed"] = seed
    config["train"].setdefault("common", {})["seed"] = seed
    config["pack"]["shard_size"] = shard_size
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/local", "train_all",
                           "--configfile", "config.yaml"], cwd=work, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode:
        raise RuntimeError(f"demo at seed {seed}, shard size {shard_size} failed:\n{proc.stderr[-3000:]}")
    root = work / config["results_dir"] / config["experiment"]
    results = json.loads((root / "eval" / "results.json").read_text())
    packs = json.loads((root / "packed" / "conversations" / "stats.json").read_text())["packs"]
    breakdown = results["breakdown"]["demo_vqa"]
    return {"seed": seed, "shard_size": shard_size, "wall_s": round(wall),
            "all": results["results"]["demo_vqa"]["acc,none"], **{k: breakdown[k]["value"] for k in KINDS},
            "conversation_packs": packs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--shard-sizes", type=int, nargs="+", default=[16, 1000])
    args = parser.parse_args()
    args.config = args.config.resolve()
    rows = []
    print(f"{'seed':>4} {'shards':>6} {'all':>5} {'color':>5} {'shape':>5} {'side':>5} {'wall s':>6}")
    for seed in args.seeds:
        for shard_size in args.shard_sizes:
            with tempfile.TemporaryDirectory(prefix="demo_learning_") as tmp:
                row = run_demo(args.config, seed, shard_size, Path(tmp))
            rows.append(row)
            print(f"{seed:>4} {shard_size:>6} {row['all']:>5.2f} {row['color']:>5.2f} {row['shape']:>5.2f} "
                  f"{row['side']:>5.2f} {row['wall_s']:>6}", flush=True)
    worst = {k: min(r[k] for r in rows) for k in ("all", *KINDS)}
    print("worst " + "  ".join(f"{k} {v:.2f}" for k, v in worst.items()))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"demo_learning_{args.config.stem}.json"
    out.write_text(json.dumps({"config": str(args.config.relative_to(REPO) if args.config.is_relative_to(REPO)
                                              else args.config),
                               "machine": f"{os.cpu_count()} CPU cores", "runs": rows, "worst": worst}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
