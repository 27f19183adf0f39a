"""Cluster profiles and recipes, without a cluster: every recipe dry-runs with its cluster's
profile, each rule lands on the right partition, and a staged snapshot is verified on the
MareNostrum 5 login node (a local rule) before anything uses it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import CLUSTER_ENV, planned_jobs

from vlmcore.download import write_manifest

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "config" / "experiments").glob("*.yaml"))
# What a recipe evaluates follows what it trains: the recipes that pack videos the video
# benchmarks, the others (all with a vision-language model) the image benchmarks.
VIDEO_BENCHMARKS = ["videomme", "videomme_w_subtitle", "mvbench"]
IMAGE_BENCHMARKS = ["mmmu_val", "chartqa", "docvqa_val", "mmbench_en_dev"]

pytestmark = pytest.mark.workflow


def snakemake(tmp_path, cluster, recipe, *args, path_prefix=None):
    env = dict(os.environ, **CLUSTER_ENV, VLMCORE_CLUSTER=cluster)
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{Path(sys.executable).parent}:{env['PATH']}"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--profile",
            str(REPO / "profiles" / cluster),
            "--configfile",
            str(recipe),
            "--directory",
            str(tmp_path),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def stage_inputs(tmp_path, recipe):
    """Empty stand-ins for the staged model and datasets a recipe reads."""
    config = yaml.safe_load(recipe.read_text())
    for dataset in config["data"]["datasets"].values():
        for source in dataset["sources"]:
            path = tmp_path / source.split(":", 1)[1]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
    return config


def test_every_recipe_names_its_cluster():
    assert {r.stem.rsplit("-", 1)[1] for r in RECIPES} == {"mn5", "jupiter"}
    assert {r.stem.rsplit("-", 1)[0] for r in RECIPES} >= {"qwen3vl-2b", "qwen3vl-8b", "qwen35-9b"}


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_dry_runs_and_places_rules(tmp_path, recipe):
    cluster = recipe.stem.rsplit("-", 1)[1]
    config = stage_inputs(tmp_path, recipe)
    proc = snakemake(tmp_path, cluster, recipe, "-n", "train_all")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = planned_jobs(proc.stdout)

    assert config["model"]["source"] == {"mn5": "staged", "jupiter": "hub"}[cluster]
    assert re.fullmatch(r"[0-9a-f]{40}", config["model"]["revision"])
    nodes = config["train"]["nodes"]
    for job in jobs["train_stage"]:
        assert job["slurm_account"] == "ehpc01"
        assert (job["nodes"], job["tasks"], job["mpi"]) == (str(nodes), str(4 * nodes), "srun")
        assert (job["gres"], job["tasks_per_gpu"], job["mem_mb"]) == ("gpu:4", "0", "0")
        assert job["runtime"] == str(config["train"]["runtime_minutes"])
        assert job["slurm_extra"] == "--ntasks-per-node=4 --signal=USR1@600"
    assert jobs["evaluate"][0]["gres"] == "gpu:1"
    # Each exported stage is evaluated on each task, offline; the public benchmarks among the tasks
    # are staged on the login node (a local rule; MareNostrum 5: verified from a copy).
    from vlmcore.eval.benchmarks.registry import BENCHMARKS

    tasks = config["eval"]["tasks"]
    assert tasks == (VIDEO_BENCHMARKS if "video" in config["pack"] else IMAGE_BENCHMARKS)
    assert len(jobs["evaluate"]) == len(config["train"]["stages"]) * len(tasks)
    staged = [task for task in tasks if task in BENCHMARKS]
    assert len(jobs["download_benchmark"]) == len(staged)
    root = f"results/{config['experiment']}"
    for task in staged:
        source = f"--staged staged/benchmarks/{task}" if cluster == "mn5" else ""
        assert f"vlmcore stage-benchmark {task} {source} --out {root}/benchmarks/{task} " in proc.stdout
        for stage in config["train"]["stages"]:
            # the evaluation of every exported stage on the task, reading the staged copy
            assert re.search(
                rf"eval --model {root}/hf/{stage} --tasks {task} --out {root}/eval/{stage}/{task} .*"
                rf"--benchmark-data {root}/benchmarks ",
                proc.stdout,
            ), (stage, task)
    # the measure pass of each dataset that is packed, scattered over pack.measure_jobs CPU jobs
    assert len(jobs["pack_measure"]) == config["pack"]["measure_jobs"] * len(jobs["pack_data"])
    if cluster == "mn5":
        gpu_rules, cpu_rules = (
            ("train_stage", "scaling_run", "evaluate"),
            ("prepare_data", "pack_measure", "pack_data", "export_hf"),
        )
        for rule in gpu_rules:
            assert {(j["slurm_partition"], j["qos"], j["cpus_per_task"]) for j in jobs[rule]} == {
                ("acc", "acc_ehpc", "20")
            }
        for rule in cpu_rules:
            assert {(j["slurm_partition"], j["qos"]) for j in jobs[rule]} == {("gpp", "gp_ehpc")}
            assert "gres" not in jobs[rule][0]
    else:
        for rule in (
            "train_stage",
            "scaling_run",
            "evaluate",
            "prepare_data",
            "pack_measure",
            "pack_data",
            "export_hf",
        ):
            assert {(j["slurm_partition"], j["cpus_per_task"]) for j in jobs[rule]} == {("booster", "72")}
            assert "qos" not in jobs[rule][0]
        assert "gres" not in jobs["pack_data"][0]


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.stem.startswith("qwen3vl-2b")], ids=lambda r: r.stem)
def test_memory_estimate_is_a_cpu_job_per_stage(tmp_path, recipe):
    cluster = recipe.stem.rsplit("-", 1)[1]
    config = stage_inputs(tmp_path, recipe)
    proc = snakemake(tmp_path, cluster, recipe, "-n", "memory")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    estimates = planned_jobs(proc.stdout)["estimate_memory"]
    assert len(estimates) == len(config["train"]["stages"])
    assert {j["slurm_partition"] for j in estimates} == {{"mn5": "gpp", "jupiter": "booster"}[cluster]}
    assert all("gres" not in j for j in estimates)
    # Each checks its stage against the cluster's GPU memory.
    gib = {"mn5": 64, "jupiter": 96}[cluster]
    assert config["train"]["gpu_memory_gib"] == gib
    assert proc.stdout.count(f"--gpu-memory-gib {gib} --json") == len(estimates)


def stage_snapshot(workdir, recipe, weights_size):
    """A staged copy of the recipe's model whose manifest lists 1000 bytes of weights."""
    config = stage_inputs(workdir, recipe)
    staged = workdir / config["model"]["staged_path"]
    staged.mkdir(parents=True)
    (staged / "config.json").write_text('{"model_type": "qwen3_vl"}')
    (staged / "model.safetensors").write_bytes(b"\0" * 1000)
    write_manifest(staged, config["model"]["repo_id"], config["model"]["revision"])
    (staged / "model.safetensors").write_bytes(b"\0" * weights_size)
    return config, staged


