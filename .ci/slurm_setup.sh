#!/usr/bin/env bash
# A two-node SLURM on this one machine for the SLURM tests (tests/slurm/test_slurm_{real,demo}.py).
# Both nodes (vlmci1, vlmci2) are slurmd daemons on localhost, so a 2-node job runs the real
# multi-node path: `srun` one task per node + torchrun rendezvous. Idempotent; needs root.
#   .ci/slurm_setup.sh          install (apt-get), configure, start, wait until idle
#   .ci/slurm_setup.sh stop     stop the daemons this script started
set -euo pipefail

conf_dir=/etc/slurm
state=/var/lib/vlmcore-slurm
nodes=(vlmci1 vlmci2)

stop() {
    for pidfile in "$state"/*.pid; do
        [[ -f "$pidfile" ]] || continue
        kill "$(cat "$pidfile")" 2>/dev/null || true
        rm -f "$pidfile"
    done
}

if [[ "${1:-}" == stop ]]; then
    stop
    exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurm-wlm munge >/dev/null
fi

mkdir -p "$conf_dir" "$state"/{ctld,log} /run/munge
for node in "${nodes[@]}"; do
    mkdir -p "$state/$node"
    grep -qw "$node" /etc/hosts || echo "127.0.0.1 $node" >>/etc/hosts
done

if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key /run/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key

host=$(hostname -s)
cpus=$(nproc)
# Each node may use all cores and a third of the memory: the jobs are small.
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 3 ))
cat >"$conf_dir/slurm.conf" <<CONF
ClusterName=vlmci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd-%n.log
SlurmctldPort=6817
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=10
MinJobAge=3600
SchedulerType=sched/backfill
NodeName=vlmci1 NodeAddr=127.0.0.1 NodeHostname=$host Port=17001 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
NodeName=vlmci2 NodeAddr=127.0.0.1 NodeHostname=$host Port=17002 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=vlmci1,vlmci2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

running() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

if ! pgrep -x munged >/dev/null; then
    munged --force
    pgrep -x munged -n >"$state/munged.pid"
fi
# A controller this call starts begins with no jobs (-c): the saved state of an earlier machine
# (a snapshot, a killed run) would otherwise bring back jobs whose processes are gone, holding
# both nodes "allocated" for ever (a CI run failed on exactly that).
running "$state/slurmctld.pid" || slurmctld -c
for node in "${nodes[@]}"; do
    running "$state/slurmd-$node.pid" || slurmd -N "$node"
done
# Daemons of an earlier call read the configuration written above.
scontrol reconfigure 2>/dev/null || true

# Up: both nodes idle, or busy with jobs of an earlier call of this same controller (whose
# processes run: `squeue` lists them).
for _ in $(seq 60); do
    states=$(sinfo -h -N -o '%t' 2>/dev/null || true)
    if [[ $(wc -l <<<"$states") -eq 2 ]] && ! grep -qvE '^(idle|mix|alloc)$' <<<"$states"; then
        squeue
        sinfo
        exit 0
    fi
    scontrol update nodename=vlmci[1-2] state=resume 2>/dev/null || true
    sleep 1
done
echo "slurm_setup: nodes did not become idle; see $state/log" >&2
sinfo >&2 || true
exit 1
