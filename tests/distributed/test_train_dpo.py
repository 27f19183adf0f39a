"""`objective: dpo` in `vlmcore train`: the pair metrics in metrics.jsonl, the frozen reference,
an exact resume, and the runs under FSDP2, tensor, context and expert parallelism (on an MoE
model), LoRA and compiled blocks equal to one process (all 2-process runs in one launch), and bad
settings refused by key.

Tiny Qwen3-VL on deterministic random packed rows whose consecutive segments are the pairs
(`data.kind: random`, images on some rows only, so ranks mix text-only and image batches).
"""

import math

import pytest
import torch
import yaml
from helpers import load_dcp, read_metrics, train, train_cases, write_config

from vlmcore.config import ConfigError, from_dict
from vlmcore.tiny import tiny_snapshot

STEPS = 4
DPO_METRICS = ("dpo_loss", "dpo_chosen_reward", "dpo_rejected_reward", "dpo_margin", "dpo_accuracy")


def dpo_config(tmp_path, snapshot, name, **overrides):
    settings = dict(
        steps=STEPS,
        grad_accum_steps=2,
        objective="dpo",
        dpo={"beta": 0.5, "label_smoothing": 0.1},
        # eps 1e-6: an embedding row whose gradient all but cancels (~1e-10) is float32 noise of the
        # reductions' order, which AdamW at eps 1e-8 turns into steps of a few 1e-4 (0.1 of the
        # step of a row that trains) and at 1e-6 into 1e-6.
        optimizer={"lr": 1.0e-2, "weight_decay": 0.0, "eps": 1.0e-6},
        data={"kind": "random", "seq_len": 48, "segments": 4, "image_fraction": 0.5},
        checkpoint={"enabled": False},
    )
    settings.update(overrides)
    return write_config(tmp_path / f"{name}.yaml", snapshot, tmp_path / name, **settings)


LORA = {"rank": 4, "alpha": 8.0, "targets": ["*.self_attn.[qkvo]_proj", "*.mlp.*_proj"]}
# Each layout a DPO stage trains under, on 2 processes (one launch), and the one-process run it
# must equal: name -> (the one-process run's name, the settings both have, the layout's own).
LAYOUTS = {
    "tp2": ("one", {}, {"parallel": {"tp": 2}}),
    "vision_tp2_fsdp2": ("one", {}, {"grad_accum_steps": 1, "parallel": {"modules": {"vision": {"tp": 2}}}}),
    # Each side's log-probability is summed over its two context-parallel chunks; the blocks compiled.
    "cp2_compiled": ("one", {}, {"parallel": {"cp": 2, "compile": True}}),
    "lora_tp2": ("lora-one", {"lora": LORA, "dpo": {"reference": "adapters_off"}}, {"parallel": {"tp": 2}}),
    # Rank 0 runs the policy's and the reference's vision towers, rank 1 the language models.
    "disjoint": ("one", {}, {"parallel": {"modules": {"vision": {"ranks": [0, 1]}, "language": {"ranks": [1, 2]}}}}),
    # Qwen3-VL-MoE: the router's load-balancing loss over both sides' tokens, the experts over 2 EP ranks.
    "moe_ep2": ("moe-one", {"moe": True}, {"grad_accum_steps": 1, "parallel": {"ep": 2}}),
}


