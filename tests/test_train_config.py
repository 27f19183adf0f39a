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
parallel: {dp_replicate: 1, dp_shard: -1, tp: 1, mode: fsdp, vision: fsdp, activation_checkpointing: none, compile: false}
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
    cfg = load_config(workflow_config, ["steps=7", "optimizer.lr=1e-4", "parallel.tp=2", "checkpoint.async=true",
                                        "trainable=[]", "schedule.name=wsd", "schedule.cooldown=1-sqrt"])
    assert cfg.steps == 7 and cfg.optimizer.lr == 1e-4 and cfg.parallel.tp == 2
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
