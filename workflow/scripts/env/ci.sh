# The two-node SLURM of .ci/slurm_setup.sh: both nodes are this machine, training runs on gloo.
source "$(dirname "${BASH_SOURCE[0]}")/offline.sh"
export OMP_NUM_THREADS=1