@pytest.mark.parametrize("weights_size", [1000, 10], ids=["complete", "truncated"])
def test_staged_snapshot_is_verified_on_the_login_node(tmp_path, weights_size):
    """MN5: download_model (a local rule: nothing is submitted) checks the copied-in snapshot."""
    recipe = REPO / "config" / "experiments" / "qwen3vl-2b-mn5.yaml"
    config, staged = stage_snapshot(tmp_path, recipe, weights_size)
    fakes = tmp_path / "fake_bin"
    fakes.mkdir()
    for name in ("sbatch", "srun"):
        (fakes / name).write_text('#!/bin/sh\necho "$0 must not be called" >&2\nexit 1\n')
        (fakes / name).chmod(0o755)
    (fakes / "sacctmgr").write_text("#!/bin/sh\necho ehpc01\n")
    (fakes / "sacctmgr").chmod(0o755)
    target = tmp_path / "results" / config["experiment"] / "model" / "manifest.json"

    # The executor's first status check comes after 40 s (the profile's): Snakemake waited that long
    # to end, though nothing was submitted.
    proc = snakemake(
        tmp_path,
        "mn5",
        recipe,
        str(target.relative_to(tmp_path)),
        "--retries",
        "0",
        "--slurm-init-seconds-before-status-checks",
        "1",
        path_prefix=fakes,
    )
    if weights_size == 1000:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        model = target.parent
        assert (model / "model.safetensors").resolve() == (staged / "model.safetensors").resolve()
        assert target.read_bytes() == (staged / "manifest.json").read_bytes() and not target.is_symlink()
        assert "model.safetensors" in yaml.safe_load(target.read_text())["files"]
    else:
        assert proc.returncode != 0
        log = tmp_path / "results" / config["experiment"] / "logs" / "download_model.log"
        assert "model.safetensors: size 10, manifest says 1000" in log.read_text()
    assert "must not be called" not in proc.stderr


