"""The workflow's shape: lint-clean, every target plans the right jobs, without running them."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def snakemake(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, capture_output=True, text=True)


def job_stats(output: str) -> dict:
    table = output.split("Job stats:")[1].split("total")[0]
    rows = [line.split() for line in table.strip().splitlines()[2:]]
    return {row[0]: int(row[1]) for row in rows if len(row) == 2}


def test_lint_is_clean():
    proc = snakemake("--lint")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations" in proc.stdout + proc.stderr


# The demo packs each of its 2 datasets in 2 measure jobs, 1 plan job, 2 write jobs and the pack job.
PACK = {"pack_measure": 4, "pack_plan": 2, "pack_write": 4, "pack_data": 2}


@pytest.mark.parametrize(
    "target, expected",
    [
        ("model", {"download_model": 1}),
        ("data", {"synth_data": 1, "prepare_data": 2}),
        ("packed", {"download_model": 1, "synth_data": 1, "prepare_data": 2, **PACK}),
        ("train", {"download_model": 1, "synth_data": 1, "prepare_data": 2, **PACK, "train_stage": 2}),
        (
            "scaling",
            {
                "download_model": 1,
                "synth_data": 1,
                "prepare_data": 1,
                "pack_measure": 2,
                "pack_plan": 1,
                "pack_write": 2,
                "pack_data": 1,
                "scaling_run": 2,
            },
        ),
        (
            "train_all",
            {
                "download_model": 1,
                "synth_data": 1,
                "prepare_data": 2,
                **PACK,
                "train_stage": 2,
                "export_hf": 2,
                "evaluate": 2,
                "scaling_run": 2,
                "scaling_report": 1,
            },
        ),
        ("hf", {"download_model": 1, "synth_data": 1, "prepare_data": 2, **PACK, "train_stage": 2, "export_hf": 2}),
    ],
)
def test_each_target_plans_its_stages(tmp_path, target, expected):
    proc = snakemake(
        "-n",
        "--profile",
        str(REPO / "profiles/local"),
        "--snakefile",
        str(REPO / "Snakefile"),
        "--configfile",
        str(REPO / "config/config.yaml"),
        "--directory",
        str(tmp_path),
        target,
    )
    assert proc.returncode == 0, proc.stderr
    stats = job_stats(proc.stdout)
    stats.pop(target, None)
    assert stats == expected


DEMO_JOBS = {
    "download_model": 1,
    "synth_data": 1,
    "prepare_data": 2,
    **PACK,
    "train_stage": 2,
    "export_hf": 2,
    "evaluate": 2,
    "scaling_run": 2,
    "scaling_report": 1,
}


def plan_demo_variant(tmp_path, name: str) -> tuple[str, dict, dict]:
    """The dry-run of config/<name> (every job of the demo's DAG, checked), its printed commands, and
    that config and config/config.yaml with their `experiment` taken out."""
    proc = snakemake(
        "-n",
        "-p",
        "--profile",
        str(REPO / "profiles/local"),
        "--snakefile",
        str(REPO / "Snakefile"),
        "--configfile",
        str(REPO / "config" / name),
        "--directory",
        str(tmp_path),
        "train_all",
    )
    assert proc.returncode == 0, proc.stderr
    stats = job_stats(proc.stdout)
    stats.pop("train_all", None)
    tasks = yaml.safe_load((REPO / "config" / name).read_text())["eval"]["tasks"]
    assert stats == dict(DEMO_JOBS, evaluate=2 * len(tasks))  # each exported stage, each task
    demo, variant = (yaml.safe_load((REPO / "config" / f).read_text()) for f in ("config.yaml", name))
    demo.pop("experiment")
    assert variant.pop("experiment") == name.removesuffix(".yaml")
    return proc.stdout, demo, variant


def test_moe_demo_plans_the_demo_with_a_tiny_moe_model(tmp_path):
    """config/demo-moe.yaml: the demo's whole DAG, its tiny model a Qwen3-VL-MoE."""
    stdout, demo, moe = plan_demo_variant(tmp_path, "demo-moe.yaml")
    assert "vlmcore download --tiny --tiny-family qwen3_vl_moe " in stdout
    assert "results/demo-moe/model" in stdout
    # It is the demo in all else (a --configfile replaces config/config.yaml, hence a full copy).
    assert moe["model"]["tiny"].pop("family") == "qwen3_vl_moe"
    assert moe == demo


def test_video_demo_plans_the_demo_on_generated_clips(tmp_path):
    """config/demo-video.yaml: the demo's whole DAG on synthetic clips, evaluated with its control."""
    stdout, demo, video = plan_demo_variant(tmp_path, "demo-video.yaml")
    assert "vlmcore synth --kind video --out results/demo-video/raw" in stdout
    for stage in ("stage1", "stage2"):
        for task in ("demo_video_qa", "demo_video_qa_shuffled"):
            assert f"--model results/demo-video/hf/{stage} --tasks {task} " in stdout
    # The demo's model, training and packing; its data and questions are video.
    assert video["data"].pop("synthetic")["kind"] == "video" and video.pop("eval") == {
        "tasks": ["demo_video_qa", "demo_video_qa_shuffled"],
        "batch_size": 16,
    }
    demo["data"].pop("synthetic"), demo.pop("eval")
    assert video == demo


def demo_dry_run(tmp_path: Path, *overlays: Path) -> str:
    """The printed dry run (`-n -p`) of the demo's train_all with `overlays` merged in."""
    proc = snakemake(
        "-n",
        "-p",
        "--profile",
        str(REPO / "profiles/local"),
        "--snakefile",
        str(REPO / "Snakefile"),
        "--configfile",
        str(REPO / "config" / "config.yaml"),
        *map(str, overlays),
        "--directory",
        str(tmp_path),
        "train_all",
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_dpo_demo_adds_a_dpo_stage_to_the_demo(tmp_path):
    """config/demo-dpo.yaml, merged into the demo: the demo's DAG and outputs, plus the synthetic
    preference pairs prepared as a preference source and a `dpo` stage from stage1's weights; stage1
    (before DPO) and dpo (after) evaluated on the held-out pairs, the other evaluations the demo's."""
    stdout = demo_dry_run(tmp_path, REPO / "config" / "demo-dpo.yaml")
    assert "vlmcore synth --kind image --out results/demo/raw" in stdout
    assert "--source preference:results/demo/raw/preference.jsonl" in stdout
    for stage, task in [("stage1", "demo_vqa"), ("stage1", "demo_preference"), ("stage2", "demo_vqa")]:
        assert f"--model results/demo/hf/{stage} --tasks {task} " in stdout
    assert "--model results/demo/hf/dpo --tasks demo_preference " in stdout
    assert "--model results/demo/hf/dpo --tasks demo_vqa " not in stdout
    assert "--model results/demo/hf/stage2 --tasks demo_preference " not in stdout
    stats = job_stats(stdout)
    stats.pop("train_all", None)
    more = {"prepare_data": 1, "pack_measure": 2, "pack_plan": 1, "pack_write": 2, "pack_data": 1}
    more.update(train_stage=1, export_hf=1, evaluate=2)
    assert stats == {rule: count + more.get(rule, 0) for rule, count in DEMO_JOBS.items()}, stats
    dpo = yaml.safe_load((REPO / "config" / "demo-dpo.yaml").read_text())["train"]["stages"]["dpo"]
    assert dpo["objective"] == "dpo" and dpo["init_from"] == "stage1" and dpo["dataset"] == "preference"


def test_grpo_demo_and_an_sft_dpo_grpo_chain_plan_their_stages(tmp_path):
    """config/demo-grpo.yaml, merged into the demo: the demo's DAG, plus the synthetic RL prompts
    prepared as a `prompts:` source, a short SFT stage from stage1 and a `grpo` stage from it, both
    evaluated on the held-out generated answers. With the DPO overlay and the grpo stage started
    from the dpo stage's weights, train_all chains SFT -> DPO -> GRPO."""
    stdout = demo_dry_run(tmp_path, REPO / "config" / "demo-grpo.yaml")
    assert "--source prompts:results/demo/raw/prompts.jsonl" in stdout
    for stage in ("sft_short", "grpo"):
        assert f"--model results/demo/hf/{stage} --tasks demo_vqa_gen " in stdout
    assert '"init_from": "results/demo/train/sft_short/final"' in stdout and '"objective": "grpo"' in stdout
    stats = job_stats(stdout)
    stats.pop("train_all", None)
    more = {"prepare_data": 1, "pack_measure": 2, "pack_plan": 1, "pack_write": 2, "pack_data": 1}
    more.update(train_stage=2, export_hf=2, evaluate=2)
    assert stats == {rule: count + more.get(rule, 0) for rule, count in DEMO_JOBS.items()}, stats

    chain = tmp_path / "chain.yaml"
    chain.write_text(yaml.safe_dump({"train": {"stages": {"grpo": {"init_from": "dpo"}}}}))
    stdout = demo_dry_run(tmp_path, REPO / "config" / "demo-dpo.yaml", REPO / "config" / "demo-grpo.yaml", chain)
    assert '"init_from": "results/demo/train/dpo/final"' in stdout and '"objective": "grpo"' in stdout
    assert '"init_from": "results/demo/train/stage1/final"' in stdout and '"objective": "dpo"' in stdout
    assert job_stats(stdout)["train_stage"] == DEMO_JOBS["train_stage"] + 3  # dpo, sft_short, grpo


# A corpus of 100M samples (10,000 input shards of 10,000), on top of a cluster recipe: the measure
# pass scattered over 32 CPU jobs, the writing over 16 (docs/hpc.md section 12).
CORPUS_100M = {
    "data": {"datasets": {"corpus_100m": {"sources": ["conversations:staged/data/corpus-100m"], "shard_size": 10000}}},
    "pack": {"measure_jobs": 32, "write_jobs": 16, "video": {"fps": 1, "max_frames": 64}},
}


@pytest.mark.parametrize("cluster, partition", [("mn5", "gpp"), ("jupiter", "booster")])
def test_corpus_of_100m_samples_plans_its_scattered_pack(tmp_path, cluster, partition):
    """Nothing of the corpus needs to exist to plan it: its measure and write jobs, each on the
    cluster's CPU partition, and the plan and pack jobs between them."""
    from helpers import CLUSTER_ENV, planned_jobs

    recipe = REPO / "config" / "experiments" / f"qwen3vl-2b-{cluster}.yaml"
    overlay = tmp_path / "corpus-100m.yaml"
    overlay.write_text(yaml.safe_dump(CORPUS_100M))
    (tmp_path / "staged/data/corpus-100m").mkdir(parents=True)
    target = f"results/qwen3vl-2b-{cluster}/packed/corpus_100m"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--profile",
            str(REPO / "profiles" / cluster),
            "--configfile",
            str(recipe),
            str(overlay),
            "--directory",
            str(tmp_path),
            target,
        ],
        env=dict(os.environ, **CLUSTER_ENV, VLMCORE_CLUSTER=cluster),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert job_stats(proc.stdout) == {
        "download_model": 1,
        "prepare_data": 1,
        "pack_measure": 32,
        "pack_plan": 1,
        "pack_write": 16,
        "pack_data": 1,
    }
    jobs = planned_jobs(proc.stdout)
    for rule in ("pack_measure", "pack_plan", "pack_write", "pack_data"):
        assert {j["slurm_partition"] for j in jobs[rule]} == {partition} and "gres" not in jobs[rule][0]
    shell = proc.stdout
    assert all(f"--measure-group {g}/32 " in shell for g in range(32))
    assert all(f"--write-group {g}/16 " in shell for g in range(16))
    assert shell.count("--plan-only ") == 1
    # The video sampling settings reach every job of the pack (they decide the packs' bytes).
    assert shell.count("--video-fps 1 --video-max-frames 64") == 32 + 1 + 16 + 1


def plan_demo(tmp_path, *args, overlay: dict | None = None) -> subprocess.CompletedProcess:
    """A dry run of the demo in `tmp_path`, with `overlay` as a second config file."""
    configfiles = [str(REPO / "config/config.yaml")]
    if overlay:
        (tmp_path / "overlay.yaml").write_text(yaml.safe_dump(overlay))
        configfiles.append(str(tmp_path / "overlay.yaml"))
    proc = snakemake(
        "-n",
        "-p",
        "--profile",
        str(REPO / "profiles/local"),
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(tmp_path),
        *args,
        "--configfile",
        *configfiles,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


# Outputs that the rules declare as directory(): the rest are files.
DIRECTORY_OUTPUTS = re.compile(r"/(data|packed|hf)/[^/]+$|/final$|/plots$")


def test_adding_a_task_evaluates_only_that_task(tmp_path):
    """Every output of the demo in place (as after a finished run), then eval.tasks gains a demo
    task and a public benchmark: only their evaluations of each exported stage are planned (and the
    benchmark's staging, and the report); demo_vqa's results stand."""
    for line in plan_demo(tmp_path, "train_all").stdout.splitlines():
        match = re.match(r"\s+output: (.*)", line)
        for output in match.group(1).split(", ") if match else []:
            path = tmp_path / output
            if DIRECTORY_OUTPUTS.search(output):
                path.mkdir(parents=True, exist_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
    assert "Nothing to be done" in plan_demo(tmp_path, "train_all").stdout
    more = {"eval": {"tasks": ["demo_vqa", "demo_vqa_gen", "chartqa"], "batch_size": 16}}
    proc = plan_demo(tmp_path, "train_all", overlay=more)
    stats = job_stats(proc.stdout)
    assert stats == {"download_benchmark": 1, "evaluate": 4, "scaling_report": 1, "train_all": 1}
    planned = set(re.findall(r"output: (results/demo/eval/\S+)", proc.stdout))
    assert planned == {
        f"results/demo/eval/{s}/{t}/results.json" for s in ("stage1", "stage2") for t in more["eval"]["tasks"][1:]
    }


def test_a_public_benchmark_is_staged_on_the_login_node_and_evaluated_offline(tmp_path):
    """A benchmark of eval.tasks: a local rule stages it (from the hub, or verified from
    eval.staged_benchmarks), and each stage's evaluation reads it with the hubs switched off."""
    overlay = {"eval": {"tasks": ["demo_vqa", "chartqa"], "batch_size": 16}}
    proc = plan_demo(tmp_path, "benchmarks", overlay=overlay)
    assert job_stats(proc.stdout) == {"download_benchmark": 1, "benchmarks": 1}
    assert "vlmcore stage-benchmark chartqa  --out results/demo/benchmarks/chartqa " in proc.stdout

    stdout = plan_demo(tmp_path, "train_all", overlay=overlay).stdout
    for stage in ("stage1", "stage2"):
        assert (
            f"HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 vlmcore eval --model results/demo/hf/{stage}"
            f" --tasks chartqa --out results/demo/eval/{stage}/chartqa --vqa-data results/demo/raw/eval.jsonl"
            " --benchmark-data results/demo/benchmarks " in stdout
        )
        assert (
            f"--tasks demo_vqa --out results/demo/eval/{stage}/demo_vqa --vqa-data results/demo/raw/eval.jsonl  "
            in stdout
        )
    assert "--eval stage1=results/demo/eval/stage1 --eval stage2=results/demo/eval/stage2" in stdout

    offline = {"eval": dict(overlay["eval"], staged_benchmarks="staged/benchmarks")}
    stdout = plan_demo(tmp_path, "benchmarks", overlay=offline).stdout
    assert (
        "vlmcore stage-benchmark chartqa --staged staged/benchmarks/chartqa --out results/demo/benchmarks/chartqa "
        in stdout
    )
    cached = {"eval": dict(overlay["eval"], benchmark_cache="/shared/hf")}
    stdout = plan_demo(tmp_path, "benchmarks", overlay=cached).stdout
    assert "vlmcore stage-benchmark chartqa --cache-dir /shared/hf --out results/demo/benchmarks/chartqa " in stdout


def test_an_evaluation_job_is_split_over_eval_nproc_processes(tmp_path):
    """eval.nproc > 1: each evaluation job runs its task data parallel under torchrun."""
    stdout = plan_demo(tmp_path, "eval", overlay={"eval": {"nproc": 2, "tasks": ["demo_vqa"]}}).stdout
    for stage in ("stage1", "stage2"):
        assert (
            "TRANSFORMERS_OFFLINE=1 torchrun --standalone --nproc-per-node 2 -m vlmcore.cli eval"
            f" --model results/demo/hf/{stage} --tasks demo_vqa " in stdout
        )
    default = plan_demo(tmp_path, "eval").stdout
    assert "TRANSFORMERS_OFFLINE=1 vlmcore eval --model" in default and "torchrun --standalone" not in default


def test_a_lora_stage_is_exported_with_its_peft_adapter(tmp_path):
    """A stage with lora.rank > 0: its export job also writes the adapters as a peft adapter
    directory inside the export (hf/<stage>/peft_adapter); a stage without LoRA writes none."""
    overlay = {"train": {"stages": {"stage2": {"lora": {"rank": 4, "alpha": 8}}}}}
    stdout = plan_demo(tmp_path, "hf", "--forceall", overlay=overlay).stdout
    exports = [line for line in stdout.splitlines() if "vlmcore export " in line]
    assert len(exports) == 2, exports
    stage1, stage2 = sorted(exports, key=lambda line: "train/stage2/final" in line)
    assert "--out results/demo/hf/stage2 " in stage2
    assert " --peft-adapter results/demo/hf/stage2/peft_adapter " in stage2
    assert "--out results/demo/hf/stage1 " in stage1 and "--peft-adapter" not in stage1


def test_a_stage_started_from_an_earlier_one_is_exported_with_its_lineage(tmp_path):
    """config/demo-lora.yaml's stage3 starts from stage1, beside stage2: its export records (and
    waits for) stage1 and stage3 only, never stage2, and names stage1's export as its peft
    adapter's base, which the export job declares as an input: planning hf/stage3 alone trains
    stage1 and stage3, and exports stage1 first."""
    overlay = yaml.safe_load((REPO / "config/demo-lora.yaml").read_text())
    stdout = plan_demo(tmp_path, "--forceall", "results/demo-lora/hf/stage3", overlay=overlay).stdout
    stats = job_stats(stdout)
    assert (stats["train_stage"], stats["export_hf"]) == (2, 2)
    assert "train/stage2" not in stdout
    exports = [line for line in stdout.splitlines() if "vlmcore export " in line]
    assert "--out results/demo-lora/hf/stage1 " in exports[0]
    stage3 = exports[1]
    r = "results/demo-lora"
    assert f"--stage-config {r}/train/stage1/config.yaml --stage-config {r}/train/stage3/config.yaml " in stage3
    assert f"--peft-adapter {r}/hf/stage3/peft_adapter --peft-base {r}/hf/stage1 " in stage3


def dry_run_jobs(stdout: str) -> list[dict]:
    """Each job of a dry run (-n -p): its rule, its printed fields (input, output, ...) and its shell command."""
    jobs = []
    for block in re.split(r"\n(?=rule \w+:)", stdout):
        match = re.match(r"rule (\w+):", block)
        if not match:
            continue
        job = {"rule": match.group(1)}
        job |= dict(re.findall(r"^    (\w+): (.*)$", block, re.MULTILINE))
        shell = re.search(r"^Shell command: (.*)$", block, re.MULTILINE)
        job["shell"] = shell.group(1) if shell else ""
        jobs.append(job)
    return jobs


def test_a_stage_on_a_mix_depends_on_every_dataset_and_reads_its_blend(tmp_path):
    """A stage with `datasets` (a weighted mix): its blend file train/<stage>/data_mix.yaml is
    written by a local job from both packed datasets, the stage's job reads the file and both
    packed datasets and trains with the file as its data_path, and the export records both
    datasets' statistics."""
    weights = {"captions": 0.7, "conversations": 0.3}
    overlay = {"train": {"stages": {"stage3": {"datasets": weights, "init_from": "stage2", "steps": 10}}}}
    jobs = dry_run_jobs(plan_demo(tmp_path, "--forceall", "hf", overlay=overlay).stdout)
    blend = "results/demo/train/stage3/data_mix.yaml"
    packed = "results/demo/packed/captions, results/demo/packed/conversations"
    (mix,) = [job for job in jobs if job["rule"] == "mix_data"]
    assert mix["input"] == packed and mix["output"] == blend
    entries = ", ".join(f'{{"path": "../../packed/{name}", "weight": {weight}}}' for name, weight in weights.items())
    assert f'"blend": [{entries}]' in mix["shell"] and f"> {blend}" in mix["shell"]
    (stage3,) = [job for job in jobs if job["rule"] == "train_stage" and job["wildcards"] == "stage=stage3"]
    assert stage3["input"] == f"results/demo/model/manifest.json, {blend}, {packed}, results/demo/train/stage2/done"
    assert f'"data_path": "{blend}"' in stage3["shell"] and '"datasets"' not in stage3["shell"]
    (export3,) = [job for job in jobs if job["rule"] == "export_hf" and job["wildcards"] == "stage=stage3"]
    stats = (
        "--data-stats results/demo/packed/captions/stats.json --data-stats results/demo/packed/conversations/stats.json"
    )
    assert stats in export3["shell"]
