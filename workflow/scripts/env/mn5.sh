# MareNostrum 5 ACC nodes: 4x H100 64 GB, 2x 40-core Sapphire Rapids, 4x NDR200 InfiniBand.
# Sourced by launch_torchrun.sh inside every training step (VLMCORE_CLUSTER=mn5).
source "$(dirname "${BASH_SOURCE[0]}")/offline.sh"
export VLMCORE_CPUS_PER_NODE=80
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# NCCL finds the InfiniBand HCAs by itself; its bootstrap and gloo need the IPoIB interface.
export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