def test_staged_benchmark_is_verified_on_the_login_node(tmp_path):
    """MN5: download_benchmark (a local rule: nothing is submitted) verifies the copied-in
    benchmark and links it into the experiment; a damaged copy fails naming the file."""
    import pandas as pd

    from vlmcore.eval.benchmarks.registry import BENCHMARKS
    from vlmcore.eval.staging import stage_snapshot

    recipe = REPO / "config" / "experiments" / "qwen3vl-2b-mn5.yaml"
    config = stage_inputs(tmp_path, recipe)
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    pd.DataFrame({"question": ["q"], "answer": ["a"]}).to_parquet(hub / "data/test-00000-of-00001.parquet")
    tasks = config["eval"]["tasks"]
    for task in tasks:
        stage_snapshot(hub, tmp_path / "staged/benchmarks" / task, BENCHMARKS[task], "c0ffee", ["data/*"])
    fakes = tmp_path / "fake_bin"
    fakes.mkdir()
    for name in ("sbatch", "srun"):
        (fakes / name).write_text('#!/bin/sh\necho "$0 must not be called" >&2\nexit 1\n')
        (fakes / name).chmod(0o755)
    (fakes / "sacctmgr").write_text("#!/bin/sh\necho ehpc01\n")
    (fakes / "sacctmgr").chmod(0o755)
    root = tmp_path / "results" / config["experiment"]
    args = ["--retries", "0", "--slurm-init-seconds-before-status-checks", "1"]
    proc = snakemake(tmp_path, "mn5", recipe, "benchmarks", *args, path_prefix=fakes)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for task in tasks:
        staged = root / "benchmarks" / task / "data/test-00000-of-00001.parquet"
        assert staged.resolve() == (hub / "data/test-00000-of-00001.parquet").resolve()
    assert "must not be called" not in proc.stderr

    (hub / "data/test-00000-of-00001.parquet").write_bytes(b"damaged")
    proc = snakemake(tmp_path, "mn5", recipe, "benchmarks", "--forceall", *args, path_prefix=fakes)
    assert proc.returncode != 0
    log = (root / "logs" / "download_benchmark" / "chartqa.log").read_text()
    assert "data/test-00000-of-00001.parquet: size 7, manifest says" in log
    assert "must not be called" not in proc.stderr


def test_evaluation_asks_for_a_gpu_per_process(tmp_path):
    """JUPITER with eval.nproc 4: each evaluation job gets the node's 4 GPUs, one per process."""
    config = stage_inputs(tmp_path, REPO / "config" / "experiments" / "qwen3vl-2b-jupiter.yaml")
    config["eval"]["nproc"] = 4
    recipe = tmp_path / "qwen3vl-2b-jupiter-nproc4.yaml"
    recipe.write_text(yaml.safe_dump(config))
    proc = snakemake(tmp_path, "jupiter", recipe, "-n", "-p", "eval")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = planned_jobs(proc.stdout)["evaluate"]
    assert {(j["gres"], j["slurm_partition"]) for j in jobs} == {("gpu:4", "booster")}
    assert proc.stdout.count("torchrun --standalone --nproc-per-node 4 -m vlmcore.cli eval") == len(jobs)
