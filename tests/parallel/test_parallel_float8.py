"""FP8 training (`precision.fp8`, torchao float8, emulated on CPU): the settings and the device
refused by key; which linear layers are converted; the converted model's loss close to float32's
and trained; FSDP2 with the float8 all-gather (float32 and bfloat16), TP and EP against one
process; an exact resume."""

import copy
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import read_metrics, train, train_cases, write_config
from torchao.float8.float8_linear import Float8Linear

from vlmcore import models
from vlmcore.config import ConfigError, from_dict
from vlmcore.parallel.checks import check_fp8_device
from vlmcore.parallel.float8 import convert_to_float8, precompute_scales
from vlmcore.tiny import hf_config, tiny_snapshot

TENSORWISE = {"recipe": "tensorwise", "emulate": True}
ROWWISE = {"recipe": "rowwise", "emulate": True}


def base(**overrides):
    return {"model_path": "m", "output_dir": "o", "data": {"kind": "random"}, **overrides}


def test_fp8_settings_load_and_bad_ones_are_refused_by_key():
    assert from_dict(base()).precision.fp8.recipe == "none"  # off unless asked
    fp8 = from_dict(base(precision={"fp8": TENSORWISE})).precision.fp8
    assert (fp8.recipe, fp8.emulate) == ("tensorwise", True)
    for overrides, key in [
        (dict(precision={"fp8": {"recipe": "blockwise"}}), "precision.fp8.recipe"),
        (dict(precision={"fp8": {"emulate": "yes"}}), "precision.fp8.emulate"),
        (dict(precision={"fp8": TENSORWISE}, lora={"rank": 4}), "precision.fp8.recipe"),
    ]:
        with pytest.raises(ConfigError) as error:
            from_dict(base(**overrides))
        assert error.value.key == key


def test_fp8_is_refused_on_devices_without_float8():
    """Real float8 matmuls need CUDA compute capability 8.9 (Ada) or more; emulation runs anywhere."""
    real = from_dict(base(precision={"fp8": {"recipe": "rowwise"}}))
    with pytest.raises(ConfigError, match="this run is on cpu") as error:
        check_fp8_device(real, "cpu", None)
    assert error.value.key == "precision.fp8.recipe"
    with pytest.raises(ConfigError, match="NVIDIA A100-SXM4-80GB has 8.0") as error:
        check_fp8_device(real, "cuda", (8, 0), "NVIDIA A100-SXM4-80GB")
    assert error.value.key == "precision.fp8.recipe"
    check_fp8_device(real, "cuda", (8, 9), "NVIDIA L40S")
    check_fp8_device(real, "cuda", (9, 0), "NVIDIA H200")
    check_fp8_device(from_dict(base(precision={"fp8": ROWWISE})), "cpu", None)
    check_fp8_device(from_dict(base()), "cpu", None)


@pytest.mark.slow  # a `vlmcore train` start-up (~18 s on a shared CPU); the check itself is tested above
def test_vlmcore_train_on_cpu_without_emulate_stops_before_any_work(tmp_path):
    snapshot = tiny_snapshot("qwen3", tmp_path / "model")
    config = write_config(
        tmp_path / "run.yaml", snapshot, tmp_path / "run", precision={"fp8": {"recipe": "tensorwise"}}
    )
    proc = train(1, config, check=False)
    assert proc.returncode != 0
    assert "precision.fp8.recipe: tensorwise needs a CUDA GPU with float8" in proc.stderr
    assert "this run is on cpu" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_fp8_without_torchao_is_refused_naming_the_key(monkeypatch):
    """A CPU install without the `fp8` extra runs everything else; FP8 stops with the key and the fix."""
    import sys

    from vlmcore.parallel.float8 import require_torchao

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if not installed: import raises
    with pytest.raises(ConfigError, match=r"needs torchao \(pip install 'vlmcore\[fp8\]'\)") as error:
        require_torchao()
    assert error.value.key == "precision.fp8.recipe"


