"""LoRA stages of `vlmcore train`: the `lora` settings are checked before any work; only the
adapters train, sit in the optimizer and in the checkpoints; final/ holds the merged weights and
the adapters; a resume is exact; a 2-rank FSDP2 run equals one process."""

import shutil

import pytest
import torch
from helpers import load_dcp, read_metrics, train, train_cases, write_config
from safetensors.torch import load_file

from vlmcore.config import ConfigError, from_dict
from vlmcore.models.lora import is_adapter
from vlmcore.tiny import tiny_snapshot

STEPS = 6
ALPHA, RANK = 8.0, 4
LORA = {
    "rank": RANK,
    "alpha": ALPHA,
    # Column- and row-parallel linears under TP (q/v, o, the vision blocks' qkv and proj under vision TP).
    "targets": [
        "*.self_attn.[qvo]_proj",
        "model.visual.blocks.*.attn.qkv",
        "model.visual.blocks.*.attn.proj",
        "model.visual.merger.linear_fc1",
    ],
    "experts": True,
}


def base(**overrides):
    return {"model_path": "m", "output_dir": "o", "data": {"kind": "random"}, **overrides}


@pytest.mark.parametrize(
    "overrides,key",
    [
        (dict(lora={"rank": 4}, trainable=["model.visual.*"]), "trainable"),
        (dict(lora={"rank": 4, "experts": False, "targets": []}), "lora.targets"),
        # The chunked loss reads lm_head.weight itself: an adapter on the head would silently never train.
        (dict(lora={"rank": 4, "targets": ["*.q_proj", "lm_*"]}), "lora.targets"),
        (dict(lora={"rank": 4, "alpha": 0}), "lora.alpha"),
        (dict(lora={"rank": -1}), "lora.rank"),
    ],
)
def test_bad_lora_settings_are_refused_by_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        from_dict(base(**overrides))
    assert error.value.key == key


def test_lora_settings_load_under_tensor_and_expert_parallelism():
    parallel = {"tp": 2, "ep": 2, "modules": {"vision": {"tp": 2}}}
    cfg = from_dict(base(lora={"rank": 4}, parallel=parallel))
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.modules.vision.tp) == (2, 2, 2)


def test_lora_settings_load_with_their_defaults():
    cfg = from_dict(base(lora={"rank": 8}))
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.experts) == (8, 16.0, 0.0, True)
    assert cfg.lora.targets == ["*.self_attn.[qkvo]_proj"]
    assert from_dict(base()).lora.rank == 0  # no LoRA unless asked


def lora_config(tmp_path, snapshot, name, lora=LORA, **overrides):
    return write_config(
        tmp_path / f"{name}.yaml",
        snapshot,
        tmp_path / name,
        steps=STEPS,
        global_batch_rows=2,  # one row a rank on 2 ranks, two micro-batches on one
        optimizer={"lr": 1.0e-2, "weight_decay": 0.01},
        lora=lora,
        **overrides,
    )


# Other plans a LoRA stage runs under, each against the one-process eager run: activation
# checkpointing (the adapters inside the recomputed blocks), compiled blocks, context parallelism,
# tensor parallelism (of the language model, and of the vision tower too), expert parallelism, and
# the one-process run resumed at step 3 under TP (its adapters and optimizer state loaded into the
# TP placements, its step 6 checkpoint written from them).
PLANS = {
    "ac_full": (1, {"parallel": {"activation_checkpointing": "full"}}),
    "ac_selective": (1, {"parallel": {"activation_checkpointing": "selective"}}),
    "compiled": (1, {"parallel": {"compile": True}}),
    "cp2": (2, {"parallel": {"cp": 2}}),
    "tp2": (2, {"parallel": {"tp": 2}}),
    "tp2_vision_tp2": (2, {"parallel": {"tp": 2, "modules": {"vision": {"tp": 2}}}}),
    "ep2": (2, {"parallel": {"ep": 2}}),
    "tp2_resumed": (2, {"parallel": {"tp": 2}, "checkpoint": {"interval": 3, "keep": 2}}),
}


# Qwen3.5's mixers under TP: the fused in_proj_qkv stays whole on each rank, which adapts its
# heads' rows (the adapters' gradients partial per rank), in_proj_z column- and out_proj row-parallel.
QWEN3_5_LORA = {
    "rank": RANK,
    "alpha": ALPHA,
    "targets": ["*.linear_attn.in_proj_qkv", "*.linear_attn.in_proj_z", "*.linear_attn.out_proj", "*.mlp.down_proj"],
    "experts": False,
}


