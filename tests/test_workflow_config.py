"""The experiment config is validated before any job runs, with errors that name the key."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vlmcore.workflow import ConfigError, Experiment, validate_config

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "workflow/schemas/config.schema.yaml"


def demo_config():
    return yaml.safe_load((REPO / "config/config.yaml").read_text())


def test_demo_config_is_valid_and_gets_defaults():
    config = validate_config(demo_config(), SCHEMA)
    assert config["eval"]["limit"] is None
    assert config["export"]["max_shard_size"] == "5GB"
    assert config["data"]["datasets"]["captions"]["shard_size"] == 1000
    assert config["train"]["runtime_minutes"] == 60


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda c: c["pack"].update(seq_len=-1), "pack.seq_len"),
        (lambda c: c["train"]["stages"]["stage1"].update(steps="many"), "train.stages.stage1.steps"),
        (lambda c: c["model"].update(source="ftp"), "model.source"),
        (lambda c: c["eval"].update(batch_size=0), "eval.batch_size"),
        (lambda c: c.update(typo_key=1), "(top level)"),
        (lambda c: c["train"]["stages"]["stage2"].update(dataset="nope"), "train.stages.stage2.dataset"),
        (lambda c: c["train"]["stages"]["stage1"].update(init_from="stage2"), "train.stages.stage1.init_from"),
        (lambda c: c["model"].update(source="hub"), "model.repo_id"),
        (lambda c: c["model"].update(source="staged"), "model.staged_path"),
    ],
)
def test_invalid_values_name_the_key(mutate, key):
    config = demo_config()
    mutate(config)
    with pytest.raises(ConfigError) as err:
        validate_config(config, SCHEMA)
    assert key in str(err.value)


def test_every_schema_property_has_a_description():
    schema = yaml.safe_load(SCHEMA.read_text())
    missing = []

    def walk(node, path):
        for name, sub in node.get("properties", {}).items():
            if "description" not in sub:
                missing.append(f"{path}{name}")
            walk(sub, f"{path}{name}.")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}*.")

    walk(schema, "")
    assert missing == []


def test_stage_configs_chain_stages_and_fill_paths():
    exp = Experiment(validate_config(demo_config(), SCHEMA))
    s1, s2 = exp.stage_config("stage1"), exp.stage_config("stage2")
    assert s1["init_from"] is None and s1["data_path"] == "results/demo/packed/captions"
    assert s2["init_from"] == "results/demo/train/stage1/final"
    assert s2["output_dir"] == "results/demo/train/stage2"
    assert s1["trainable"] and s2["trainable"] == []
    # train.common reaches every stage; a stage's own keys win
    assert s1["checkpoint"]["keep"] == 2 and s2["optimizer"]["lr"] == 1.5e-3
    assert exp.stage_inputs("stage2")["init"] == "results/demo/train/stage1/done"
    scaling = exp.scaling_config(2)
    assert scaling["save_final"] is False and scaling["output_dir"] == "results/demo/scaling/ws2"
    assert scaling["init_from"] is None and scaling["checkpoint"]["enabled"] is False


def test_snakemake_rejects_an_invalid_value_before_running_anything(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--directory", str(tmp_path),
         "--snakefile", str(REPO / "Snakefile"), "--configfile", str(REPO / "config/config.yaml"),
         "--config", "experiment=bad name!"],
        capture_output=True, text=True, cwd=REPO,
    )
    assert proc.returncode != 0
    assert "experiment" in proc.stderr + proc.stdout
    assert not (tmp_path / "results").exists()
