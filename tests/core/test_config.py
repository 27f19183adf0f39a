import math
import typing
from pathlib import Path

import pytest
import yaml

from vlmcore import config_docs
from vlmcore.config import ConfigError, TrainConfig, from_dict, leaves, load_config, save_config
from vlmcore.config_docs import render

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "workflow/schemas/config.schema.yaml"

WORKFLOW_YAML = """
model_path: results/demo/model
init_from: null
data_path: results/demo/packed/captions
output_dir: results/demo/train/stage1
steps: 200
micro_batch_size: 1
grad_accum_steps: 1
seed: 0
trainable: ["model.visual.merger.*", "model.visual.deepstack_merger_list.*"]
optimizer: {lr: 1.0e-3, vision_lr: null, projector_lr: null, weight_decay: 0.01, betas: [0.9, 0.95], eps: 1.0e-8}
schedule: {name: cosine, warmup_steps: 10, min_lr_ratio: 0.1}
max_grad_norm: 1.0
parallel: {dp_replicate: 1, dp_shard: -1, tp: 1, mode: fsdp, activation_checkpointing: none, compile: false}
precision: {param_dtype: float32, reduce_dtype: float32}
checkpoint: {interval: 50, keep: 2, async: false}
save_final: true
num_workers: 0
deterministic: false
metrics: {tensorboard: true, wandb: false, peak_tflops: null}
"""


@pytest.fixture
def workflow_config(tmp_path):
    path = tmp_path / "stage1.yaml"
    path.write_text(WORKFLOW_YAML)
    return path


def test_loads_the_workflow_config(workflow_config):
    cfg = load_config(workflow_config)
    assert cfg.steps == 200 and cfg.optimizer.betas == (0.9, 0.95) and cfg.optimizer.lr == 1e-3
    assert cfg.trainable == ["model.visual.merger.*", "model.visual.deepstack_merger_list.*"]
    assert cfg.checkpoint.async_save is False and cfg.parallel.dp_shard == -1
    assert cfg.init_from is None and cfg.data.kind == "packed"


def test_overrides_are_typed(workflow_config):
    cfg = load_config(
        workflow_config,
        [
            "steps=70",
            "optimizer.lr=1e-4",
            "parallel.tp=2",
            "checkpoint.async=true",
            "trainable=[]",
            "schedule.name=wsd",
            "schedule.cooldown=1-sqrt",
        ],
    )
    assert cfg.steps == 70 and cfg.optimizer.lr == 1e-4 and cfg.parallel.tp == 2
    assert cfg.checkpoint.async_save is True and cfg.trainable == [] and cfg.schedule.cooldown == "1-sqrt"


@pytest.mark.parametrize(
    "override, message",
    [
        ("steps=ten", "steps: expected an integer"),
        ("optimizer.lrr=1", "optimizer.lrr: unknown key"),
        ("parallel.mode=zero3", "parallel.mode: must be one of"),
        ("optimizer.betas=[0.9]", "optimizer.betas: expected a list of 2"),
        ("schedule.unit=samples", "schedule.total_samples: is required"),
        ("save_final=1", "save_final: expected true or false"),
        ("steps", "expected key=value"),
    ],
)
def test_bad_values_name_the_file_and_key(workflow_config, override, message):
    with pytest.raises(ConfigError) as e:
        load_config(workflow_config, [override])
    assert message in str(e.value)
    if "=" in override:
        assert str(workflow_config) in str(e.value)


def test_missing_required_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\n")
    with pytest.raises(ConfigError, match="model_path: is required"):
        load_config(path)


def test_resolved_config_round_trips(workflow_config, tmp_path):
    cfg = load_config(workflow_config, ["data.kind=random", "schedule.name=wsd"])
    save_config(cfg, tmp_path / "resolved.yaml")
    again = load_config(tmp_path / "resolved.yaml")
    assert again == cfg and isinstance(again, TrainConfig)


