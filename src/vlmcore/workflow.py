"""What the Snakemake workflow needs from vlmcore: config validation and per-job settings.

The rules stay thin: they ask this module for paths and for the config each `vlmcore`
command gets, so the same logic is testable without Snakemake.
"""

import copy
import json
import os
import shlex
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from vlmcore import config as train_config
from vlmcore import kernels
from vlmcore.blend import blend_document, weight_problem
from vlmcore.config import ConfigError
from vlmcore.families import FAMILIES, Family, family, family_of_repo
from vlmcore.parallel.checks import check_run


def _fill_defaults(schema: dict, value: Any) -> None:
    if not isinstance(value, dict) or schema.get("type") not in (None, "object"):
        return
    properties = schema.get("properties", {})
    for key, sub in properties.items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
    for key, item in value.items():
        sub = properties.get(key, schema.get("additionalProperties"))
        if isinstance(sub, dict):
            _fill_defaults(sub, item)


def validate_config(config: dict, schema_path: str | Path) -> dict:
    """Check `config` against the JSON schema, fill defaults, and check cross references;
    raises ConfigError naming every offending key."""
    import jsonschema

    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  {'.'.join(map(str, e.absolute_path)) or '(top level)'}: {e.message}" for e in errors]
        raise ConfigError("invalid workflow config:\n" + "\n".join(lines))
    _fill_defaults(schema, config)
    _check_references(config)
    _check_stage_settings(config)
    return config


def _check_references(config: dict) -> None:
    """The cross references the JSON schema cannot check (the model's source, the synthetic data,
    the datasets and stages that stages, export and scaling name, the scaling world sizes); raises
    ConfigError listing every problem at once."""
    problems = _model_source_problems(config["model"])
    problems += _synthetic_data_problems(config)
    problems += _stage_problems(config)
    problems += _scaling_problems(config)
    if problems:
        raise ConfigError("invalid workflow config:\n  " + "\n  ".join(problems))


def _model_source_problems(model: dict) -> list[str]:
    """What the model's `source` needs: a pinned Hub repo, or a staged path."""
    problems = []
    if model["source"] == "hub" and not (model.get("repo_id") and model.get("revision")):
        problems.append("model: source 'hub' needs model.repo_id and model.revision (a pinned commit or tag)")
    if model["source"] == "staged" and not model.get("staged_path"):
        problems.append("model.staged_path: required when model.source is 'staged'")
    return problems


def _synthetic_data_problems(config: dict) -> list[str]:
    """Sources that read {raw} and the demo eval tasks need the synthetic data, of their kind."""
    problems = []
    datasets = config["data"]["datasets"]
    uses_raw = any("{raw}" in s for d in datasets.values() for s in d["sources"])
    if uses_raw and "synthetic" not in config["data"]:
        problems.append("data.synthetic: a source reads from {raw} but no synthetic data is configured")
    synthetic = config["data"].get("synthetic", {})
    if synthetic.get("max_size", 0) < synthetic.get("min_size", 0):
        problems.append(f"data.synthetic.max_size: {synthetic['max_size']} is below min_size {synthetic['min_size']}")
    demo_tasks = {
        "image": ("demo_vqa", "demo_vqa_gen", "demo_preference"),
        "video": ("demo_video_qa", "demo_video_qa_shuffled"),
    }
    task_lists = {"eval.tasks": config.get("eval", {}).get("tasks", [])}
    for name, stage in config["train"]["stages"].items():
        if "eval_tasks" in stage:
            task_lists[f"train.stages.{name}.eval_tasks"] = stage["eval_tasks"]
    for key, asked in task_lists.items():
        for kind, tasks in demo_tasks.items():
            for task in sorted(set(tasks) & set(asked)):
                if synthetic and synthetic.get("kind") != kind:
                    problems.append(
                        f"{key}: {task} asks questions of the {kind} demo data, but "
                        f"data.synthetic.kind is {synthetic['kind']!r}"
                    )
    return problems


