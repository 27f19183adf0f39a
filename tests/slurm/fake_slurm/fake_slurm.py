#!/usr/bin/env python3
"""Fake SLURM commands for the SLURM executor tests: each name in this folder links here.

Every call is appended to $FAKE_SLURM_DIR/calls.jsonl ({"cmd", "argv", "env"}). `sbatch` runs
the --wrap command in the background on "nodes" node1..nodeN (N from --nodes) and records its
state for `sacct`/`squeue`; `srun` runs its command once per node with the variables SLURM
sets inside a step; `torchrun` records its arguments and environment and writes what
`vlmcore train` would (train/<stage>/final, done) instead of training.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

STATE = Path(os.environ["FAKE_SLURM_DIR"])
RECORDED_ENV = ("SLURM_", "VLMCORE_", "HF_", "TRANSFORMERS_", "WANDB_", "NCCL_", "GLOO_", "TORCHELASTIC_", "OMP_")


def record(cmd, argv):
    env = {k: v for k, v in os.environ.items() if k.startswith(RECORDED_ENV)}
    with open(STATE / "calls.jsonl", "a") as f:
        f.write(json.dumps({"cmd": cmd, "argv": argv, "env": env}) + "\n")


def options(argv):
    """Leading `--name=value` / `-xVALUE` options -> (dict, rest of argv)."""
    opts = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        name, _, value = argv[i].partition("=")
        opts[name] = value
        i += 1
    return opts, argv[i:]


def sbatch(argv):
    opts = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "=" in arg:
            name, value = arg.split("=", 1)
        elif arg in ("--job-name", "--output", "--comment", "-A", "-p", "-t", "-D", "--mem", "-C", "--clusters"):
            name, value = arg, argv[i + 1]
            i += 1
        else:
            name, value = arg, ""
        opts[name] = value
        i += 1
    counter = STATE / "next_id"
    job_id = int(counter.read_text()) if counter.exists() else 1000
    counter.write_text(str(job_id + 1))
    (STATE / "jobs").mkdir(exist_ok=True)
    (STATE / "jobs" / str(job_id)).write_text(f"{opts.get('--job-name', '')}|RUNNING")
    log = opts.get("--output", str(STATE / "slurm-%j.log")).replace("%j", str(job_id))
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SLURM_JOB_ID=str(job_id), SLURM_JOBID=str(job_id), FAKE_SLURM_NODES=opts.get("--nodes", "1"))
    subprocess.Popen(
        [sys.executable, __file__, "_batch", str(job_id), opts["--wrap"]],
        cwd=opts.get("-D") or None,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    print(job_id)


def batch(job_id, command):
    rc = subprocess.call(["/bin/sh", "-c", command])
    name = (STATE / "jobs" / job_id).read_text().split("|")[0]
    (STATE / "jobs" / job_id).write_text(f"{name}|{'COMPLETED' if rc == 0 else 'FAILED'}")


def job_states(name):
    for path in sorted((STATE / "jobs").glob("*")):
        job_name, state = path.read_text().split("|")
        if job_name == name:
            print(f"{path.name}|{state}")


def srun(argv):
    opts, command = options(argv)
    nodes = int(opts.get("--nodes") or opts.get("-N") or 1)
    nodelist = ",".join(f"node{i + 1}" for i in range(int(os.environ.get("FAKE_SLURM_NODES", nodes))))
    procs = []
    for rank in range(nodes):
        env = dict(
            os.environ,
            SLURM_STEP_ID="0",
            SLURM_NODEID=str(rank),
            SLURM_PROCID=str(rank),
            SLURM_LOCALID="0",
            SLURM_NNODES=str(nodes),
            SLURM_NTASKS=str(nodes),
            SLURM_JOB_NODELIST=nodelist,
            SLURMD_NODENAME=f"node{rank + 1}",
        )
        procs.append(subprocess.Popen(command, env=env))
    sys.exit(max(p.wait() for p in procs))


def scontrol(argv):
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(argv[2].split(",")))
    elif argv[:2] == ["show", "config"]:
        print("MinJobAge               = 300 sec")


def torchrun(argv):
    config = argv[argv.index("train") + 1]
    settings = json.loads(Path(config).read_text())
    if os.environ.get("SLURM_NODEID", "0") == "0":
        out = Path(settings["output_dir"])
        (out / "final").mkdir(parents=True, exist_ok=True)
        (out / "final" / "meta.json").write_text("{}")
        (out / "done").write_text("fake torchrun\n")


def main():
    cmd = Path(sys.argv[0]).name
    argv = sys.argv[1:]
    if argv[:1] == ["_batch"]:
        batch(argv[1], argv[2])
        return
    record(cmd, argv)
    if cmd == "sbatch":
        sbatch(argv)
    elif cmd in ("sacct", "squeue"):
        job_states(argv[argv.index("--name") + 1])
    elif cmd in ("sacctmgr", "sshare"):
        print(os.environ.get("FAKE_SLURM_ACCOUNT", ""))
    elif cmd == "sinfo":
        print("debug*")
    elif cmd == "srun":
        srun(argv)
    elif cmd == "scontrol":
        scontrol(argv)
    elif cmd == "torchrun":
        torchrun(argv)


if __name__ == "__main__":
    main()