# (--set overrides of a valid config, the key the error must name). Paths are relative to the
# test's directory, which holds `model/config.json`, `data/` and `final/.metadata`.
BAD_VALUES = [
    ("optimizer.lr=-1e-3", "optimizer.lr"),
    ("optimizer.lr=.inf", "optimizer.lr"),
    ("optimizer.lr=.nan", "optimizer.lr"),
    ("optimizer.lr=fast", "optimizer.lr"),
    ("optimizer.vision_lr=-1e-4", "optimizer.vision_lr"),
    ("optimizer.projector_lr=-1", "optimizer.projector_lr"),
    ("optimizer.betas=[1.0,0.95]", "optimizer.betas"),
    ("optimizer.betas=[0.9,-0.1]", "optimizer.betas"),
    ("optimizer.betas=[0.9,1.5]", "optimizer.betas"),
    ("optimizer.betas=[0.9]", "optimizer.betas"),
    ("optimizer.betas=[0.9,high]", "optimizer.betas[1]"),
    ("optimizer.weight_decay=-0.01", "optimizer.weight_decay"),
    ("optimizer.eps=0", "optimizer.eps"),
    ("optimizer.eps=-1e-8", "optimizer.eps"),
    ("optimizer.momentum=0.9", "optimizer.momentum"),
    ("schedule.warmup_steps=25", "schedule.warmup_steps"),
    ("schedule.warmup_steps=-1", "schedule.warmup_steps"),
    ("schedule.warmup_samples=-1", "schedule.warmup_samples"),
    ("schedule.min_lr_ratio=1.5", "schedule.min_lr_ratio"),
    ("schedule.decay_fraction=0", "schedule.decay_fraction"),
    ("schedule.name=cosinee", "schedule.name"),
    ("schedule.cooldown=sqrt", "schedule.cooldown"),
    ("schedule.unit=tokens", "schedule.unit"),
    ("schedule.unit=samples", "schedule.total_samples"),
    ("schedule.unit=samples schedule.total_samples=0", "schedule.total_samples"),
    ("schedule.unit=samples schedule.total_samples=100 schedule.warmup_samples=101", "schedule.warmup_samples"),
    ("data.image_fraction=1.5", "data.image_fraction"),
    ("data.image_fraction=-0.1", "data.image_fraction"),
    ("data.kind=random data.seq_len=1", "data.seq_len"),
    ("data.kind=random data.segments=0", "data.segments"),
    ("data.kind=random data.image_side=0", "data.image_side"),
    ("data.kind=webdataset", "data.kind"),
    ("steps=0", "steps"),
    ("steps=ten", "steps"),
    ("micro_batch_size=0", "micro_batch_size"),
    ("grad_accum_steps=0", "grad_accum_steps"),
    ("seed=-1", "seed"),
    ("num_workers=-1", "num_workers"),
    ("max_grad_norm=-1", "max_grad_norm"),
    ("loss_chunk_tokens=0", "loss_chunk_tokens"),
    ("max_nonfinite_steps=0", "max_nonfinite_steps"),
    ("checkpoint.interval=-1", "checkpoint.interval"),
    ("checkpoint.keep=0", "checkpoint.keep"),
    ("checkpoint.async=1", "checkpoint.async"),
    ("parallel.tp=0", "parallel.tp"),
    ("parallel.ep=0", "parallel.ep"),
    ("parallel.dp_replicate=0", "parallel.dp_replicate"),
    ("parallel.dp_shard=0", "parallel.dp_shard"),
    ("parallel.mode=zero3", "parallel.mode"),
    ("parallel.activation_checkpointing=some", "parallel.activation_checkpointing"),
    ("precision.param_dtype=float8", "precision.param_dtype"),
    ("precision.reduce_dtype=int8", "precision.reduce_dtype"),
    ("metrics.peak_tflops=0", "metrics.peak_tflops"),
    ("dtype=float8", "dtype"),
    ("trainable=model.*", "trainable"),
    ("output_dir=''", "output_dir"),
    ("data_path=null", "data_path"),
    ("data_path=nowhere", "data_path"),
    ("model_path=nowhere", "model_path"),
    ("model_path=data", "model_path"),
    ("init_from=nowhere", "init_from"),
    ("init_from=model", "init_from"),
    # the rules between keys, the other ranges, and the shapes a typo gives
    ("parallel.vision=fsdp", "parallel.vision"),  # removed: fsdp was its only value
    ("parallel.mode=ddp parallel.dp_shard=2", "parallel.dp_shard"),
    ("parallel.dp_shard=-2", "parallel.dp_shard"),
    ("parallel.linear_attention=triton", "parallel.linear_attention"),
    ("parallel.sequence_parallel=1", "parallel.sequence_parallel"),
    ("parallel.modules.vision.tp=0", "parallel.modules.vision.tp"),
    ("parallel.modules.language.dp_shard=-2", "parallel.modules.language.dp_shard"),
    ("parallel.modules.vision.pp=2", "parallel.modules.vision.pp"),
    ("parallel.modules.vision.ranks=some", "parallel.modules.vision.ranks"),
    ("parallel.modules.vision.ranks=[2,1]", "parallel.modules.vision.ranks"),
    ("parallel.modules.vision.ranks=[0,1,2]", "parallel.modules.vision.ranks"),
    ("parallel.modules.vision.ranks=[0,2]", "parallel.modules.language.ranks"),  # all XOR ranges
    ("parallel.mode=ddp parallel.modules.vision.dp_shard=2", "parallel.modules.vision.dp_shard"),
    ("data.kind=random data.seq_len=16 data.segments=4", "data.image_side"),
    ("data.segments=200", "data.segments"),
    ("seed=4294967296", "seed"),
    ("optimizer.weight_decay=.inf", "optimizer.weight_decay"),
    ("optimizer.eps=.nan", "optimizer.eps"),
    ("optimizer.vision_lr=.inf", "optimizer.vision_lr"),
    ("max_grad_norm=.inf", "max_grad_norm"),
    ("schedule.min_lr_ratio=-0.1", "schedule.min_lr_ratio"),
    ("schedule.decay_fraction=1.5", "schedule.decay_fraction"),
    ("schedule.total_samples=-5", "schedule.total_samples"),
    ("metrics.peak_tflops=-5", "metrics.peak_tflops"),
    ("optimizer=fast", "optimizer"),
    ("precision=bfloat16", "precision"),
    ("checkpoint.interval=1.5", "checkpoint.interval"),
    ("steps=1e3", "steps"),
    ("grad_accum_steps=-3", "grad_accum_steps"),
    ("num_workers=two", "num_workers"),
    ("trainable=[1]", "trainable[0]"),
    ("model_path=''", "model_path"),
    ("data_path=''", "data_path"),
    ("resilience.max_restarts=-1", "resilience.max_restarts"),
    ("resilience.collective_timeout_s=0", "resilience.collective_timeout_s"),
    ("resilience.straggler_margin=0", "resilience.straggler_margin"),
]


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A valid stage config with relative paths, in the current directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "final").mkdir()
    (tmp_path / "final/.metadata").write_text("")
    path = tmp_path / "stage.yaml"
    path.write_text(
        WORKFLOW_YAML.replace("results/demo/train/stage1", "out")
        .replace("results/demo/", "")
        .replace("packed/captions", "data")
        .replace("steps: 200", "steps: 24")
    )
    return path