def _stage_problems(config: dict) -> list[str]:
    """Each stage's data is declared, its init_from an earlier stage; the exported stage exists."""
    problems = [
        f"train.common.{key}: a stage's data is set per stage (train.stages.<name>.dataset or datasets)"
        for key in ("dataset", "datasets")
        if key in config["train"].get("common", {})
    ]
    seen = []
    for name, stage in config["train"]["stages"].items():
        problems += _stage_data_problems(config, name, stage)
        init = stage.get("init_from")
        if init is not None and init not in seen:
            problems.append(
                f"train.stages.{name}.init_from: {init!r} is not an earlier stage (earlier: {seen or 'none'})"
            )
        seen.append(name)
    export_stage = config.get("export", {}).get("stage")
    if export_stage and export_stage not in seen:
        problems.append(f"export.stage: {export_stage!r} is not a stage ({', '.join(seen)})")
    return problems


def _stage_data_problems(config: dict, name: str, stage: dict) -> list[str]:
    """A stage trains on one dataset of data.datasets (`dataset`) or on a weighted mix of them
    (`datasets`: weights that are sampling probabilities once normalised), never both; a mix holds
    preference pairs (DPO) or samples, not both."""
    datasets = config["data"]["datasets"]
    key = f"train.stages.{name}"
    if ("dataset" in stage) == ("datasets" in stage):
        given = "both are given" if "dataset" in stage else "neither is given"
        return [f"{key}: give dataset (one packed dataset) or datasets (a weighted mix of them); {given}"]
    if "dataset" in stage:
        if stage["dataset"] not in datasets:
            return [f"{key}.dataset: {stage['dataset']!r} is not in data.datasets ({', '.join(datasets)})"]
        if stage.get("objective") == "grpo" and not _holds_prompts(datasets[stage["dataset"]]):
            return [
                f"{key}.dataset: objective grpo samples its own completions of prompts, but {stage['dataset']!r} "
                "has sources other than `prompts:` ones (data/prepare/prompts.py)"
            ]
        return []
    if stage.get("objective") == "grpo":
        return [f"{key}.datasets: objective grpo takes one prompt dataset (dataset), not a mix"]
    mix = stage["datasets"]
    problems = [
        f"{key}.datasets: {dataset!r} is not in data.datasets ({', '.join(datasets)})"
        for dataset in mix
        if dataset not in datasets
    ]
    problem = weight_problem(list(mix.values()))
    if problem:
        problems.append(f"{key}.datasets: {problem}")
    if problems:
        return problems
    pairs = [d for d in mix if _holds_pairs(datasets[d])]
    samples = [d for d in mix if d not in pairs]
    if pairs and samples:
        return [
            f"{key}.datasets: mixes preference pairs ({', '.join(pairs)}) with samples ({', '.join(samples)}); "
            "a stage trains on pairs (objective dpo) or on samples, not both"
        ]
    return []


def _holds_prompts(dataset: dict) -> bool:
    """Whether a dataset of data.datasets is made of RL prompts only (`prompts:` sources)."""
    return all(source.startswith("prompts:") for source in dataset["sources"])


def _holds_pairs(dataset: dict) -> bool:
    """Whether a dataset of data.datasets is made of preference pairs (a `preference:` source)."""
    return any(source.startswith("preference:") for source in dataset["sources"])


def _scaling_problems(config: dict) -> list[str]:
    """The scaling runs' dataset and stage exist; a world size spans whole nodes or fits in one."""
    problems = []
    datasets = config["data"]["datasets"]
    stages = list(config["train"]["stages"])
    scaling = config.get("scaling", {})
    if scaling.get("dataset") and scaling["dataset"] not in datasets:
        problems.append(f"scaling.dataset: {scaling['dataset']!r} is not in data.datasets")
    if scaling.get("stage") and scaling["stage"] not in stages:
        problems.append(f"scaling.stage: {scaling['stage']!r} is not a stage")
    per_node = config["train"]["nproc_per_node"]
    for world_size in scaling.get("world_sizes", []):
        if world_size > per_node and world_size % per_node:
            problems.append(
                f"scaling.world_sizes: {world_size} is neither a multiple of train.nproc_per_node "
                f"({per_node}) nor fits in one node"
            )
    return problems


# Filled in by Experiment.stage_config; a value given in the config would be ignored.
WORKFLOW_PATHS = ("model_path", "data_path", "output_dir")


