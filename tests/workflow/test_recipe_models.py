"""Every shipped cluster recipe's training stages build on the real architecture of the recipe's
model: its `trainable` patterns match parameters, its mesh fits the stage's rank count, and its
tensor-parallel plan applies. Checked on the meta device over a fake process group of the
stage's size, so a recipe that would stop at the start of a cluster job fails here instead.
The architectures are benchmarks/recipe_models.py's (the published config.json fields).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import env

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "config" / "experiments").glob("*.yaml"))
# The two-stage recipes (projector alignment, then full fine-tuning), the one-stage LoRA ones and
# the one-stage LoRA DPO ones.
LORA_RECIPES = [r for r in RECIPES if "-lora-" in r.stem]
DPO_RECIPES = [r for r in RECIPES if "-dpo-" in r.stem]
GRPO_RECIPES = [r for r in RECIPES if "-grpo-" in r.stem]
FULL_RECIPES = [r for r in RECIPES if r not in LORA_RECIPES + DPO_RECIPES + GRPO_RECIPES]

DRIVER = """
import json, sys
from pathlib import Path
import torch, yaml
from recipe_models import MODELS
from vlmcore.config import load_config
from vlmcore.models import load_hf_config
from vlmcore.parallel.checks import check_run
from vlmcore.train.build import build_meta_run
from vlmcore.train.memory import _process_group
from vlmcore.workflow import Experiment, validate_config

repo, tmp = Path(sys.argv[1]), Path(sys.argv[2])
out = {}
for recipe in sys.argv[3:]:
    config = validate_config(yaml.safe_load(Path(recipe).read_text()), repo / "workflow/schemas/config.schema.yaml")
    exp = Experiment(config)
    model_dir = tmp / Path(recipe).stem
    MODELS[config["model"]["repo_id"]]().save_pretrained(model_dir)
    for stage in exp.stages:
        settings = dict(exp.stage_config(stage), model_path=str(model_dir), data_path=str(tmp), init_from=None)
        (tmp / "stage.yaml").write_text(yaml.safe_dump(settings))
        cfg = load_config(tmp / "stage.yaml", [])
        ranks = exp.stage_ranks(stage)
        with _process_group(ranks, fake=True):
            layout = check_run(cfg, ranks, load_hf_config(model_dir))
            model = build_meta_run(cfg, layout, torch.device("cpu"), 0).model
        projectors = {id(p) for m in model.projectors() for p in m.parameters()}
        out[f"{Path(recipe).stem}/{stage}"] = {
            "ranks": ranks, "tp": layout.language.dims.tp, "cp": layout.language.dims.cp,
            "params": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "tower": sum(p.numel() for p in model.vision_tower().parameters() if id(p) not in projectors)}
