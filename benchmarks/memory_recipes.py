"""Does every shipped cluster recipe fit its GPUs? Peak memory per GPU of each training stage of
config/experiments/*.yaml, estimated without a GPU, against the recipe's train.gpu_memory_gib.

    python benchmarks/memory_recipes.py [RECIPE ...]   # writes benchmarks/results/memory_recipes.json
    python benchmarks/memory_recipes.py --merge RECIPE ...   # replaces those recipes' rows in it, keeps the others

Each stage is estimated as `snakemake memory` does on the cluster (`vlmcore memory` on the
stage's config at its rank count): its worst-case row is one sample holding the largest image
the recipe's pack.max_patches allows (a video recipe: a clip of pack.video.max_frames frames
sharing that budget), in a row of pack.seq_len tokens (under parallel.cp each rank holds 1/cp of
it, and the images and video frame groups with a token in its chunk). The models are built from
the architecture fields of the published config.json of each recipe's repo_id (no weights).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import REPO, write_results
from recipe_models import MODELS

from vlmcore.config import load_config
from vlmcore.train.memory import check_fit, estimate_stage
from vlmcore.workflow import Experiment, validate_config


def estimate_recipe(recipe: Path, tmp: Path) -> list[dict]:
    config = validate_config(yaml.safe_load(recipe.read_text()), REPO / "workflow" / "schemas" / "config.schema.yaml")
    exp = Experiment(config)
    model_dir = tmp / recipe.stem / "model"
    MODELS[config["model"]["repo_id"]]().save_pretrained(model_dir)
    rows = []
    for stage in exp.stages:
        # The stage's packed dataset as far as the estimate reads it: its row limits.
        packed = tmp / recipe.stem / "packed" / stage
        packed.mkdir(parents=True)
        # A video recipe's worst row: a clip of max_frames (temporal patch 2: half as many groups),
        # which the real pack writes as its longest clip's video_groups.
        limits = dict(config["pack"])
        if limits.get("video", {}).get("max_frames"):
            limits["video_groups"] = -(-limits["video"]["max_frames"] // 2)
        (packed / "pack_config.json").write_text(json.dumps(limits))
        settings = dict(
            exp.stage_config(stage),
            model_path=str(model_dir),
            data_path=str(packed),
            output_dir=str(tmp / recipe.stem / "train" / stage),
            init_from=None,
        )
        stage_config = tmp / recipe.stem / f"{stage}.yaml"
        stage_config.write_text(yaml.safe_dump(settings))
        start = time.perf_counter()
        result = estimate_stage(load_config(stage_config, []), exp.stage_ranks(stage))
        problem = check_fit(
            result, config["train"]["gpu_memory_gib"], host_memory_gib=config["train"].get("host_memory_gib")
        )
        rows.append(
            dict(
                result,
                recipe=recipe.stem,
                stage=stage,
                problem=problem,
                estimate_seconds=round(time.perf_counter() - start, 1),
            )
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", type=Path, help="default: config/experiments/*.yaml")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "memory_recipes.json")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep --out's rows of the other recipes (a run on all "
        "recipes takes over half an hour on 2 cores, Qwen3.5-9B's most of it)",
    )
    args = parser.parse_args()
    recipes = args.recipes or sorted((REPO / "config" / "experiments").glob("*.yaml"))
    print(
        f"{'recipe':<34}{'stage':<8}{'ranks':>6}{'mesh':>10}{'AC':>11}{'mbs':>4}{'tokens':>7}{'image':>10}"
        f"{'states':>8}{'activ.':>8}{'peak GiB':>9}{'GPU GiB':>8}{'host GiB':>9}  fits"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in recipes:
            for r in estimate_recipe(recipe, Path(tmp)):
                rows.append(r)
                kinds = r["peak_bytes_by_kind"]
                states = sum(kinds.get(k, 0) for k in ("Sharded Param", "Sharded Grad", "OptState")) / 2**30
                mesh = f"{r['dp_shard']}x{r['cp']}x{r['tp']}"  # dp_shard x cp x tp
                side = f"{r['image_side']}^2" if r["image_side"] else "-"
                side += f"x{r['video_frames']}" if r.get("video_frames") else ""  # frame groups of a clip
                print(
                    f"{r['recipe']:<34}{r['stage']:<8}{r['world_size']:>6}{mesh:>10}"
                    f"{r['activation_checkpointing']:>11}{r['micro_batch_size']:>4}{r['seq_len']:>7}{side:>10}"
                    f"{states:>8.1f}{kinds.get('Activation', 0) / 2**30:>8.1f}{r['peak_bytes'] / 2**30:>9.1f}"
                    f"{r['gpu_memory_gib']:>8g}{r.get('host_bytes', 0) / 2**30:>9.1f}  {'yes' if r['fits'] else 'NO'}",
                    flush=True,
                )
    for r in rows:
        if r["problem"]:
            print(f"{r['recipe']} {r['stage']}: {r['problem']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge and args.out.is_file():
        estimated = {r["recipe"] for r in rows}
        kept = [r for r in json.loads(args.out.read_text())["rows"] if r["recipe"] not in estimated]
        rows = kept + rows
    write_results(args.out, {"rows": rows})
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