def train_cli(monkeypatch, path, overrides):
    """`vlmcore train` in this process, stopped where training would begin: (exit code, config)."""
    from vlmcore.cli import main
    from vlmcore.train import loop

    started = []
    monkeypatch.setattr(loop, "train", lambda cfg: started.append(cfg) or 0)
    args = ["train", str(path)] + [a for o in overrides for a in ("--set", o)]
    return main(args), (started[0] if started else None)


def test_the_base_config_of_the_bad_values_is_valid(run_dir, monkeypatch):
    code, cfg = train_cli(monkeypatch, run_dir, ["init_from=final"])
    assert code == 0 and cfg.steps == 24 and cfg.data_path == "data"


@pytest.mark.parametrize("overrides, key", BAD_VALUES)
def test_train_refuses_a_bad_value_in_one_line_naming_file_and_key(run_dir, monkeypatch, capsys, overrides, key):
    code, cfg = train_cli(monkeypatch, run_dir, overrides.split(" "))
    err = capsys.readouterr().err
    assert (code, cfg) == (2, None)
    assert err.startswith(f"error: {run_dir}: {key}: ") and err.count("\n") == 1, err
    assert not (run_dir.parent / "out").exists()


def test_zero_learning_rate_is_accepted_with_a_warning(run_dir, monkeypatch, capsys):
    code, cfg = train_cli(monkeypatch, run_dir, ["optimizer.lr=0", "optimizer.vision_lr=1e-4"])
    err = capsys.readouterr().err
    assert code == 0 and cfg.optimizer.lr == 0
    assert f"warning: {run_dir}: optimizer.lr is 0" in err and "vision_lr" not in err


