#!/usr/bin/env bash
# A SLURM "cluster" on this machine: munged, slurmctld and two slurmd (memfit-n1, memfit-n2) on
# localhost (Debian's slurmd has -N: it is built with multiple-slurmd support).
#   tests/slurm/cluster.sh start DIR   # writes DIR/slurm.conf, starts the daemons, waits for idle nodes
#   tests/slurm/cluster.sh stop DIR    # stops what `start` started (by the pids it recorded)
# The config is also installed as /etc/slurm/slurm.conf (refused if another one is there):
# snakemake-executor-plugin-slurm's jobstep drops SLURM_CONF (every SLURM_* variable but the
# job's identity) before its inner `srun`, which then only finds the default path. Needs root
# and Debian's slurm-wlm + munge (22.05 on bookworm): `apt-get install -y slurm-wlm munge`.
# No cgroups (containers rarely allow them): proctrack/linuxproc tracks a step's processes by
# parent pid, task/none binds nothing; accounting off, so job status comes from squeue
# (MinJobAge keeps finished jobs visible to it).
set -euo pipefail
cmd=${1:?usage: cluster.sh start|stop DIR}
dir=$(realpath -m "${2:?usage: cluster.sh start|stop DIR}")
CPUS=${MEMFIT_SLURM_CPUS:-8}        # CPUs each node claims (SlurmdParameters=config_overrides)
MEM_MB=${MEMFIT_SLURM_MEM_MB:-16000}
PORT=${MEMFIT_SLURM_PORT:-16817}    # slurmctld; the slurmd listen on PORT+1, PORT+2
N1=memfit-n1 N2=memfit-n2           # jobs see these names in SLURM_JOB_NODELIST: make them resolve

MARK="# written by memfit tests/slurm/cluster.sh"
SYSCONF=/etc/slurm/slurm.conf

stop() {
  if [[ -f $SYSCONF ]] && head -1 "$SYSCONF" | grep -qF "$MARK"; then rm -f "$SYSCONF"; fi
  for f in "$dir/slurmd.$N1.pid" "$dir/slurmd.$N2.pid" "$dir"/slurmctld.pid "$dir"/munged.pid; do
    [[ -f $f ]] || continue
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    rm -f "$f"
  done
}

if [[ $cmd == stop ]]; then stop; exit 0; fi
[[ $cmd == start ]] || { echo "usage: cluster.sh start|stop DIR" >&2; exit 2; }

for tool in slurmctld slurmd munged sbatch; do
  command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install -y slurm-wlm munge" >&2; exit 1; }
done
rm -rf "$dir"/state "$dir"/spool
mkdir -p "$dir"/state "$dir/spool/$N1" "$dir/spool/$N2" "$dir"/munge
host=$(hostname -s)
if [[ -f $SYSCONF ]] && ! head -1 "$SYSCONF" | grep -qF "$MARK"; then
  echo "$SYSCONF exists and is not ours: not starting a test cluster over it" >&2
  exit 1
fi
cat >"$dir/slurm.conf" <<CONF
$MARK
ClusterName=memfit-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
# finished jobs stay in squeue for 10 min: the executor plugin's squeue status needs them
MinJobAge=600
KillWait=30
SlurmdParameters=config_overrides
NodeName=$N1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
NodeName=$N2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=$N1,$N2 Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$dir/slurm.conf

# munge: the system key (created by the package), our own socket so nothing else is touched
munged --socket="$dir/munge/munge.socket.2" --pid-file="$dir/munged.pid" \
  --log-file="$dir/munged.log" --seed-file="$dir/munge/seed" -f 2>/dev/null ||
  munged --socket="$dir/munge/munge.socket.2" -f
# the SLURM daemons and clients find munge at its default socket unless told; point them at ours
cat >>"$dir/slurm.conf" <<CONF
AuthInfo=socket=$dir/munge/munge.socket.2
CONF
mkdir -p /etc/slurm
cp "$dir/slurm.conf" "$SYSCONF"
slurmctld -f "$dir/slurm.conf" -i
slurmd -f "$dir/slurm.conf" -N $N1
slurmd -f "$dir/slurm.conf" -N $N2
for _ in $(seq 60); do
  if [[ $(sinfo -h -N -o '%T' 2>/dev/null | grep -c idle) == 2 ]]; then
    sinfo -N
    exit 0
  fi
  sleep 1
done
echo "nodes did not come up; see $dir/*.log" >&2
sinfo -N >&2 || true
exit 1
