#!/usr/bin/env bash
# Start `vlmcore train CONFIG` on NODES x NPROC_PER_NODE processes.
#   launch_torchrun.sh NODES NPROC_PER_NODE CONFIG [extra vlmcore train args]
# One node: torchrun --standalone. Several nodes (SLURM): run once per node under srun; the
# rendezvous host and node rank are derived inside the step, where SLURM sets them.
set -euo pipefail
nodes=$1 nproc=$2 config=$3
shift 3

if [[ "$nodes" -eq 1 ]]; then
    exec torchrun --standalone --nnodes 1 --nproc-per-node "$nproc" -m vlmcore.cli train "$config" "$@"
fi

if [[ -z "${SLURM_STEP_ID:-}" ]]; then
    # In the batch step: start one task per node, each re-entering this script.
    exec srun --nodes "$nodes" --ntasks-per-node 1 --cpus-per-task "${VLMCORE_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}" \
        --kill-on-bad-exit=1 bash "$0" "$nodes" "$nproc" "$config" "$@"
fi

master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((20000 + SLURM_JOB_ID % 20000))
exec torchrun --nnodes "$nodes" --node-rank "$SLURM_NODEID" --nproc-per-node "$nproc" \
    --rdzv-backend c10d --rdzv-endpoint "$master:$port" --rdzv-id "$SLURM_JOB_ID" \
    -m vlmcore.cli train "$config" "$@"