@pytest.mark.parametrize(
    "override, message",
    [
        ("schedule.name=cosinee", "schedule.name: must be one of cosine, wsd, constant, got 'cosinee'"),
        ("optimizer.lr=-1e-3", "optimizer.lr: must be a finite number >= 0, got -0.001"),
        ("optimizer.lr=.nan", "optimizer.lr: must be a finite number >= 0, got nan"),
        ("optimizer.betas=[0.9,1.0]", "optimizer.betas: each must be a finite number in [0, 1), got [0.9, 1.0]"),
        ("schedule.decay_fraction=0", "schedule.decay_fraction: must be a finite number in (0, 1], got 0.0"),
        ("parallel.dp_shard=0", "parallel.dp_shard: must be >= 1 or -1, got 0"),
        ("steps=0", "steps: must be >= 1, got 0"),
        (
            "schedule.warmup_steps=300",
            "schedule.warmup_steps: must be <= steps when schedule.unit is steps "
            "(no warmup longer than the run), got 300",
        ),
        ("checkpoint.asynk=true", "checkpoint.asynk: unknown key (known: async, async_mode, enabled, interval, keep)"),
    ],
)
def test_refusals_say_what_is_allowed(workflow_config, override, message):
    with pytest.raises(ConfigError) as e:
        load_config(workflow_config, [override])
    assert str(e.value) == f"{workflow_config}: {message}"


def _out_of_range(metadata):
    """Values just outside a key's declared range."""
    bounds = metadata["bounds"]
    bad = [bounds[op] for op in ("gt", "lt") if op in bounds]
    bad += [bounds["ge"] - 1] if "ge" in bounds else []
    return bad + ([bounds["le"] + 1] if "le" in bounds else [])


def _declared_cases():
    """(key, bad value) of every declared range and choice, and non-finite numbers."""
    cases = []
    for name, f, tp, default in leaves(TrainConfig()):
        bad = ["bogus"] if typing.get_origin(tp) is typing.Literal else []
        bad += _out_of_range(f.metadata) if f.metadata.get("bounds") else []
        bad += [math.nan, math.inf] if float in (tp, *typing.get_args(tp)) else []
        cases += [(name, [v, v] if isinstance(default, (tuple, list)) else v) for v in bad]
    return cases


@pytest.mark.parametrize("key, value", _declared_cases())
def test_every_declared_range_and_choice_is_refused(key, value):
    """Generated from the declarations, so a key added with a range is checked without a new case."""
    data = yaml.safe_load(WORKFLOW_YAML)
    node = data
    for part in key.split(".")[:-1]:
        node = node.setdefault(part, {})
    node[key.split(".")[-1]] = value
    with pytest.raises(ConfigError) as e:
        from_dict(data)
    each = "each " if isinstance(value, list) else ""
    assert e.value.key == key and str(e.value).startswith(f"{key}: {each}must be "), str(e.value)


@pytest.mark.parametrize(
    "overrides, warnings",
    [
        (["optimizer.vision_lr=0"], ["optimizer.vision_lr is 0: its parameters will not change"]),
        (
            ["optimizer.lr=2", "optimizer.projector_lr=0"],
            [
                "optimizer.projector_lr is 0: its parameters will not change",
                "optimizer.lr is 1 or more: AdamW moves every weight by about that much per step",
            ],
        ),
        (["schedule.min_lr_ratio=1"], ["schedule.min_lr_ratio is 1: the cosine or wsd schedule never decays"]),
        (["schedule.min_lr_ratio=1", "schedule.name=constant"], []),
        (
            ["precision.param_dtype=float16"],
            [
                "precision.param_dtype is float16: without loss scaling small gradients "
                "underflow; bfloat16 has float32's range"
            ],
        ),
        (["max_grad_norm=0", "schedule.warmup_steps=24"], []),  # documented meanings: no clipping; a warmup-only run
        ([], []),
    ],
)
def test_suspicious_values_are_accepted_with_a_warning_each(run_dir, monkeypatch, capsys, overrides, warnings):
    code, cfg = train_cli(monkeypatch, run_dir, overrides)
    assert code == 0 and cfg is not None
    assert capsys.readouterr().err.splitlines() == [f"warning: {run_dir}: {w}" for w in warnings]


