# JUPITER Booster nodes: 4x GH200 (72-core Grace + H100 96 GB each), 4x NDR200 InfiniBand, aarch64.
# Sourced by launch_torchrun.sh inside every training step (VLMCORE_CLUSTER=jupiter).
source "$(dirname "${BASH_SOURCE[0]}")/offline.sh"
export VLMCORE_CPUS_PER_NODE=288
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}
export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# One Grace superchip per GPU: bind each rank's CPUs and host memory to the NUMA node of its
# GPU (NUMA nodes 0-3 are the four Graces, in GPU order).
entry=(--no-python bash -c 'exec numactl --cpunodebind="$LOCAL_RANK" --membind="$LOCAL_RANK" python "$@"' numa_bind -m vlmcore.cli)
