"""The large-encoder recipe (config/experiments/qwen3vl-8b-vit6b-mn5.yaml) uses the layout the
cost model picks for it, and its comment quotes the model's figures. Pure python: the workload
comes from FLOPs (vlmcore.models.flops) of the recipe's rows on its architecture
(benchmarks/recipe_models.py); its dry run is in tests/slurm/test_slurm_profiles.py with every recipe."""

import sys
from pathlib import Path

import pytest
import yaml

from vlmcore.report.layouts import Cluster, compare, flops_workload

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "config" / "experiments" / "qwen3vl-8b-vit6b-mn5.yaml"
ACHIEVED_TFLOPS = 400.0  # an H100 at 40% MFU
IMAGE_SIDE = 64  # patches per side: rows filled with 1024x1024 images (patch 16)


def recipe_layout(parallel: dict) -> str:
    """The layout name (vlmcore.report.layouts) of a recipe's `parallel` settings."""
    assert "modules" not in parallel, "map parallel.modules to a layout name here"
    return "colocated, vision TP 1"  # without parallel.modules: every module on every rank, vision TP 1


def test_the_large_encoder_recipe_uses_the_layout_the_model_picks():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from recipe_models import MODELS

    recipe = yaml.safe_load(RECIPE.read_text())
    common, pack = recipe["train"]["common"], recipe["pack"]
    world = recipe["train"]["nodes"] * recipe["train"]["nproc_per_node"]
    accum, mbs, tp = common["grad_accum_steps"], common["micro_batch_size"], common["parallel"]["tp"]
    config = MODELS[recipe["model"]["repo_id"]]()
    assert config.vision_config.depth == 45 and config.vision_config.hidden_size == 3200
    images = [[1, IMAGE_SIDE, IMAGE_SIDE]] * (pack["max_patches"] // IMAGE_SIDE**2)
    workload = flops_workload(
        config,
        rows=world // tp * mbs * accum,
        seq_len=pack["seq_len"],
        image_grids=images,
        achieved_tflops=ACHIEVED_TFLOPS,
        micro_batches=accum,
        micro_batch_size=mbs,
        llm_tp=tp,
    )
    ranked = compare(workload, Cluster(), world)
    assert ranked[0].layout == recipe_layout(common["parallel"])
    # The figures the recipe's comment quotes.
    assert workload.vision_s / (workload.vision_s + workload.llm_s) == pytest.approx(0.58, abs=0.005)
    assert [(p.layout, round(p.step_s, 2)) for p in ranked] == [
        ("colocated, vision TP 1", 4.20),
        ("disjoint, 16 vision + 16 LLM ranks", 5.79),
    ]
    assert ranked[1].speedup == pytest.approx(0.73, abs=0.005)