def test_docs_config_md_is_the_generated_one(tmp_path):
    """docs/config.md lists every key as declared; `python -m vlmcore.config_docs` rewrites it."""
    doc = REPO / "docs/config.md"
    assert render(doc.read_text(), yaml.safe_load(SCHEMA.read_text())) == doc.read_text(), (
        "docs/config.md is stale: run python -m vlmcore.config_docs"
    )
    for name, f, _, _ in leaves(TrainConfig()):
        assert f.metadata["doc"] and f"| `{name}` |" in doc.read_text()
    stale = tmp_path / "config.md"
    stale.write_text(doc.read_text().replace("| `steps` | int >= 1 |", "| `steps` | int |"))
    args = ["--doc", str(stale), "--schema", str(SCHEMA)]
    assert config_docs.main(args + ["--check"]) == 1
    assert config_docs.main(args) == 0 and stale.read_text() == doc.read_text()


GRPO_STAGE = {
    "model_path": "m",
    "output_dir": "o",
    "data": {"kind": "random"},
    "objective": "grpo",
    "grpo": {"rewards": [{"name": "exact_match", "weight": 1.0}]},
}


def test_a_grpo_stage_on_prompts_without_room_for_a_prompt_is_refused_by_key():
    data = {**GRPO_STAGE, "data_path": "d", "data": {"seq_len": 256}, "grpo": {**GRPO_STAGE["grpo"]}}
    assert from_dict({**data, "grpo": {**data["grpo"], "max_new_tokens": 255}}).grpo.max_new_tokens == 255
    with pytest.raises(ConfigError) as error:
        from_dict({**data, "grpo": {**data["grpo"], "max_new_tokens": 256}})
    assert error.value.key == "grpo.max_new_tokens", str(error.value)


@pytest.mark.parametrize(
    "section, values, key",
    [
        ("grpo", {"group_size": 1}, "grpo.group_size"),
        ("grpo", {"temperature": 0.0}, "grpo.temperature"),
        ("grpo", {"temperature": -0.5}, "grpo.temperature"),
        ("grpo", {"reference": "adapters_off", "beta": 0.04}, "grpo.reference"),
        ("grpo", {"loss": "ppo"}, "grpo.loss"),
        ("grpo", {"epsilon_low": 1.0}, "grpo.epsilon_low"),
        ("grpo", {"epsilon_low": 0.0}, "grpo.epsilon_low"),
        ("grpo", {"epsilon_high": 0.0}, "grpo.epsilon_high"),
        ("grpo", {"delta": 1.1, "epsilon_high": 0.28}, "grpo.delta"),
        ("grpo", {"max_new_tokens": 0}, "grpo.max_new_tokens"),
        ("grpo", {"max_new_tokens": -4}, "grpo.max_new_tokens"),
        ("grpo", {"overlong_buffer": 129, "max_new_tokens": 128}, "grpo.overlong_buffer"),
        ("grpo", {"rewards": []}, "grpo.rewards"),
        ("grpo", {"rewards": [{"weight": 1.0}]}, "grpo.rewards"),
        ("grpo", {"rewards": [{"name": "format", "weight": math.inf}]}, "grpo.rewards"),
        ("grpo", {"rewards": [{"name": "format", "scale": 2}]}, "grpo.rewards[0].scale"),
        ("grpo", {"rewards": ["exact_match"]}, "grpo.rewards[0]"),
        ("grpo", {"tis_cap": 2.0, "updates_per_rollout": 2}, "grpo.tis_cap"),
        ("grpo", {"scale_rewards": "rank"}, "grpo.scale_rewards"),
    ],
)
def test_bad_grpo_settings_are_refused_by_key(section, values, key):
    data = {**GRPO_STAGE, section: {**GRPO_STAGE[section], **values}}
    with pytest.raises(ConfigError) as error:
        from_dict(data)
    assert error.value.key == key and str(error.value).startswith(f"{key}: "), str(error.value)


def test_a_grpo_stage_loads_with_lora_and_its_adapters_off_reference(tmp_path):
    data = {
        **GRPO_STAGE,
        "lora": {"rank": 8},
        "grpo": {
            **GRPO_STAGE["grpo"],
            "beta": 0.04,
            "reference": "adapters_off",
            "loss": "gspo",
            "epsilon_high": 0.28,
            "delta": 1.5,
            "rewards": [{"name": "exact_match", "weight": 1.0}, {"name": "format", "weight": 0.1}],
        },
    }
    cfg = from_dict(data)
    assert cfg.grpo.reference == "adapters_off" and cfg.grpo.rewards[1].name == "format"
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg
