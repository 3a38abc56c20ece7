#!/usr/bin/env bash
# A throwaway Slurm cluster on this machine, for trying the sbatch scripts and for CI:
#   slurm/local_cluster.sh start DIR [NODES]   -> prints `export SLURM_CONF=DIR/slurm.conf`
#   slurm/local_cluster.sh stop DIR
# NODES emulated nodes (default 2) share this host, each with its own slurmd and port; no
# systemd, no munge (auth/none), all state under DIR. Installs Debian's Slurm if missing.
set -euo pipefail
cmd=${1:?usage: local_cluster.sh start|stop DIR [NODES]}
dir=$(mkdir -p "${2:?missing DIR}" && cd "$2" && pwd)
nodes=${3:-2}

stop() {
  for pid in "$dir"/*.pid; do
    [ -e "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  sleep 1
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "usage: local_cluster.sh start|stop DIR [NODES]" >&2; exit 2; }

if ! command -v slurmctld >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client >/dev/null
fi
host=$(hostname)
# Every emulated node name must resolve; they all live on this host.
for i in $(seq 1 "$nodes"); do
  grep -qE "[[:space:]]n$i([[:space:]]|\$)" /etc/hosts || echo "127.0.0.1 n$i" >> /etc/hosts
done
base=$((20000 + RANDOM % 20000))
mkdir -p "$dir/state" "$dir/spool"
cat > "$dir/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$base
SlurmUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobRequeue=1
ReturnToService=2
SchedulerParameters=sched_interval=2
MessageTimeout=30
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
CONF
for i in $(seq 1 "$nodes"); do
  echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((base + i)) CPUs=2 State=UNKNOWN" >> "$dir/slurm.conf"
done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE" >> "$dir/slurm.conf"

export SLURM_CONF=$dir/slurm.conf
stop
slurmctld -c -i
for i in $(seq 1 "$nodes"); do slurmd -N "n$i"; done
for _ in $(seq 1 60); do
  idle=$(sinfo -h -o '%t %D' 2>/dev/null | awk '$1 ~ /idle/ {n += $2} END {print n + 0}')
  [ "$idle" -ge "$nodes" ] && { echo "export SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.5
done
echo "local Slurm cluster did not come up; logs in $dir" >&2
exit 1