def float8_names(model):
    return {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_moe"])
def test_only_the_language_models_attention_and_dense_mlp_are_converted(kind):
    model = models.build_model(hf_config(kind))
    linears = {name for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    converted = convert_to_float8(model.decoder_layers(), from_dict(base(precision={"fp8": TENSORWISE})).precision.fp8)
    names = float8_names(model)
    in_language_blocks = {n for n in linears if ".layers." in n and n.split(".")[-2] in ("self_attn", "mlp")}
    assert names == in_language_blocks
    assert len(converted) == len(names)
    assert all(".layers." in n and "visual" not in n for n in names)
    assert "lm_head" not in names and not any("merger" in n for n in names)
    if kind == "qwen3_moe":
        # the router and the grouped routed experts stay as they were; the dense projections are the attention's
        assert all("self_attn" in n for n in names) and len(names) == 4 * 2
        assert type(model.decoder_layers()[0].mlp.gate).__name__ == "TopKRouter"
    else:
        assert len(names) == 7 * 2


def test_widths_not_a_multiple_of_16_stay_with_a_log_line(caplog):
    config = hf_config("qwen3")
    config.intermediate_size = 72
    model = models.build_model(config)
    with caplog.at_level(logging.WARNING, logger="vlmcore.parallel.float8"):
        convert_to_float8(model.decoder_layers(), from_dict(base(precision={"fp8": ROWWISE})).precision.fp8)
    assert float8_names(model) == {f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"}
    assert "layers.0.mlp.up_proj stays in param_dtype: its shape (72, 64) is not a multiple of 16" in caplog.text


@pytest.mark.parametrize("fp8", [TENSORWISE, ROWWISE], ids=["tensorwise", "rowwise"])
def test_converted_model_stays_close_to_float32_and_trains(tmp_path, fp8):
    """The emulated float8 logits within the e4m3 rounding (3 mantissa bits) of float32's, and a few
    AdamW steps on one batch lower its loss."""
    snapshot = tiny_snapshot("qwen3", tmp_path / "model")
    reference = models.build_model(snapshot, device="cpu")
    models.load_hf_weights(reference, snapshot)
    model = copy.deepcopy(reference)
    convert_to_float8(model.decoder_layers(), from_dict(base(precision={"fp8": fp8})).precision.fp8)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        logits = model(ids).logits
    assert not torch.equal(logits, expected)  # float8 did round
    assert (logits - expected).norm() / expected.norm() < 0.05
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        logits = model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        assert all(p.grad is not None for p in model.decoder_layers()[0].self_attn.q_proj.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_fsdp_float8_all_gather_precomputes_scales_for_tensorwise_only(one_process_group):
    from torch.distributed.fsdp import fully_shard

    for fp8, precomputed in [(TENSORWISE, True), (ROWWISE, False)]:
        model = models.build_model(hf_config("qwen3"))
        convert_to_float8(model.decoder_layers(), from_dict(base(precision={"fp8": fp8})).precision.fp8)
        for block in model.decoder_layers():
            fully_shard(block)
        fully_shard(model)
        assert (precompute_scales(model) is not None) == precomputed
    assert precompute_scales(models.build_model(hf_config("qwen3"))) is None  # no float8: nothing to do


# One process, two ranks with FSDP2 (float8 all-gather for tensorwise) and TP: 6 steps of 2 rows.
STEPS = 6


def fp8_config(tmp_path, snapshot, name, **overrides):
    return write_config(
        tmp_path / f"{name}.yaml",
        snapshot,
        tmp_path / name,
        steps=STEPS,
        global_batch_rows=2,  # one row a rank on 2 ranks, two micro-batches on one
        optimizer={"lr": 1.0e-2, "weight_decay": 0.01},
        data={"kind": "random", "seq_len": 32, "segments": 2, "image_fraction": 0.0},
        **overrides,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch of one process (float32, both recipes, a MoE model) and one of two ranks (FSDP2
    with each recipe, FSDP2 in bfloat16, TP 2, EP 2)."""
    tmp_path = tmp_path_factory.mktemp("fp8")
    snapshot = tiny_snapshot("qwen3", tmp_path / "model")
    moe = tiny_snapshot("qwen3_moe", tmp_path / "moe")
    saved = {"checkpoint": {"interval": 3, "keep": 2}}
    unsaved = {"checkpoint": {"enabled": False}}
    bf16 = {"fp8": TENSORWISE, "param_dtype": "bfloat16", "reduce_dtype": "float32"}
    one = train_cases(
        1,
        [
            fp8_config(tmp_path, snapshot, "fp32", **unsaved),
            fp8_config(tmp_path, snapshot, "tensorwise", precision={"fp8": TENSORWISE}, **saved),
            fp8_config(tmp_path, snapshot, "rowwise", precision={"fp8": ROWWISE}, **unsaved),
            fp8_config(tmp_path, moe, "moe_tensorwise", precision={"fp8": TENSORWISE}, **unsaved),
        ],
    )
    two = train_cases(
        2,
        [
            fp8_config(tmp_path, snapshot, "fsdp_tensorwise", precision={"fp8": TENSORWISE}, **unsaved),
            fp8_config(tmp_path, snapshot, "fsdp_rowwise", precision={"fp8": ROWWISE}, **unsaved),
            fp8_config(tmp_path, snapshot, "fsdp_tensorwise_bf16", precision=bf16, **unsaved),
            fp8_config(
                tmp_path, snapshot, "tp_tensorwise", precision={"fp8": TENSORWISE}, parallel={"tp": 2}, **unsaved
            ),
            fp8_config(tmp_path, moe, "ep_tensorwise", precision={"fp8": TENSORWISE}, parallel={"ep": 2}, **unsaved),
        ],
    )
    return tmp_path, snapshot, one.stdout + two.stdout


def trajectory(path):
    return torch.tensor([(m["loss"], m["grad_norm"]) for m in read_metrics(path)])


@pytest.mark.slow
def test_fp8_runs_convert_and_stay_close_to_float32(runs):
    tmp_path, _, stdout = runs
    assert stdout.count("fp8: tensorwise (emulated): 14 linear layers converted") == 4
    assert stdout.count("fp8: rowwise (emulated): 14 linear layers converted") == 2
    assert stdout.count("fp8: tensorwise (emulated): 8 linear layers converted") == 2  # MoE: attention only
    fp32 = trajectory(tmp_path / "fp32")
    for recipe in ("tensorwise", "rowwise", "fsdp_tensorwise_bf16"):
        fp8 = trajectory(tmp_path / recipe)
        assert not torch.equal(fp8, fp32)
        # random tokens: the loss stays near ln(256); float8 moves it by e4m3's rounding
        torch.testing.assert_close(fp8[:, 0], fp32[:, 0], rtol=0, atol=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_two_rank_fsdp2_fp8_run_equals_one_process(runs, recipe):
    """Tensorwise: the weights all-gathered in float8 with the scale of the whole weight (the
    precomputed amax is all-reduced), so each rank casts the same values as one process: the first
    steps agree to float32 noise. The gradients' sum over ranks differs from one process's in
    float32 rounding only, but a weight that this moves across an e4m3 rounding edge moves by one
    float8 step (1/8 of its value's binade), and such flips add up from step to step: the later
    steps' losses to 1e-3 and gradient norms to 5% (float8 against float32 differs by 25%)."""
    tmp_path, _, _ = runs
    reference = trajectory(tmp_path / recipe)
    fsdp = trajectory(tmp_path / f"fsdp_{recipe}")
    torch.testing.assert_close(fsdp[:3], reference[:3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fsdp[:, 0], reference[:, 0], rtol=1e-3, atol=0)
    torch.testing.assert_close(fsdp[:, 1], reference[:, 1], rtol=5e-2, atol=0)


@pytest.mark.slow
def test_two_rank_tp_fp8_run_is_close_to_one_process(runs):
    """torch's plain TP styles over Float8Linear: each rank's float8 casts scale its own shards of
    the activations and gradients, so TP is as close to one process as float8 is to float32."""
    tmp_path, _, _ = runs
    reference = trajectory(tmp_path / "tensorwise")
    tp = trajectory(tmp_path / "tp_tensorwise")
    torch.testing.assert_close(tp[:, 0], reference[:, 0], rtol=0, atol=0.05)


@pytest.mark.slow
def test_two_rank_ep_fp8_run_equals_one_process(runs):
    """Expert parallelism over a MoE model whose attention is float8 (the routed experts stay in
    their dtype): the tokens' all-to-all changes no float8 cast, the attention's FSDP2 all-gather is
    float8 as above."""
    tmp_path, _, _ = runs
    reference = trajectory(tmp_path / "moe_tensorwise")
    ep = trajectory(tmp_path / "ep_tensorwise")
    torch.testing.assert_close(ep[:3], reference[:3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ep[:, 0], reference[:, 0], rtol=1e-3, atol=0)
    torch.testing.assert_close(ep[:, 1], reference[:, 1], rtol=5e-2, atol=0)


@pytest.mark.slow
def test_resume_of_an_fp8_run_is_exact(runs):
    """Resumed at step 3 from its DCP checkpoint, the tensorwise run ends bit for bit like the
    uninterrupted one (torchao's float8 weights save as plain tensors)."""
    tmp_path, snapshot, _ = runs
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "tensorwise", resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step_6")
    (resumed / "done").unlink()
    (resumed / "checkpoints" / "latest").write_text("step_3")
    metrics = resumed / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:3]))
    config = fp8_config(tmp_path, snapshot, "resumed", precision={"fp8": TENSORWISE}, checkpoint={"interval": 3})
    proc = train(1, config)
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    assert [m["step"] for m in read_metrics(resumed)] == list(range(1, STEPS + 1))
    assert torch.equal(trajectory(resumed), trajectory(tmp_path / "tensorwise"))