# A disjoint module layout (rank 0 the vision tower, rank 1 the language model, each with its own
# adapters), on Qwen3.5 since disjoint layouts take no mixture-of-experts model.
QWEN3_5_VISION_LORA = {**QWEN3_5_LORA, "targets": [*QWEN3_5_LORA["targets"], "model.visual.blocks.*.attn.proj"]}
DISJOINT = {"modules": {"vision": {"ranks": [0, 1]}, "language": {"ranks": [1, 2]}}}


def qwen3_5_configs(tmp_path):
    """(one-process configs, 2-rank configs) of Qwen3.5 LoRA stages: tp 2, and the disjoint layout."""
    snapshot = tiny_snapshot("qwen3_5", tmp_path / "qwen3_5_model")
    cases = {
        "qwen3_5_one": (QWEN3_5_LORA, {}),
        "qwen3_5_vision_one": (QWEN3_5_VISION_LORA, {}),
        "qwen3_5_tp2": (QWEN3_5_LORA, {"tp": 2}),
        "qwen3_5_disjoint": (QWEN3_5_VISION_LORA, DISJOINT),
    }
    configs = {
        name: lora_config(tmp_path, snapshot, name, lora=lora, checkpoint={"enabled": False}, parallel=parallel)
        for name, (lora, parallel) in cases.items()
    }
    one_process = [configs["qwen3_5_one"], configs["qwen3_5_vision_one"]]
    two_ranks = [configs["qwen3_5_tp2"], configs["qwen3_5_disjoint"]]
    return one_process, two_ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The file's training runs, one launch per world size (their start-up shared): one process
    with checkpoints every 3 steps, the same stage under each of PLANS, a next stage `init_from`
    the first's final/ (trained after it in the same launch), Qwen3.5's one-process run; then on 2
    ranks the stage under FSDP2 and each 2-rank plan (tp2_resumed from the one-process run's step 3
    checkpoint, written by the first launch) and Qwen3.5 under TP. Each launch's output is kept
    (plans_<nproc>.out)."""
    tmp_path = tmp_path_factory.mktemp("lora")
    snapshot = tiny_snapshot("qwen3_vl_moe", tmp_path / "model")
    qwen3_5_one_process, qwen3_5_two_ranks = qwen3_5_configs(tmp_path)
    one_process = [lora_config(tmp_path, snapshot, "one", checkpoint={"interval": 3, "keep": 2})]
    two_ranks = [lora_config(tmp_path, snapshot, "fsdp2", checkpoint={"enabled": False})]
    for name, (nproc, overrides) in PLANS.items():
        config = lora_config(tmp_path, snapshot, name, **{"checkpoint": {"enabled": False}, **overrides})
        if nproc == 1:
            one_process.append(config)
        else:
            two_ranks.append(config)
    previous = tmp_path / "one" / "final"
    one_process.append(lora_config(tmp_path, snapshot, "next", init_from=str(previous), checkpoint={"enabled": False}))
    one_process.extend(qwen3_5_one_process)
    two_ranks.extend(qwen3_5_two_ranks)
    proc = train_cases(1, one_process, timeout=len(one_process) * 300)
    (tmp_path / "plans_1.out").write_text(proc.stdout)
    stopped_at_step_3(tmp_path, "tp2_resumed")
    proc = train_cases(2, two_ranks, timeout=len(two_ranks) * 300)
    (tmp_path / "plans_2.out").write_text(proc.stdout)
    return tmp_path, snapshot


@pytest.fixture(scope="module")
def plans(runs):
    """The directory of the runs under PLANS (made by `runs`)."""
    tmp_path, _ = runs
    return tmp_path


def is_adapter_checkpoint(checkpoint):
    """Whether a checkpoint's model and optimizer state are the adapters' alone."""
    model_keys = [k.removeprefix("model.") for k in checkpoint if k.startswith("model.")]
    optimizer_params = {
        k.removeprefix("optim.state.").rpartition(".")[0] for k in checkpoint if k.startswith("optim.state.")
    }
    return bool(model_keys) and all(is_adapter(k) for k in [*model_keys, *optimizer_params])


@pytest.mark.slow
def test_only_adapters_train_and_are_checkpointed(runs):
    tmp_path, snapshot = runs
    out = tmp_path / "one"
    checkpoint = load_dcp(out / "checkpoints" / "step_3")
    model_keys = [k.removeprefix("model.") for k in checkpoint if k.startswith("model.")]
    assert model_keys and all(is_adapter(k) for k in model_keys)
    assert any("experts.gate_up_proj_lora_A" in k for k in model_keys)
    assert any(k.startswith("model.visual.blocks.0.attn.qkv") for k in model_keys)
    # optim.state.<parameter name>.<exp_avg | exp_avg_sq | step>
    optimizer_params = {
        k.removeprefix("optim.state.").rpartition(".")[0] for k in checkpoint if k.startswith("optim.state.")
    }
    assert optimizer_params and all(is_adapter(k) for k in optimizer_params), sorted(optimizer_params)[:3]
    # The frozen base in final/: untouched where no adapter is, base + B A alpha / rank where one is.
    final = load_dcp(out / "final")
    initial = load_file(snapshot / "model.safetensors")
    weights = {k.removeprefix("model."): v for k, v in final.items() if k.startswith("model.")}
    adapters = {k.removeprefix("adapters."): v for k, v in final.items() if k.startswith("adapters.")}
    assert not any(is_adapter(k) for k in weights) and adapters.keys() == set(model_keys)
    assert all(adapters[k].abs().max() > 0 for k in adapters if k.endswith("lora_B"))  # B moved off zero
    adapted = {k.rpartition(".")[0] for k in adapters if k.endswith(".lora_A")}
    for name, tensor in weights.items():
        module = name.rpartition(".")[0]
        if module in adapted and name.endswith(".weight"):
            delta = adapters[f"{module}.lora_B"] @ adapters[f"{module}.lora_A"] * ALPHA / RANK
            torch.testing.assert_close(tensor, initial[name] + delta)
        elif "mlp.experts." in name:
            delta = torch.bmm(adapters[f"{name}_lora_B"], adapters[f"{name}_lora_A"]) * ALPHA / RANK
            torch.testing.assert_close(tensor, initial[name] + delta)
        elif name in initial:
            assert torch.equal(tensor, initial[name]), name


def stopped_at_step_3(tmp_path, name):
    """A copy of the one-process run's directory as if it had stopped after its step 3 checkpoint."""
    resumed = tmp_path / name
    shutil.copytree(tmp_path / "one", resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step_6")
    (resumed / "done").unlink()
    (resumed / "checkpoints" / "latest").write_text("step_3")
    metrics = resumed / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:3]))
    return resumed


