"""What the real-SLURM tests share (tests/slurm/test_slurm_real.py, tests/slurm/test_slurm_demo.py): the check
that a SLURM with two usable nodes is up (.ci/slurm_setup.sh), the experiment config, Snakemake
through the `slurm-ci` profile and the jobs SLURM ran."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def squeue():
    """The jobs SLURM holds, for an error message: the ones that keep nodes busy."""
    proc = subprocess.run(["squeue", "-h", "-o", "%i %j %T %M %N"], capture_output=True, text=True, timeout=30)
    return "; ".join(proc.stdout.strip().splitlines()) or "(no jobs)"


def require_slurm():
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=30)
        idle_nodes = sum(
            int(line.split()[0]) for line in proc.stdout.splitlines() if line.split()[1] in ("idle", "mix")
        )
        problem = (
            None
            if proc.returncode == 0 and idle_nodes >= 2
            else f"`sinfo` says: {proc.stdout.strip()} {proc.stderr.strip()}; `squeue` says: {squeue()}"
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        problem = f"`sinfo` failed: {e}"
    if problem:
        reason = f"no SLURM with two usable nodes ({problem}); start one with `.ci/slurm_setup.sh` (root)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def write_config(tmp_path, name, source="config.yaml", **train):
    config = yaml.safe_load((REPO / "config" / source).read_text())
    config["experiment"] = name
    config["train"].update(train)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, tmp_path / "results" / name


def snakemake(tmp_path, configfile, target, *extra, timeout=1200):
    env = dict(
        os.environ,
        VLMCORE_CLUSTER="ci",
        OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--profile",
            str(REPO / "profiles" / "slurm-ci"),
            "--configfile",
            str(configfile),
            "--directory",
            str(tmp_path),
            *extra,
            target,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-10000:]
    return proc


def slurm_jobs(tmp_path, rule):
    """{job id: `scontrol show job` fields} of the SLURM jobs of `rule`, oldest first."""
    ids = sorted(int(p.stem) for p in tmp_path.glob(f".snakemake/slurm_logs/rule_{rule}/**/*.log"))
    jobs = {}
    for job_id in ids:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True).stdout
        jobs[job_id] = dict(field.split("=", 1) for field in out.split() if "=" in field)
    return jobs
