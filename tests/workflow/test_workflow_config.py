"""The experiment config is validated before any job runs, with errors that name the key."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vlmcore.blend import read_blend
from vlmcore.workflow import ConfigError, Experiment, validate_config

REPO = Path(__file__).resolve().parents[2]
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


def test_a_stage_is_evaluated_on_its_own_tasks_or_eval_tasks():
    """A stage's `eval_tasks` replaces eval.tasks for that stage's export (a workflow key: its
    vlmcore train config does not get it); the other stages keep eval.tasks."""
    config = demo_config()
    config["train"]["stages"]["stage2"]["eval_tasks"] = ["demo_preference", "demo_vqa_gen"]
    exp = Experiment(validate_config(config, SCHEMA))
    assert exp.stage_eval_tasks("stage1") == ["demo_vqa"]
    assert exp.stage_eval_tasks("stage2") == ["demo_preference", "demo_vqa_gen"]
    assert exp.eval_tasks == ["demo_vqa", "demo_preference", "demo_vqa_gen"]
    assert exp.eval_results() == [
        "results/demo/eval/stage1/demo_vqa/results.json",
        "results/demo/eval/stage2/demo_preference/results.json",
        "results/demo/eval/stage2/demo_vqa_gen/results.json",
    ]
    assert "eval_tasks" not in exp.stage_config("stage2")


def test_snakemake_rejects_an_invalid_value_before_running_anything(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "--cores",
            "1",
            "--directory",
            str(tmp_path),
            "--snakefile",
            str(REPO / "Snakefile"),
            "--configfile",
            str(REPO / "config/config.yaml"),
            "--config",
            "experiment=bad name!",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode != 0
    assert "experiment" in proc.stderr + proc.stdout
    assert not (tmp_path / "results").exists()


def stage(name, **settings):
    return lambda c: c["train"]["stages"][name].update(settings)


def common(**settings):
    return lambda c: c["train"]["common"].update(settings)


# A stage's vlmcore train settings go through TrainConfig's own checks; the error names the key
# where it was written: the stage's settings or train.common.
@pytest.mark.parametrize(
    "mutate, key",
    [
        (stage("stage1", stepz=5), "train.stages.stage1.stepz"),
        (stage("stage1", dtype="float8"), "train.stages.stage1.dtype"),
        (stage("stage1", schedule={"name": "cosinee"}), "train.stages.stage1.schedule.name"),
        (stage("stage1", steps=3), "train.stages.stage1.schedule.warmup_steps"),
        (stage("stage1", steps="many"), "train.stages.stage1.steps"),
        (stage("stage1", trainable="model.*"), "train.stages.stage1.trainable"),
        (stage("stage2", optimizer={"lr": -1.0e-3}), "train.stages.stage2.optimizer.lr"),
        (stage("stage2", optimizer={"projector_lr": -1.0e-3}), "train.stages.stage2.optimizer.projector_lr"),
        (stage("stage2", optimizer={"betas": [0.9, 1.0]}), "train.stages.stage2.optimizer.betas"),
        (stage("stage2", data={"image_fraction": 2}), "train.stages.stage2.data.image_fraction"),
        (stage("stage2", model_path="elsewhere"), "train.stages.stage2.model_path"),
        (common(precision={"param_dtype": "float8"}), "train.common.precision.param_dtype"),
        (common(optimizer={"vision_lr": -1.0e-4}), "train.common.optimizer.vision_lr"),
        (common(optimizer={"weight_decay": -0.1}), "train.common.optimizer.weight_decay"),
        (common(checkpoint={"keep": 0}), "train.common.checkpoint.keep"),
        (common(schedule={"min_lr_ratio": 2}), "train.common.schedule.min_lr_ratio"),
        (common(output_dir="elsewhere"), "train.common.output_dir"),
    ],
)
def test_stage_settings_are_checked_by_the_train_config_rules(mutate, key):
    config = demo_config()
    mutate(config)
    with pytest.raises(ConfigError) as err:
        validate_config(config, SCHEMA)
    assert f"\n  {key}: " in str(err.value), str(err.value)


def mixed(config, weights, stage_name="stage2"):
    """`config` with `stage_name` on a mix of datasets (`datasets`) instead of its one `dataset`."""
    stage = config["train"]["stages"][stage_name]
    stage.pop("dataset")
    stage["datasets"] = weights
    return config


def test_a_stage_on_a_mix_reads_its_blend_file_and_depends_on_every_dataset(tmp_path):
    """A stage's `datasets`: its data_path is the blend file train/<stage>/data_mix.yaml, whose
    content (`stage_blend`) names the packed datasets by weight relative to the file; the stage's
    job reads the file and every packed dataset of the mix; the export's provenance holds the
    statistics of every dataset of its lineage, and the scaling runs of the stage train on its mix."""
    config = demo_config()
    config["results_dir"] = str(tmp_path / "results")
    del config["scaling"]["dataset"]
    exp = Experiment(validate_config(mixed(config, {"captions": 0.7, "conversations": 0.3}), SCHEMA))
    root = tmp_path / "results" / "demo"
    blend_file = root / "train/stage2/data_mix.yaml"
    assert exp.stage_config("stage2")["data_path"] == str(blend_file)
    assert exp.stage_config("stage1")["data_path"] == str(root / "packed/captions")
    assert "datasets" not in exp.stage_config("stage2")
    inputs = exp.stage_inputs("stage2")
    assert inputs["data"] == str(blend_file)
    assert inputs["packed"] == [str(root / "packed/captions"), str(root / "packed/conversations")]
    assert "packed" not in exp.stage_inputs("stage1")
    blend_file.parent.mkdir(parents=True)
    blend_file.write_text(yaml.safe_dump(exp.stage_blend("stage2")))
    blend = read_blend(blend_file)
    assert blend.paths == [root / "packed/captions", root / "packed/conversations"]
    assert blend.weights == [0.7, 0.3] and blend.names == ["captions", "conversations"]
    provenance = exp.export_provenance("stage2")
    assert provenance["data_stats"] == [str(root / f"packed/{d}/stats.json") for d in ("captions", "conversations")]
    assert provenance["packed"] == str(root / "packed/captions")
    assert exp.scaling_config(2)["data_path"] == str(blend_file)


def preference_data(config):
    config["data"]["datasets"]["preference"] = {"sources": ["preference:{raw}/preference.jsonl"]}
    return config


@pytest.mark.parametrize(
    "mutate, line",
    [
        (
            lambda c: mixed(c, {"captions": 1, "conversations": -0.5}),
            "train.stages.stage2.datasets.conversations: -0.5 is less than the minimum of 0",
        ),
        (lambda c: mixed(c, {}), "train.stages.stage2.datasets: {} should be non-empty"),
        (
            lambda c: mixed(c, {"captions": 0, "conversations": 0}),
            "train.stages.stage2.datasets: the weights sum to 0: they must sum to a positive number",
        ),
        (
            lambda c: mixed(c, {"captions": 1, "images": 1}),
            "train.stages.stage2.datasets: 'images' is not in data.datasets (captions, conversations)",
        ),
        (
            stage("stage2", datasets={"captions": 1}),
            "train.stages.stage2: give dataset (one packed dataset) or datasets (a weighted mix of them); "
            "both are given",
        ),
        (
            lambda c: c["train"]["stages"]["stage2"].pop("dataset"),
            "train.stages.stage2: give dataset (one packed dataset) or datasets (a weighted mix of them); "
            "neither is given",
        ),
        (
            common(datasets={"captions": 1}),
            "train.common.datasets: a stage's data is set per stage (train.stages.<name>.dataset or datasets)",
        ),
        (
            lambda c: mixed(preference_data(c), {"conversations": 1, "preference": 1}),
            "train.stages.stage2.datasets: mixes preference pairs (preference) with samples (conversations); "
            "a stage trains on pairs (objective dpo) or on samples, not both",
        ),
        (
            lambda c: c["scaling"].update(dataset={"captions": 1}),
            "scaling.dataset: {'captions': 1} is not of type 'string'",
        ),
        (
            stage("stage2", objective="grpo"),
            "train.stages.stage2.dataset: objective grpo samples its own completions of prompts, but "
            "'conversations' has sources other than `prompts:` ones (data/prepare/prompts.py)",
        ),
        (
            lambda c: stage("stage2", objective="grpo")(mixed(c, {"captions": 1, "conversations": 1})),
            "train.stages.stage2.datasets: objective grpo takes one prompt dataset (dataset), not a mix",
        ),
    ],
    ids=[
        "negative",
        "empty",
        "zero_sum",
        "unknown",
        "both",
        "neither",
        "common",
        "pairs_and_samples",
        "scaling",
        "grpo_on_samples",
        "grpo_on_a_mix",
    ],
)
def test_a_bad_mix_is_refused_naming_the_key(mutate, line):
    """A mix is refused before any job, one line naming the key; the scaling runs take one dataset
    (or, without scaling.dataset, their stage's mix)."""
    config = demo_config()
    mutate(config)
    with pytest.raises(ConfigError) as err:
        validate_config(config, SCHEMA)
    assert f"\n  {line}" in str(err.value), str(err.value)


def test_a_grpo_stages_rollout_rows_are_as_long_as_the_packed_rows_unless_the_stage_says():
    config = demo_config()
    config["data"]["datasets"]["prompts"] = {"sources": ["prompts:{raw}/prompts.jsonl"]}
    config["train"]["stages"]["stage2"].update(
        dataset="prompts", objective="grpo", grpo={"rewards": [{"name": "exact_match"}]}
    )
    exp = Experiment(validate_config(config, SCHEMA))
    assert exp.stage_config("stage2")["data"] == {"seq_len": config["pack"]["seq_len"]}
    assert "data" not in exp.stage_config("stage1")
    config["train"]["stages"]["stage2"]["data"] = {"seq_len": 300}
    assert Experiment(validate_config(config, SCHEMA)).stage_config("stage2")["data"] == {"seq_len": 300}


def test_scaling_runs_cut_a_warmup_longer_than_their_steps():
    exp = Experiment(validate_config(demo_config(), SCHEMA))
    assert exp.stage_config("stage2")["schedule"]["warmup_steps"] == 20
    assert exp.scaling_config(1)["schedule"]["warmup_steps"] == 8


def test_snakemake_rejects_an_unknown_stage_key_before_running_anything(tmp_path):
    configfile = tmp_path / "typo.yaml"
    configfile.write_text(yaml.safe_dump({"train": {"stages": {"stage1": {"stepz": 5}}}}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "--cores",
            "1",
            "--directory",
            str(tmp_path),
            "--snakefile",
            str(REPO / "Snakefile"),
            "--configfile",
            str(REPO / "config/config.yaml"),
            str(configfile),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode != 0
    assert "train.stages.stage1.stepz: unknown key" in proc.stderr + proc.stdout
    assert not (tmp_path / "results").exists()


def workflow(section, **settings):
    return lambda c: c.setdefault(section, {}).update(settings)


def without(section, key):
    return lambda c: c[section].pop(key)


# Each invalid experiment is refused with one line naming the key, before anything is planned.
@pytest.mark.parametrize(
    "mutate, key",
    [
        # the workflow keys, by the schema
        (workflow("scaling", world_sizes=[]), "scaling.world_sizes"),
        (workflow("scaling", world_sizes=[1, 1]), "scaling.world_sizes"),
        (workflow("scaling", world_sizes=[0]), "scaling.world_sizes.0"),
        (workflow("scaling", steps=1), "scaling.steps"),
        (workflow("eval", tasks=[]), "eval.tasks"),
        (workflow("eval", device="gpu"), "eval.device"),
        (workflow("eval", limit=0), "eval.limit"),
        (workflow("export", max_shard_size="5 gigs"), "export.max_shard_size"),
        (workflow("pack", overlong="skip"), "pack.overlong"),
        (workflow("pack", max_patches=0), "pack.max_patches"),
        (workflow("train", nodes=0), "train.nodes"),
        (workflow("train", gpu_capability="9"), "train.gpu_capability"),
        (workflow("train", gpu_memory_gib=0), "train.gpu_memory_gib"),
        (workflow("train", gpu_memory_gib=96, host_memory_gib=0), "train.host_memory_gib"),
        # the host's memory is checked beside the GPU's ("'gpu_memory_gib' is a dependency of 'host_memory_gib'")
        (workflow("train", host_memory_gib=120), "train"),
        (lambda c: c["data"]["datasets"]["captions"].update(shard_size=0), "data.datasets.captions.shard_size"),
        (
            lambda c: c["data"]["datasets"]["captions"].update(max_bad_fraction=1.5),
            "data.datasets.captions.max_bad_fraction",
        ),
        (lambda c: c["data"]["datasets"]["captions"].update(sources=[]), "data.datasets.captions.sources"),
        # KIND is the row format; parquet is a file type, not a kind
        (
            lambda c: c["data"]["datasets"]["captions"].update(sources=["parquet:rows.parquet"]),
            "data.datasets.captions.sources.0",
        ),
        (stage("stage1", nodes=0), "train.stages.stage1.nodes"),
        (lambda c: c["train"]["stages"]["stage1"].pop("steps"), "train.stages.stage1"),
        # the cross references
        (workflow("scaling", world_sizes=[3]), "scaling.world_sizes"),
        (workflow("export", stage="stage9"), "export.stage"),
        (workflow("scaling", stage="nope"), "scaling.stage"),
        (workflow("scaling", dataset="nope"), "scaling.dataset"),
        (without("data", "synthetic"), "data.synthetic"),
        (lambda c: c["data"]["synthetic"].update(kind="movie"), "data.synthetic.kind"),
        # the demo's questions against its generated data
        (workflow("eval", tasks=["demo_video_qa"]), "eval.tasks"),
        (stage("stage2", eval_tasks=["demo_video_qa"]), "train.stages.stage2.eval_tasks"),
        (lambda c: c["data"]["synthetic"].update(kind="video"), "eval.tasks"),
        # the stages' vlmcore train settings, by TrainConfig's rules and the stage's ranks
        (common(parallel={"tp": 3}), "train.common.parallel"),
        (stage("stage2", parallel={"dp_shard": 4}), "train.stages.stage2.parallel"),
        (stage("stage1", parallel={"mode": "ddp", "dp_shard": 2}), "train.stages.stage1.parallel.dp_shard"),
        (stage("stage1", parallel={"ep": 4}), "train.stages.stage1.parallel.ep"),  # 2 ranks: dp_shard 2
        (stage("stage1", parallel={"vision": "fsdp"}), "train.stages.stage1.parallel.vision"),
        (stage("stage1", schedule={"unit": "samples"}), "train.stages.stage1.schedule.total_samples"),
        (common(seed=-1), "train.common.seed"),
        (common(data={"kind": "random", "seq_len": 8, "image_side": 2}), "train.common.data.image_side"),
        # fits the stages (2 ranks: dp_shard 1 x tp 2) but not the 1-rank scaling point
        (common(parallel={"tp": 2}), "scaling.world_sizes"),
        # per-module layouts, against each stage's ranks and each scaling point
        (stage("stage2", parallel={"modules": {"vision": {"tp": 3}}}), "train.stages.stage2.parallel.modules.vision"),
        (
            stage("stage1", parallel={"modules": {"language": {"ranks": [0, 1]}, "vision": {"ranks": [1, 3]}}}),
            "train.stages.stage1.parallel.modules.vision.ranks",
        ),
        (stage("stage1", parallel={"tp": 2, "modules": {"vision": {"tp": 1}}}), "train.common.micro_batch_size"),
        (common(parallel={"modules": {"vision": {"tp": 2}}}), "scaling.world_sizes"),
    ],
)
def test_invalid_experiments_are_refused_in_one_line_naming_the_key(mutate, key):
    config = demo_config()
    mutate(config)
    with pytest.raises(ConfigError) as err:
        validate_config(config, SCHEMA)
    message = str(err.value)
    assert message.startswith("invalid workflow config:\n  ") and f"\n  {key}: " in message, message
    assert len(message.splitlines()) == 2, message


def test_suspicious_stage_settings_are_printed_as_warnings(capsys):
    validate_config(demo_config(), SCHEMA)
    assert capsys.readouterr().err == ""
    config = demo_config()
    stage("stage2", optimizer={"lr": 0})(config)
    common(precision={"param_dtype": "float16"})(config)
    validate_config(config, SCHEMA)
    assert capsys.readouterr().err.splitlines() == [
        "warning: train.stages.stage1: precision.param_dtype is float16: without loss scaling small gradients "
        "underflow; bfloat16 has float32's range",
        "warning: train.stages.stage2: optimizer.lr is 0: its parameters will not change",
        "warning: train.stages.stage2: precision.param_dtype is float16: without loss scaling small gradients "
        "underflow; bfloat16 has float32's range",
    ]