def _written_at(config: dict, stage: str, key: str) -> str:
    """The config key a stage setting comes from: the stage's own settings or train.common."""
    parts = key.split("[")[0].split(".")
    train = config["train"]
    for where, node in ((f"train.stages.{stage}", train["stages"][stage]), ("train.common", train.get("common", {}))):
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            return f"{where}.{key}"
    return f"train.stages.{stage}.{key}"


def _check_stage_settings(config: dict) -> None:
    """Each stage's settings (train.common + the stage), and each scaling point's, pass TrainConfig's
    checks and vlmcore.parallel.checks against its ranks and, once the model's config.json is here
    (staged, or downloaded), against the model: a typo, a bad range, a mesh that does not divide or a
    degree the model does not take stops the workflow before any job runs. Warnings are printed."""
    exp = Experiment(config)
    model_config = exp.model_config()
    written = {f"train.stages.{stage}": config["train"]["stages"][stage] for stage in exp.stages}
    written["train.common"] = config["train"].get("common", {})
    problems = [
        f"{where}.{key}: set by the workflow, remove it"
        for where, settings in written.items()
        for key in WORKFLOW_PATHS
        if key in settings
    ]
    for stage in exp.stages:
        try:
            cfg = train_config.from_dict(exp.stage_config(stage))
            check_run(cfg, exp.stage_ranks(stage), model_config)
        except ConfigError as e:
            message = str(e).removeprefix(f"{e.key}: ")
            problems.append(f"{_written_at(config, stage, e.key)}: {message}")
            continue
        for warning in train_config.warnings_of(cfg):
            print(f"warning: train.stages.{stage}: {warning}", file=sys.stderr)
    if not problems:
        for world_size in config["scaling"]["world_sizes"]:
            try:
                check_run(train_config.from_dict(exp.scaling_config(world_size)), world_size, model_config)
            except ConfigError as e:
                problems.append(
                    f"scaling.world_sizes: the settings of stage {exp.scaling_stage()} do not fit a scaling run: {e}"
                )
    if problems:  # a bad train.common key fails every stage: named once
        raise ConfigError("invalid workflow config:\n  " + "\n  ".join(dict.fromkeys(problems)))


def planned_family(model: dict) -> Family | None:
    """The family of the experiment's model (its `model` section) before the download: the tiny
    model's, else the staged snapshot's config.json where it is there, else guessed from the Hub
    name (vlmcore.families); None when none of these tells."""
    if model.get("source") == "tiny":
        return FAMILIES[model.get("tiny", {}).get("family", "qwen3_vl")]
    config_json = Path(model.get("staged_path") or "", "config.json")
    if model.get("staged_path") and config_json.is_file():
        return family(json.loads(config_json.read_text()))
    return family_of_repo(model.get("repo_id") or "")


def check_kernels(config: dict, stage_settings: dict) -> None:
    """The workflow's check on the login node: every training stage's kernels on the cluster's GPU
    (`train.gpu_capability`); raises KernelError naming the stage before any job is queued."""
    capability = kernels.parse_capability(config["train"].get("gpu_capability"))
    if capability is None:
        return
    planned = planned_family(config["model"])
    has_linear = False
    has_experts = False
    if planned:
        has_linear = planned.linear_attention
        has_experts = planned.experts
    versions = kernels.installed_versions()
    for stage, settings in stage_settings.items():
        requested = settings.get("parallel", {}).get("linear_attention", "auto")
        try:
            kernels.check(requested, capability, has_linear, versions, has_experts)
        except kernels.KernelError as e:
            raise kernels.KernelError(
                f"train.stages.{stage} on train.gpu_capability {capability[0]}.{capability[1]}: {e}"
            ) from None


def deep_merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        both_mappings = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = deep_merge(merged[key], value) if both_mappings else copy.deepcopy(value)
    return merged