def settings_of(tmp_path, shared):
    """`shared` as config overrides: `moe` picks the MoE snapshot."""
    shared = dict(shared)
    snapshot = tmp_path / ("moe" if shared.pop("moe", False) else "model")
    return snapshot, shared


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process runs, in one launch: dense Qwen3-VL (the reference of most layouts; with
    checkpoints, what the resume test starts from), LoRA with its adapters off as the reference,
    and Qwen3-VL-MoE."""
    tmp_path = tmp_path_factory.mktemp("dpo_train")
    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    tiny_snapshot("qwen3_vl_moe", tmp_path / "moe")
    configs = [dpo_config(tmp_path, snapshot, "one", checkpoint={"interval": 2, "keep": 3})]
    for name in dict.fromkeys(reference for reference, _, _ in LAYOUTS.values() if reference != "one"):
        shared = next(shared for reference, shared, _ in LAYOUTS.values() if reference == name)
        model, overrides = settings_of(tmp_path, shared)
        configs.append(dpo_config(tmp_path, model, name, **overrides))
    train_cases(1, configs)
    return tmp_path, snapshot


@pytest.fixture(scope="module")
def two_ranks(one_process):
    """Every 2-process DPO run in one launch (train_cases): FSDP2, the two LoRA references, the
    LAYOUTS. Returns name -> the error of the launch, for the runs it stopped before they finished."""
    tmp_path, snapshot = one_process
    configs = [dpo_config(tmp_path, snapshot, "fsdp2", grad_accum_steps=1)]
    configs += [
        dpo_config(tmp_path, snapshot, f"lora-{reference}", lora=LORA, dpo={"reference": reference})
        for reference in ("copy", "adapters_off")
    ]
    for name, (_, shared, own) in LAYOUTS.items():
        model, overrides = settings_of(tmp_path, shared)
        configs.append(dpo_config(tmp_path, model, name, **deep_merge(overrides, own)))
    errors = {}
    try:
        train_cases(2, configs, timeout=len(configs) * 300)
    except AssertionError as error:
        for config in configs:
            if not (tmp_path / config.stem / "done").exists():
                errors[config.stem] = str(error)
    return errors


def deep_merge(base: dict, more: dict) -> dict:
    merged = dict(base)
    for key, value in more.items():
        merged[key] = deep_merge(merged[key], value) if isinstance(value, dict) and key in merged else value
    return merged


def assert_same_run(tmp_path, name, reference, metrics_atol=1e-6, weights_atol=1e-5):
    """The run `name` equals the one-process run `reference`: each step's DPO metrics and gradient
    norm, and the final weights."""
    metrics = read_metrics(tmp_path / name)
    by_step = {m["step"]: m for m in metrics}
    expected = read_metrics(tmp_path / reference)
    assert [m["step"] for m in metrics][-2:] == [STEPS - 1, STEPS]
    for m in expected:
        for key in (*DPO_METRICS, "grad_norm"):
            assert by_step[m["step"]][key] == pytest.approx(m[key], rel=1e-4, abs=metrics_atol), (name, m["step"], key)
    weights = load_dcp(tmp_path / name / "final")
    reference_weights = load_dcp(tmp_path / reference / "final")
    assert weights.keys() == reference_weights.keys()
    for key, value in reference_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=weights_atol, msg=f"{name} {key}")


@pytest.mark.slow
def test_dpo_metrics_start_at_the_reference_and_move(one_process):
    tmp_path, _ = one_process
    metrics = read_metrics(tmp_path / "one")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert all(math.isfinite(m[key]) for key in DPO_METRICS)
        assert m["loss"] == m["dpo_loss"]
        assert m["dpo_margin"] == pytest.approx(m["dpo_chosen_reward"] - m["dpo_rejected_reward"])
    first = metrics[0]
    # The reference is the policy's starting weights: on the first step every log-ratio is 0.
    assert first["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["dpo_chosen_reward"] == pytest.approx(0, abs=1e-6)
    assert first["dpo_rejected_reward"] == pytest.approx(0, abs=1e-6)
    assert first["dpo_accuracy"] == 0
    # Then the policy has moved and the reference has not: the log-ratios are no longer 0. (The
    # random pairs carry no preference to learn; the demo's do: config/demo-dpo.yaml.)
    for m in metrics[1:]:
        assert abs(m["dpo_chosen_reward"]) > 1e-3 and abs(m["dpo_loss"] - math.log(2)) > 1e-4


@pytest.mark.slow
def test_report_tabulates_and_plots_the_dpo_run(one_process):
    """`vlmcore report` on the real run's metrics.jsonl: the DPO table's row holds the means of its
    last steps (all 4 here) and the DPO plot is written and linked."""
    from helpers import dpo_table

    from vlmcore.report.scaling import write_report

    tmp_path, _ = one_process
    md = write_report(tmp_path / "report", train={"one": tmp_path / "one" / "metrics.jsonl"}).read_text()
    metrics = read_metrics(tmp_path / "one")
    steps, *values = dpo_table(md)["one"]
    assert int(steps) == STEPS
    for key, value in zip(DPO_METRICS, values, strict=True):
        assert float(value) == pytest.approx(sum(m[key] for m in metrics) / len(metrics), abs=1e-3), key
    assert "](plots/dpo_one.png)" in md and (tmp_path / "report" / "plots" / "dpo_one.png").is_file()


@pytest.mark.slow
def test_dpo_resume_and_two_ranks_equal_one_process(one_process, two_ranks):
    tmp_path, snapshot = one_process
    # Resumed: stopped after step 2 (its checkpoint kept), then trained on to the end.
    resumed = dpo_config(tmp_path, snapshot, "resumed", steps=2, checkpoint={"interval": 2, "keep": 3})
    train_cases(1, [resumed])
    settings = yaml.safe_load(resumed.read_text())
    resumed.write_text(yaml.safe_dump(settings | {"steps": STEPS}))
    (tmp_path / "resumed" / "done").unlink()
    train_cases(1, [resumed])
    assert "fsdp2" not in two_ranks, two_ranks.get("fsdp2")
    # Weights to atol 2e-5, 5x under tests/distributed/test_parallel_exactness.py's: 4 AdamW steps at lr 1e-2
    # after a gradient norm that 2 ranks sum from their shards' norms (a float32 rounding apart from
    # one process's) leave weights up to 1.2e-5 apart (one embedding entry; the rest under 4e-6).
    for name in ("resumed", "fsdp2"):
        assert_same_run(tmp_path, name, "one", weights_atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_under_a_layout_equals_one_process(one_process, two_ranks, name):
    """DPO under tensor parallelism (the vocabulary-parallel log-probabilities; the vision tower's
    own tp), context parallelism (a sequence's log-probability over its chunks; compiled blocks),
    a disjoint module layout, LoRA under tp, and expert parallelism on an MoE model: the
    one-process run's losses, rewards, margins, accuracy, gradient norms and final weights, within
    tests/distributed/test_parallel_exactness.py's absolute tolerances (1e-5 on the step's figures, 1e-4 on
    the weights). A side's log-probability is a sum over its tokens (about -100 here): the
    reductions' order under tp moves a reward by a few 1e-6."""
    tmp_path, _ = one_process
    assert name not in two_ranks, two_ranks.get(name)
    reference, _, _ = LAYOUTS[name]
    assert_same_run(tmp_path, name, reference, metrics_atol=1e-5, weights_atol=1e-4)
    if name == "moe_ep2":  # the router's loss takes part, the same as in one process
        for got, expected in zip(read_metrics(tmp_path / name), read_metrics(tmp_path / reference)):
            assert got["moe_aux_loss"] == pytest.approx(expected["moe_aux_loss"], rel=1e-5)
            assert expected["moe_aux_loss"] > 0