print("RESULT" + json.dumps(out))
"""

# Parameter counts of the published checkpoints (the model cards), without Qwen3.5's
# multi-token-prediction layer, which vlmcore does not train.
# qwen3vl-8b-vit6b is assembled by hand (benchmarks/recipe_models.py): its count is the architecture's.
PARAMS = {
    "qwen3vl-2b": 2.13e9,
    "qwen3vl-8b": 8.77e9,
    "qwen3vl-8b-video": 8.77e9,
    "qwen35-9b": 9.4e9,
    "qwen3vl-8b-vit6b": 13.95e9,
    "qwen3vl-30b-a3b": 31.07e9,
    "qwen3vl-30b-a3b-offload": 31.07e9,
    "qwen3vl-8b-128k": 8.77e9,
    "qwen3vl-2b-256k": 2.13e9,
}
# The long-context recipes (parallel.cp) and their cp sizes: each cp rank encodes only the frame
# groups in its chunk of a row, so their stage 2 trains the vision tower too (docs/hpc.md section
# 15, "Recipes").
LONG_CONTEXT = {
    "qwen3vl-8b-128k-mn5": 4,
    "qwen3vl-8b-128k-jupiter": 2,
    "qwen3vl-2b-256k-mn5": 4,
    "qwen3vl-2b-256k-jupiter": 2,
}


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(REPO), str(tmp_path_factory.mktemp("recipes")), *map(str, RECIPES)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(env(), PYTHONPATH=f"{REPO / 'benchmarks'}:{env().get('PYTHONPATH', '')}"),
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.split("RESULT")[-1])


# The recipes whose memory estimates the `*_fits_*` tests check.
MOE_MN5 = REPO / "config" / "experiments" / "qwen3vl-30b-a3b-mn5.yaml"
MOE_OFFLOAD = REPO / "config" / "experiments" / "qwen3vl-30b-a3b-offload-jupiter.yaml"
FIT_RECIPES = [*LORA_RECIPES, *DPO_RECIPES, *GRPO_RECIPES, MOE_MN5, MOE_OFFLOAD]


@pytest.fixture(scope="module")
def estimates(tmp_path_factory):
    """Each fit-tested recipe's stages' rows of benchmarks/memory_recipes.py (as the `memory` target
    runs on the cluster), by recipe, then stage: one process for them all, which shares its
    start-up. Its exit status is 1 when a recipe does not fit; each test asserts its own rows fit."""
    out = tmp_path_factory.mktemp("estimates") / "estimate.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "memory_recipes.py"), *map(str, FIT_RECIPES), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=2400,
        env=env(),
    )
    assert proc.returncode in (0, 1) and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    # Each estimate compiles its blocks as its own process would: none ran eagerly because the
    # estimates before it had filled dynamo's cache (`_compile_blocks`).
    assert "recompile_limit" not in proc.stderr, proc.stderr[-3000:]
    rows = {}
    for row in json.loads(out.read_text())["rows"]:
        rows.setdefault(row["recipe"], {})[row["stage"]] = row
    return rows


@pytest.mark.parametrize("recipe", FULL_RECIPES, ids=lambda r: r.stem)
def test_recipe_stages_build_on_their_model(stages, recipe):
    stage1, stage2 = stages[f"{recipe.stem}/stage1"], stages[f"{recipe.stem}/stage2"]
    assert stage1["params"] == stage2["params"] == pytest.approx(PARAMS[recipe.stem.rsplit("-", 1)[0]], rel=0.03)
    # Stage 1 aligns the projector alone (0.4% of Qwen3.5-9B, 4.7% of Qwen3-VL-2B with its three
    # deepstack mergers); stage 2 trains everything, the vision tower included.
    assert 0 < stage1["trainable"] < stage1["params"] / 20
    assert stage2["tower"] > 0 and stage2["trainable"] == stage2["params"]
    assert stage1["cp"] == stage2["cp"] == LONG_CONTEXT.get(recipe.stem, 1)


def adapter_params(rank: int, shapes: list[tuple[int, int]]) -> int:
    """Parameters of rank-`rank` adapters on linear maps of the given (in, out) features: A and B."""
    return sum(rank * (n_in + n_out) for n_in, n_out in shapes)


# Adapters of the LoRA recipes (rank 16), from the published architectures.
# Qwen3-VL-8B: 36 layers, hidden 4096, 32 query and 8 key/value heads of 128, MLP 12288; adapters
# on q, k, v, o and the MLP's gate, up and down.
# Qwen3-VL-30B-A3B: 48 layers, hidden 2048, 32 query and 4 key/value heads of 128; adapters on
# q, k, v, o and, per layer, on each of 128 routed experts' gate_up (2048 -> 2 x 768) and down.
LORA_ADAPTERS = {
    "qwen3vl-8b-lora": 36
    * adapter_params(
        16, [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 12288), (4096, 12288), (12288, 4096)]
    ),
    "qwen3vl-30b-a3b-lora": 48
    * (
        adapter_params(16, [(2048, 4096), (2048, 512), (2048, 512), (4096, 2048)])
        + 128 * adapter_params(16, [(2048, 1536), (768, 2048)])
    ),
}


@pytest.mark.parametrize("recipe", LORA_RECIPES, ids=lambda r: r.stem)
def test_lora_recipe_trains_the_adapters_only(stages, recipe):
    """One LoRA stage from the released weights on one node: the base as published, and exactly the
    adapters the recipe's targets (and, on the MoE model, the routed experts) call for train."""
    name = recipe.stem.rsplit("-", 1)[0]
    assert [key for key in stages if key.startswith(f"{recipe.stem}/")] == [f"{recipe.stem}/lora_sft"]
    stage = stages[f"{recipe.stem}/lora_sft"]
    assert stage["ranks"] == 4
    assert stage["trainable"] == LORA_ADAPTERS[name]
    assert stage["params"] - stage["trainable"] == pytest.approx(PARAMS[name.removesuffix("-lora")], rel=0.03)
    assert stage["tp"] == stage["cp"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("recipe", LORA_RECIPES, ids=lambda r: r.stem)
def test_lora_recipe_fits_its_gpus(estimates, recipe):
    """Each LoRA recipe's stage fits its cluster's GPU with 10% kept free (benchmarks/memory_recipes.py,
    as the `memory` target runs on the cluster), with AdamW state for the adapters alone."""
    rows = estimates[recipe.stem]
    assert set(rows) == {"lora_sft"}
    row = rows["lora_sft"]
    assert row["fits"] and row["gpu_memory_gib"] == {"mn5": 64, "jupiter": 96}[recipe.stem.rsplit("-", 1)[1]]
    # AdamW's two fp32 moments of the adapters, sharded over the 4 GPUs; none for the frozen base.
    adapters = LORA_ADAPTERS[recipe.stem.rsplit("-", 1)[0]]
    assert 8 * adapters / 4 <= row["peak_bytes_by_kind"]["OptState"] < 8 * adapters / 4 * 1.01 + 2**20


@pytest.mark.slow
def test_moe_recipe_fits_marenostrum5(estimates):
    """Qwen3-VL-30B-A3B on 16 H100 64 GB: both stages' estimates (benchmarks/memory_recipes.py, as
    the `memory` target runs on the cluster) fit with 10% kept free. Stage 2 did not (67.7 GiB)
    while each MoE layer's checkpointed recompute held its graph to the end of backward."""
    rows = estimates[MOE_MN5.stem]
    assert set(rows) == {"stage1", "stage2"} and all(r["fits"] and r["gpu_memory_gib"] == 64 for r in rows.values())
    # The states alone are 28.5 GiB per GPU in stage 2; what backward holds beyond them stays small.
    assert rows["stage2"]["peak_bytes"] < 40 * 2**30


@pytest.mark.slow
def test_offload_recipe_fits_one_jupiter_node(estimates):
    """Qwen3-VL-30B-A3B on one JUPITER node (4 GH200) with `parallel.offload` and bfloat16 moments,
    where without offload the states alone (124 GB a GPU) fit neither the GPU nor its host share:
    both stages fit the 96 GB GPU, and what the host holds fits each GPU's 120 GB of LPDDR5X, each
    with 10% kept free."""
    rows = estimates[MOE_OFFLOAD.stem]
    assert set(rows) == {"stage1", "stage2"}
    for row in rows.values():
        assert row["fits"] and row["host_fits"] and (row["gpu_memory_gib"], row["host_memory_gib"]) == (96, 120)
        assert row["offload"] and row["moments_dtype"] == "bfloat16" and row["world_size"] == 4
        # The device holds no states: the gathered units in flight, activations, inputs.
        assert not any(row["peak_bytes_by_kind"].get(kind) for kind in ("Sharded Param", "Sharded Grad", "OptState"))
        assert row["peak_bytes_by_kind"]["Unsharded Param"] > 2**30 and row["peak_bytes_by_kind"]["Activation"] > 2**30
    # Stage 2's host share: float32 weights and gradients and bfloat16 moments, 12 bytes a weight
    # over 4 GPUs (31.07e9 weights), at least; what the step adds to them stays within 10% of it.
    states = 12 * PARAMS["qwen3vl-30b-a3b"] / 4
    assert states <= rows["stage2"]["host_bytes"] < 1.1 * states


@pytest.mark.parametrize("recipe", DPO_RECIPES, ids=lambda r: r.stem)
def test_dpo_recipe_trains_the_adapters_against_the_released_weights(stages, recipe):
    """One LoRA DPO stage from the released weights on one node, the reference being the policy with
    its adapters off: the LoRA SFT recipe's adapters (on the MoE model, every routed expert's too),
    the base as published."""
    import yaml

    model = dpo_model(recipe)
    stage = stages[f"{recipe.stem}/lora_dpo"]
    assert [key for key in stages if key.startswith(f"{recipe.stem}/")] == [f"{recipe.stem}/lora_dpo"]
    settings = yaml.safe_load(recipe.read_text())["train"]["stages"]["lora_dpo"]
    assert settings["objective"] == "dpo" and settings["dpo"]["reference"] == "adapters_off"
    assert stage["ranks"] == 4
    assert stage["trainable"] == LORA_ADAPTERS[f"{model}-lora"]
    assert stage["params"] - stage["trainable"] == pytest.approx(PARAMS[model], rel=0.03)
    assert stage["tp"] == stage["cp"] == 1


def dpo_model(recipe: Path) -> str:
    """The model of a DPO recipe: qwen3vl-30b-a3b of qwen3vl-30b-a3b-dpo-mn5."""
    return recipe.stem.rsplit("-dpo-", 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", DPO_RECIPES, ids=lambda r: r.stem)
def test_dpo_recipe_fits_its_gpus(estimates, recipe):
    """Each DPO recipe's stage fits its cluster's GPU with 10% kept free (benchmarks/memory_recipes.py,
    as the `memory` target runs on the cluster): no second model (`adapters_off`), AdamW state for
    the adapters alone."""
    model = dpo_model(recipe)
    rows = estimates[recipe.stem]
    assert set(rows) == {"lora_dpo"}
    row = rows["lora_dpo"]
    assert row["fits"] and row["gpu_memory_gib"] == {"mn5": 64, "jupiter": 96}[recipe.stem.rsplit("-", 1)[1]]
    adapters = LORA_ADAPTERS[f"{model}-lora"]
    assert 8 * adapters / 4 <= row["peak_bytes_by_kind"]["OptState"] < 8 * adapters / 4 * 1.01 + 2**20
    # One model's weights: the frozen base's fp32 parameters over 4 GPUs (8.2 GiB of the 8B,
    # 28.9 GiB of the 30B-A3B) and the adapters with their gradients.
    base = 4 * PARAMS[model] / 4
    assert 0.97 * base < row["peak_bytes_by_kind"]["Sharded Param"] < 1.05 * base + 4 * adapters / 4


@pytest.mark.parametrize("recipe", GRPO_RECIPES, ids=lambda r: r.stem)
def test_grpo_recipe_trains_the_whole_model_from_the_released_weights(stages, recipe):
    """One GRPO stage of the full 8B model, FSDP over 8 GPUs on MareNostrum 5 (the step does not fit
    4 of 64 GB) and over one JUPITER node's 4, no reference model."""
    import yaml

    stage = stages[f"{recipe.stem}/grpo"]
    assert [key for key in stages if key.startswith(f"{recipe.stem}/")] == [f"{recipe.stem}/grpo"]
    settings = yaml.safe_load(recipe.read_text())["train"]["stages"]["grpo"]
    assert settings["objective"] == "grpo" and settings["grpo"]["beta"] == 0.0
    assert [r["name"] for r in settings["grpo"]["rewards"]] == ["math"]
    assert stage["ranks"] == {"mn5": 8, "jupiter": 4}[recipe.stem.rsplit("-", 1)[1]]
    assert stage["tp"] == stage["cp"] == 1
    assert stage["trainable"] == stage["params"] == pytest.approx(PARAMS["qwen3vl-8b"], rel=0.03)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", GRPO_RECIPES, ids=lambda r: r.stem)
def test_grpo_recipe_fits_its_gpus(estimates, recipe):
    """Each GRPO recipe's stage fits its cluster's GPU with 10% kept free, its train step and its
    rollout: the rank's prompts x 5 rows of 2048 tokens in the generation cache (Qwen3-VL-8B in
    bf16: 36 layers x 8 key-value heads x 128 x 2 x 2 bytes = 144 KiB a token), the weights
    gathered for the rollout in bf16 (all 8.8B of them on each GPU)."""
    rows = estimates[recipe.stem]
    assert set(rows) == {"grpo"}
    row = rows["grpo"]
    cluster = recipe.stem.rsplit("-", 1)[1]
    assert row["fits"] and row["gpu_memory_gib"] == {"mn5": 64, "jupiter": 96}[cluster]
    rollout = row["rollout"]
    assert rollout["rows"] == {"mn5": 20, "jupiter": 40}[cluster] and rollout["tokens"] == 2048
    assert rollout["cache_bytes"] == rollout["rows"] * 2048 * 36 * 8 * 128 * 2 * 2
    assert rollout["gathered_weights_bytes"] == pytest.approx(2 * PARAMS["qwen3vl-8b"], rel=0.03)
    assert row["peak_bytes"] == max(row["step_peak_bytes"], rollout["peak_bytes"]) <= row["usable_bytes"]