class Experiment:
    """Paths and per-job settings of one validated experiment config."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.root = f"{config['results_dir']}/{config['experiment']}"
        self.stages = list(config["train"]["stages"])

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    @property
    def uses_synthetic_data(self) -> bool:
        return "synthetic" in self.config["data"]

    @property
    def last_stage(self) -> str:
        return self.config.get("export", {}).get("stage") or self.stages[-1]

    @property
    def exported_stages(self) -> list[str]:
        """The stages exported to hf/<stage> and evaluated: every stage up to export.stage."""
        return self.stages[: self.stages.index(self.last_stage) + 1]

    @property
    def eval_tasks(self) -> list[str]:
        """Every task some exported stage is evaluated on (eval.tasks and the stages' own lists)."""
        return list(dict.fromkeys(task for stage in self.exported_stages for task in self.stage_eval_tasks(stage)))

    def stage_eval_tasks(self, stage: str) -> list[str]:
        """The tasks `stage`'s export is evaluated on: its own `eval_tasks`, else eval.tasks."""
        return list(self.config["train"]["stages"][stage].get("eval_tasks", self.config["eval"]["tasks"]))

    def lineage(self, stage: str) -> list[str]:
        """The stages whose weights `stage` continues, first to last: its init_from, that stage's
        init_from, and so on, then `stage` itself (not the stages listed before it: the LoRA demo's
        stage3 starts from stage1, beside stage2)."""
        chain = [stage]
        while init_from := self.config["train"]["stages"][chain[0]].get("init_from"):
            chain.insert(0, init_from)
        return chain

    def export_provenance(self, stage: str) -> dict:
        """What `vlmcore export` of `stage` records: the configs of the stages of its lineage, the
        statistics of their packed datasets, and the packed dataset of `stage` itself (its video
        sampling goes into the export)."""
        chain = self.lineage(stage)
        datasets = list(dict.fromkeys(d for s in chain for d in self.stage_datasets(s)))
        # The datasets of a mix were packed with the same settings (the loader refuses others): the
        # first one's video sampling is the mix's.
        return {
            "stage_configs": [self.path("train", s, "config.yaml") for s in chain],
            "data_stats": [self.path("packed", d, "stats.json") for d in datasets],
            "packed": self.path("packed", self.stage_datasets(stage)[0]),
        }

    def export_inputs(self, stage: str) -> dict:
        """What the export of `stage` reads: the done marker of every stage of its lineage (their
        train/<stage>/config.yaml are its provenance), the snapshot, and for a LoRA stage that started
        from an earlier stage that stage's export, the base its peft adapter names."""
        inputs = {
            "done": [self.path("train", s, "done") for s in self.lineage(stage)],
            "model": self.path("model", "manifest.json"),
        }
        base = self.peft_base(stage)
        if base:
            inputs["peft_base"] = base
        return inputs

    def peft_adapter(self, stage: str) -> str | None:
        """Where the export of a LoRA stage (`lora.rank` > 0) writes its adapters as a peft adapter
        directory: `peft_adapter/` inside the stage's export hf/<stage>, beside the merged model
        that the evaluation reads. None for a stage without LoRA."""
        lora = self.stage_config(stage).get("lora") or {}
        if not lora.get("rank"):
            return None
        return self.path("hf", stage, "peft_adapter")

    def peft_base(self, stage: str) -> str | None:
        """The weights a LoRA stage's adapters were trained on, where they are not the snapshot's:
        the export of the stage it started from (init_from), hf/<that stage>. None for a stage
        without LoRA or one that started from the snapshot."""
        init_from = self.config["train"]["stages"][stage].get("init_from")
        if not self.peft_adapter(stage) or not init_from:
            return None
        return self.path("hf", init_from)

    def export_adapter_args(self, stage: str) -> str:
        """The `vlmcore export` arguments that write `peft_adapter(stage)` on its base (none without LoRA)."""
        adapter = self.peft_adapter(stage)
        if not adapter:
            return ""
        base = self.peft_base(stage)
        return f"--peft-adapter {shlex.quote(adapter)}" + (f" --peft-base {shlex.quote(base)}" if base else "")

    def eval_inputs(self, stage: str, task: str, benchmarks: Collection[str]) -> dict:
        """The evaluation of `task` on the export of `stage`: the export, the demo's held-out file
        for the demo tasks, and the staged data of a public benchmark (one of `benchmarks`, the
        names of vlmcore.eval.benchmarks.registry, a layer above this module)."""
        inputs = {"hf": self.path("hf", stage)}
        if self.uses_synthetic_data:
            inputs["vqa"] = self.path("raw", "eval.jsonl")
        if task in benchmarks:
            inputs["benchmark"] = self.path("benchmarks", task, "manifest.json")
        return inputs

    def benchmark_source(self, name: str) -> str:
        """`vlmcore stage-benchmark` arguments of where benchmark `name` comes from: a copy staged
        elsewhere (eval.staged_benchmarks), else the hub through eval.benchmark_cache."""
        evaluation = self.config["eval"]
        if evaluation.get("staged_benchmarks"):
            return f"--staged {shlex.quote(str(Path(evaluation['staged_benchmarks'], name)))}"
        if evaluation.get("benchmark_cache"):
            return f"--cache-dir {shlex.quote(evaluation['benchmark_cache'])}"
        return ""

    def eval_launcher(self) -> str:
        """How an evaluation job starts `vlmcore`: one process, or eval.nproc under torchrun."""
        nproc = self.config["eval"]["nproc"]
        if nproc == 1:
            return "vlmcore"
        return f"torchrun --standalone --nproc-per-node {nproc} -m vlmcore.cli"

    def eval_results(self) -> list[str]:
        """One results.json per exported stage and task: adding a task adds only its jobs."""
        return [
            self.path("eval", stage, task, "results.json")
            for stage in self.exported_stages
            for task in self.stage_eval_tasks(stage)
        ]

    def model_config(self) -> dict | None:
        """The model's config.json where it is here already: the staged snapshot's, or the
        download's (None before the download)."""
        model = self.config["model"]
        directories = [self.path("model")]
        if model.get("staged_path"):
            directories.insert(0, model["staged_path"])
        for directory in directories:
            if Path(directory, "config.json").is_file():
                return json.loads(Path(directory, "config.json").read_text())
        return None

    def download_args(self) -> str:
        model = self.config["model"]
        if model["source"] == "tiny":
            tiny = model.get("tiny", {})
            return (
                f"--tiny --tiny-family {tiny.get('family', 'qwen3_vl')} --seed {tiny.get('seed', 0)} "
                f"--tiny-config {shlex.quote(json.dumps(tiny.get('overrides', {})))}"
            )
        revision = f" --revision {shlex.quote(model['revision'])}" if model.get("revision") else ""
        if model["source"] == "staged":
            return f"--staged {shlex.quote(model['staged_path'])}{revision}"
        return f"--repo-id {shlex.quote(model['repo_id'])}{revision}"

    def dataset_sources(self, dataset: str) -> list[str]:
        raw = self.path("raw")
        return [s.replace("{raw}", raw) for s in self.config["data"]["datasets"][dataset]["sources"]]

    def dataset_input_files(self, dataset: str) -> list[str]:
        return [s.split(":", 1)[1] for s in self.dataset_sources(dataset)]

    def stage_mix(self, stage: str) -> dict[str, float] | None:
        """The weights of a stage's mix of datasets (its `datasets`), or None for a stage on one dataset."""
        return self.config["train"]["stages"][stage].get("datasets")

    def stage_datasets(self, stage: str) -> list[str]:
        """The datasets of data.datasets that a stage trains on: its one dataset, or those of its mix."""
        mix = self.stage_mix(stage)
        return list(mix) if mix else [self.config["train"]["stages"][stage]["dataset"]]

    def stage_data(self, stage: str) -> str:
        """The stage's `data_path`: packed/<dataset>, or for a mix its blend file
        train/<stage>/data_mix.yaml (`stage_blend`, written by the mix_data rule)."""
        if self.stage_mix(stage):
            return self.path("train", stage, "data_mix.yaml")
        return self.path("packed", self.stage_datasets(stage)[0])

    def stage_blend(self, stage: str) -> dict:
        """The blend file of a mixed stage (vlmcore.blend): its packed datasets by weight, their paths
        relative to the file, so that the results directory can move."""
        blend_dir = Path(self.stage_data(stage)).parent
        entries = [(os.path.relpath(self.path("packed", d), blend_dir), w) for d, w in self.stage_mix(stage).items()]
        return blend_document(entries)

    def stage_config(self, stage: str) -> dict:
        """The `vlmcore train` config of one stage, paths filled in."""
        train = self.config["train"]
        settings = deep_merge(train.get("common", {}), train["stages"][stage])
        settings.pop("dataset", None)
        settings.pop("datasets", None)
        init_from = settings.pop("init_from", None)
        for launch_key in ("nodes", "runtime_minutes", "eval_tasks"):
            settings.pop(launch_key, None)
        if settings.get("objective") == "grpo":
            # A rollout row holds a prompt and its completion: as long as the packed rows, unless the stage says.
            settings["data"] = {"seq_len": self.config["pack"]["seq_len"], **settings.get("data", {})}
        settings.update(
            model_path=self.path("model"),
            data_path=self.stage_data(stage),
            output_dir=self.path("train", stage),
            init_from=self.path("train", init_from, "final") if init_from else None,
        )
        return settings

    def stage_nodes(self, stage: str) -> int:
        return self.config["train"]["stages"][stage].get("nodes", self.config["train"]["nodes"])

    def stage_runtime(self, stage: str) -> int:
        """Minutes of one training job of `stage`; a longer stage continues in the retry."""
        return self.config["train"]["stages"][stage].get("runtime_minutes", self.config["train"]["runtime_minutes"])

    def stage_restarts(self, stage: str) -> int:
        """Restarts of a stage's ranks inside one job (resilience.max_restarts; torchrun --max-restarts)."""
        resilience = self.stage_config(stage).get("resilience", {})
        return resilience.get("max_restarts", train_config.ResilienceConfig().max_restarts)

    def stage_ranks(self, stage: str) -> int:
        return self.stage_nodes(stage) * self.config["train"]["nproc_per_node"]

    def memory_fit_flags(self) -> str:
        """`vlmcore memory`'s flags for the nodes' GPU and host memory (train.gpu_memory_gib,
        train.host_memory_gib), those the config gives."""
        train = self.config["train"]
        flags = [
            f"--{key.replace('_', '-')} {train[key]}" for key in ("gpu_memory_gib", "host_memory_gib") if key in train
        ]
        return " ".join(flags)

    def stage_inputs(self, stage: str) -> dict:
        """What a stage's job reads: the snapshot, its data (a packed dataset, or a mix's blend file
        and every packed dataset of the mix) and the stage it starts from."""
        stage_cfg = self.config["train"]["stages"][stage]
        inputs = {"model": self.path("model", "manifest.json"), "data": self.stage_data(stage)}
        if self.stage_mix(stage):
            inputs["packed"] = [self.path("packed", d) for d in self.stage_datasets(stage)]
        if stage_cfg.get("init_from"):
            inputs["init"] = self.path("train", stage_cfg["init_from"], "done")
        return inputs

    def scaling_stage(self) -> str:
        return self.config["scaling"].get("stage") or self.stages[-1]

    def scaling_data(self) -> str:
        """The scaling runs' `data_path`: packed/<scaling.dataset>, else the scaling stage's data (a mix's blend file too)."""
        dataset = self.config["scaling"].get("dataset")
        return self.path("packed", dataset) if dataset else self.stage_data(self.scaling_stage())

    def scaling_config(self, world_size: int) -> dict:
        """Fixed-step, metrics-only run with the settings of the scaling stage."""
        settings = self.stage_config(self.scaling_stage())
        settings.update(
            data_path=self.scaling_data(),
            output_dir=self.path("scaling", f"ws{world_size}"),
            init_from=None,
            steps=self.config["scaling"]["steps"],
            save_final=False,
        )
        settings["checkpoint"] = deep_merge(settings.get("checkpoint", {}), {"enabled": False})
        # A scaling point measures speed over a few steps: a longer warmup is cut to fit them.
        schedule = settings.get("schedule", {})
        if schedule.get("warmup_steps", 0) > settings["steps"]:
            settings["schedule"] = dict(schedule, warmup_steps=settings["steps"])
        return settings


def as_yaml_arg(settings: dict) -> str:
    """A shell-quoted JSON document (JSON is YAML), for `printf %s ... > config.yaml` in a rule."""
    return shlex.quote(json.dumps(settings, sort_keys=True))