@pytest.mark.slow
def test_resume_from_an_adapter_checkpoint_is_exact(runs):
    """The run resumed at step 3 from adapters and optimizer state only (the base from the snapshot)
    ends bit for bit like the uninterrupted one."""
    tmp_path, snapshot = runs
    resumed = stopped_at_step_3(tmp_path, "resumed")
    cfg = lora_config(tmp_path, snapshot, "resumed", checkpoint={"interval": 3, "keep": 2})
    proc = train(1, cfg)
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    reference = read_metrics(tmp_path / "one")
    again = read_metrics(resumed)
    assert [m["step"] for m in again] == list(range(1, STEPS + 1))
    assert [(m["loss"], m["grad_norm"]) for m in again] == [(m["loss"], m["grad_norm"]) for m in reference]
    ref_final, final = load_dcp(tmp_path / "one" / "final"), load_dcp(resumed / "final")
    assert final.keys() == ref_final.keys()
    assert all(torch.equal(final[k], ref_final[k]) for k in ref_final)


@pytest.mark.slow
def test_two_rank_fsdp2_lora_run_equals_one_process(runs):
    tmp_path, _ = runs
    reference = [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / "one")]
    trajectory = [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / "fsdp2")]
    torch.testing.assert_close(torch.tensor(trajectory), torch.tensor(reference), rtol=1e-5, atol=1e-5)
    ref_final, final = load_dcp(tmp_path / "one" / "final"), load_dcp(tmp_path / "fsdp2" / "final")
    assert final.keys() == ref_final.keys()
    for key in ref_final:
        torch.testing.assert_close(final[key], ref_final[key], rtol=1e-4, atol=1e-4, msg=key)


@pytest.mark.slow
def test_export_writes_a_peft_adapter_that_gives_the_merged_models_logits(runs):
    """`vlmcore export --peft-adapter`: peft loads the adapter directory onto the transformers model
    of the base snapshot, and its logits are those of the merged model the same export wrote to --out."""
    from helpers import max_rel, vl_sample
    from peft import PeftModel
    from transformers import Qwen3VLMoeForConditionalGeneration

    from vlmcore.cli import main
    from vlmcore.tiny import IMAGE

    tmp_path, snapshot = runs
    merged_dir, adapter_dir = tmp_path / "export", tmp_path / "adapter"
    args = ["export", "--checkpoint", str(tmp_path / "one" / "final"), "--model", str(snapshot)]
    assert main([*args, "--out", str(merged_dir), "--peft-adapter", str(adapter_dir)]) == 0
    assert {p.name for p in adapter_dir.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    ids, pixels, grid = vl_sample([(1, 4, 4)], [5, 3], torch.Generator().manual_seed(2))
    inputs = dict(
        input_ids=ids[None], pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids[None] == IMAGE).int()
    )
    with torch.no_grad():
        base_model = Qwen3VLMoeForConditionalGeneration.from_pretrained(snapshot).eval()
        base = base_model(**inputs).logits
        adapted = PeftModel.from_pretrained(base_model, adapter_dir).eval()(**inputs).logits
        merged = Qwen3VLMoeForConditionalGeneration.from_pretrained(merged_dir).eval()(**inputs).logits
    assert max_rel(adapted, merged) < 1e-4
    assert max_rel(adapted, base) > 1e-3  # the adapters trained


