"""Does the embedded demo learn, whatever its seed and its pack shard size? The whole demo
pipeline (`snakemake --profile profiles/local train_all`, config/config.yaml) at several seeds and
pack shard sizes: held-out accuracy per kind of question, and the wall time of each run.

    python benchmarks/demo_learning.py                          # seeds 0 1 2 x shard sizes 16 1000
    python benchmarks/demo_learning.py --seeds 0 --shard-sizes 16 --config config/demo-moe.yaml
    python benchmarks/demo_learning.py --seeds 0 1 --shard-sizes 16 --config config/demo-video.yaml

The score is the config's first eval task's (demo_vqa, or demo_video_qa), per question kind; a
second task (the video demo's frame-shuffled control) is printed beside it as `<kind>/ctl`.

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
from common import REPO, RESULTS, write_results


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
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--profile", "profiles/local", "train_all", "--configfile", "config.yaml"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.time() - start
    if proc.returncode:
        raise RuntimeError(f"demo at seed {seed}, shard size {shard_size} failed:\n{proc.stderr[-3000:]}")
    root = work / config["results_dir"] / config["experiment"]
    packs = json.loads((root / "packed" / "conversations" / "stats.json").read_text())["packs"]
    task, *control = config["eval"]["tasks"]
    # One results.json per task of the last stage's export, merged.
    results = {"results": {}, "breakdown": {}}
    last_stage = list(config["train"]["stages"])[-1]
    for name in config["eval"]["tasks"]:
        task_results = json.loads((root / "eval" / last_stage / name / "results.json").read_text())
        results["results"] |= task_results["results"]
        results["breakdown"] |= task_results["breakdown"]
    row = {
        "seed": seed,
        "shard_size": shard_size,
        "wall_s": round(wall),
        "conversation_packs": packs,
        "all": results["results"][task]["acc,none"],
        **{kind: figures["value"] for kind, figures in results["breakdown"][task].items()},
    }
    if control:
        row.update({f"{kind}/ctl": figures["value"] for kind, figures in results["breakdown"][control[0]].items()})
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--shard-sizes", type=int, nargs="+", default=[16, 1000])
    args = parser.parse_args()
    args.config = args.config.resolve()
    rows = []
    for seed in args.seeds:
        for shard_size in args.shard_sizes:
            with tempfile.TemporaryDirectory(prefix="demo_learning_") as tmp:
                row = run_demo(args.config, seed, shard_size, Path(tmp))
            if not rows:
                columns = [c for c in row if c not in ("seed", "shard_size", "wall_s", "conversation_packs")]
                print(f"{'seed':>4} {'shards':>6} " + " ".join(f"{c:>9}" for c in columns) + f" {'wall s':>6}")
            rows.append(row)
            print(
                f"{seed:>4} {shard_size:>6} " + " ".join(f"{row[c]:>9.2f}" for c in columns) + f" {row['wall_s']:>6}",
                flush=True,
            )
    worst = {c: min(r[c] for r in rows) for c in columns if not c.endswith("/ctl")}
    print("worst " + "  ".join(f"{k} {v:.2f}" for k, v in worst.items()))
    out = RESULTS / f"demo_learning_{args.config.stem}.json"
    config = str(args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config)
    write_results(out, {"config": config, "machine": f"{os.cpu_count()} CPU cores", "runs": rows, "worst": worst})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
