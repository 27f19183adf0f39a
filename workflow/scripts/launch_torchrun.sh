#!/usr/bin/env bash
# Start `vlmcore train CONFIG` on NODES x NPROC_PER_NODE processes.
#   launch_torchrun.sh NODES NPROC_PER_NODE CONFIG [extra vlmcore train args]
# Outside SLURM: torchrun --standalone. Under SLURM the rule body runs in the batch step (the
# rule has the `mpi` resource): start one task per node with srun, each re-entering this script,
# which derives the rendezvous host and node rank inside the step, where SLURM sets them (the
# jobstep plugin strips SLURM_* from the batch step). $VLMCORE_CLUSTER picks env/<cluster>.sh.
set -euo pipefail
nodes=$1 nproc=$2 config=$3
shift 3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# torchrun passes these on to the trainers, which checkpoint and exit non-zero so that the
# retry resumes; SLURM sends SIGUSR1 before the time limit (--signal in train.smk). torchrun takes
# the list from PET_SIGNALS_TO_HANDLE (its --signals-to-handle, whose default, without SIGUSR1,
# overwrites TORCHELASTIC_SIGNALS_TO_HANDLE): without it SIGUSR1 kills torchrun at once and SLURM
# then ends the trainers before their checkpoint is written (tests/distributed/test_train_faults.py).
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
export TORCHELASTIC_SIGNALS_TO_HANDLE=$PET_SIGNALS_TO_HANDLE
entry=(-m vlmcore.cli)
# Restarts of the worker group inside this job before it fails (resilience.max_restarts, passed by
# train.smk): a dead trainer or a failed collective restarts the ranks of every node (the c10d
# rendezvous brings the other nodes' groups along) and they resume from the latest checkpoint.
restarts=(--max-restarts "${VLMCORE_MAX_RESTARTS:-0}")
# The trainers' process group gets a store of its own each start (rank 0 hosts it), not the
# rendezvous store shared across restarts, whose keys of the failed start (a peer's old address)
# make the restarted ranks connect to ports nobody listens on (pytorch/pytorch#135712, #167288).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    exec torchrun --standalone --nnodes 1 --nproc-per-node "$nproc" "${restarts[@]}" "${entry[@]}" train "$config" "$@"
fi

: "${VLMCORE_CLUSTER:?set VLMCORE_CLUSTER to the name of a file in $here/env (e.g. mn5, jupiter)}"
# shellcheck source=/dev/null
source "$here/env/$VLMCORE_CLUSTER.sh"

if [[ -z "${SLURM_STEP_ID:-}" ]]; then
    exec srun --nodes="$nodes" --ntasks-per-node=1 --cpus-per-task="${VLMCORE_CPUS_PER_NODE:-$nproc}" \
        --cpu-bind=none --kill-on-bad-exit=1 bash "$0" "$nodes" "$nproc" "$config" "$@"
fi

master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
port=$((20000 + SLURM_JOB_ID % 20000))
# Node 0 hosts the rendezvous store: torchrun's own guess from hostnames fails on some
# clusters (JSC) and when several nodes share one host (CI).
exec torchrun --nnodes "$nodes" --node-rank "$SLURM_NODEID" --nproc-per-node "$nproc" \
    --rdzv-backend c10d --rdzv-endpoint "$master:$port" --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-conf "is_host=$((SLURM_NODEID == 0 ? 1 : 0))" \
    --shutdown-timeout "${VLMCORE_SHUTDOWN_TIMEOUT:-300}" "${restarts[@]}" \
    "${entry[@]}" train "$config" "$@"
