import pytest

from vlmcore.config import ConfigError, TrainConfig, load_config, save_config

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
    cfg = load_config(workflow_config, ["steps=70", "optimizer.lr=1e-4", "parallel.tp=2", "checkpoint.async=true",
                                        "trainable=[]", "schedule.name=wsd", "schedule.cooldown=1-sqrt"])
    assert cfg.steps == 70 and cfg.optimizer.lr == 1e-4 and cfg.parallel.tp == 2
    assert cfg.checkpoint.async_save is True and cfg.trainable == [] and cfg.schedule.cooldown == "1-sqrt"


@pytest.mark.parametrize("override, message", [
    ("steps=ten", "steps: expected an integer"),
    ("optimizer.lrr=1", "optimizer.lrr: unknown key"),
    ("parallel.mode=zero3", "parallel.mode: must be one of"),
    ("optimizer.betas=[0.9]", "optimizer.betas: expected a list of 2"),
    ("schedule.unit=samples", "schedule.total_samples: is required"),
    ("save_final=1", "save_final: expected true or false"),
    ("steps", "expected key=value"),
])
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
    path.write_text(WORKFLOW_YAML.replace("results/demo/train/stage1", "out").replace("results/demo/", "")
                    .replace("packed/captions", "data").replace("steps: 200", "steps: 24"))
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