@pytest.mark.slow
def test_lora_dpo_reference_with_adapters_off_equals_a_frozen_copy(one_process, two_ranks):
    """A LoRA DPO stage's reference can be the policy with its adapters off: the same weights as
    a frozen copy of the stage's start, without a second model. On 2 FSDP2 ranks (the reference's
    forward runs through the policy's sharded model, outside its backward) both references give
    the same metrics and adapters, and the first step starts at the reference (loss log 2)."""
    tmp_path, snapshot = one_process
    for name in ("lora-copy", "lora-adapters_off"):
        assert name not in two_ranks, two_ranks.get(name)
    copy = read_metrics(tmp_path / "lora-copy")
    adapters_off = read_metrics(tmp_path / "lora-adapters_off")
    assert [m["step"] for m in adapters_off] == list(range(1, STEPS + 1))
    assert adapters_off[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(adapters_off[-1]["dpo_loss"] - math.log(2)) > 1e-4  # the adapters moved the policy
    for expected, got in zip(copy, adapters_off):
        for key in (*DPO_METRICS, "grad_norm"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), (got["step"], key)
    copy_weights = load_dcp(tmp_path / "lora-copy" / "final")
    for key, value in load_dcp(tmp_path / "lora-adapters_off" / "final").items():
        torch.testing.assert_close(value, copy_weights[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"dpo": {"beta": 0.0}}, "dpo.beta"),
        ({"dpo": {"label_smoothing": 0.5}}, "dpo.label_smoothing"),
        ({"data": {"kind": "random", "segments": 3}}, "data.segments"),
        ({"dpo": {"reference": "adapters_off"}}, "dpo.reference"),
    ],
)
def test_bad_dpo_settings_are_refused_by_key(overrides, key):
    data = {"model_path": "m", "output_dir": "o", "objective": "dpo", "data": {"kind": "random"}}
    for section, value in overrides.items():
        data[section] = {**data.get(section, {}), **value}
    with pytest.raises(ConfigError) as error:
        from_dict(data)
    assert error.value.key == key and str(error.value).startswith(key)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_vl_moe", "qwen3_5_moe"])
def test_dpo_on_every_family_and_layout_passes_the_run_checks(kind):
    """The checks of the run (the workflow's parse, `vlmcore memory`, the start of `vlmcore train`)
    take DPO on the MoE families and under tp, cp and ep as they take SFT."""
    from vlmcore.parallel.checks import check_run
    from vlmcore.tiny import hf_config

    for parallel, world in (({}, 1), ({"tp": 2}, 2), ({"cp": 2}, 2), ({"ep": 2}, 2)):
        cfg = from_dict(
            {"model_path": "m", "output_dir": "o", "objective": "dpo", "data": {"kind": "random"}, "parallel": parallel}
        )
        check_run(cfg, world, hf_config(kind))


@pytest.mark.slow
def test_dpo_without_pairs_is_refused(tmp_path):
    """Packed data without preference pairs: refused by key before the run starts."""
    from helpers import make_demo_model_dir

    from vlmcore.data.pack.dataset import pack
    from vlmcore.data.prepare.dataset import prepare
    from vlmcore.data.synthetic.image import generate

    model = make_demo_model_dir(tmp_path / "model")
    generate(tmp_path / "raw", num_train=4, num_eval=1, seed=0)
    prepare([tmp_path / "raw" / "conversations.jsonl"], tmp_path / "data")
    pack(tmp_path / "data", model, tmp_path / "packed", seq_len=256, max_patches=512)
    config = write_config(
        tmp_path / "run.yaml",
        model,
        tmp_path / "run",
        steps=1,
        objective="dpo",
        data_path=str(tmp_path / "packed"),
        data={"kind": "packed"},
    )
    proc = train(1, config, check=False)
    assert proc.returncode == 2  # refused with the config, before any work
    assert "data_path: objective is dpo" in proc.stderr and "no preference pairs" in proc.stderr
    assert not (tmp_path / "run").exists()