def assert_run_equals(tmp_path, reference: str, name: str) -> dict:
    """Run `name` took the steps of run `reference`: loss and gradient norm each step (1e-5) and the
    final weights and adapters (1e-4). Returns the final state of `name`."""
    expected = [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / reference)]
    trajectory = [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / name)]
    assert len(expected) == STEPS
    torch.testing.assert_close(torch.tensor(trajectory), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    ref_final, final = load_dcp(tmp_path / reference / "final"), load_dcp(tmp_path / name / "final")
    assert final.keys() == ref_final.keys()
    for key in ref_final:
        torch.testing.assert_close(final[key], ref_final[key], rtol=1e-4, atol=1e-4, msg=key)
    return final


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_lora_run_under_another_plan_equals_one_process(runs, name):
    tmp_path, _ = runs
    assert_run_equals(tmp_path, "one", name)


@pytest.mark.slow
def test_qwen3_5_lora_run_under_tp_equals_one_process(plans):
    final = assert_run_equals(plans, "qwen3_5_one", "qwen3_5_tp2")
    assert any(key.endswith("in_proj_qkv.lora_A") for key in final)


@pytest.mark.slow
def test_lora_run_under_a_disjoint_layout_equals_one_process(plans):
    """The vision tower's adapters train on rank 0, the language model's on rank 1, as in one process."""
    final = assert_run_equals(plans, "qwen3_5_vision_one", "qwen3_5_disjoint")
    assert any(key.startswith("adapters.model.visual.") for key in final)
    assert any(key.endswith("in_proj_qkv.lora_A") for key in final)


@pytest.mark.slow
def test_a_run_resumed_under_tp_starts_from_the_one_process_checkpoint(plans):
    """The tp2_resumed plan (compared with the uninterrupted run above) did resume, and wrote its
    own step 6 checkpoint from the TP placements."""
    out = plans / "tp2_resumed"
    assert f"resumed from {out / 'checkpoints' / 'step_3'} at step 3" in (plans / "plans_2.out").read_text()
    assert is_adapter_checkpoint(load_dcp(out / "checkpoints" / "step_6"))


@pytest.mark.slow
def test_export_of_a_tensor_parallel_run_gives_the_one_process_peft_adapter(plans):
    """`vlmcore export --peft-adapter` of the TP run's final/ (adapters saved from their TP placements)
    writes the one-process run's adapter."""
    from vlmcore.cli import main

    tmp_path = plans
    adapters = {}
    for name in ("one", "tp2"):
        out = tmp_path / f"export_{name}"
        args = ["export", "--checkpoint", str(tmp_path / name / "final"), "--model", str(tmp_path / "model")]
        assert main([*args, "--out", str(out / "merged"), "--peft-adapter", str(out / "adapter")]) == 0
        adapters[name] = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapters["tp2"].keys() == adapters["one"].keys()
    assert any("experts" in key for key in adapters["one"]) and any("o_proj" in key for key in adapters["one"])
    for key, tensor in adapters["one"].items():
        torch.testing.assert_close(adapters["tp2"][key], tensor, rtol=1e-4, atol=1e-4, msg=key)


@pytest.mark.slow
def test_a_next_lora_stage_trains_fresh_adapters_on_the_merged_weights(runs):
    """A LoRA stage `init_from` a LoRA stage's final/ starts from its merged weights (not the base's)
    with new adapters: its final/ is those weights plus its own update only."""
    tmp_path, _ = runs
    first = load_dcp(tmp_path / "one" / "final")
    final = load_dcp(tmp_path / "next" / "final")
    assert read_metrics(tmp_path / "next")[0]["loss"] != read_metrics(tmp_path / "one")[0]["loss"]
    adapters = {k.removeprefix("adapters."): v for k, v in final.items() if k.startswith("adapters.")}
    for key, tensor in final.items():
        name = key.removeprefix("model.")
        if not key.startswith("model."):
            continue
        module = name.rpartition(".")[0]
        if f"{module}.lora_A" in adapters and name.endswith(".weight"):
            delta = adapters[f"{module}.lora_B"] @ adapters[f"{module}.lora_A"] * ALPHA / RANK
        elif f"{name}_lora_A" in adapters:
            delta = torch.bmm(adapters[f"{name}_lora_B"], adapters[f"{name}_lora_A"]) * ALPHA / RANK
        else:
            assert torch.equal(tensor, first[key]), key
            continue
        torch.testing.assert_close(tensor, first[key] + delta)
