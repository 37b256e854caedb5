#!/usr/bin/env bash
# scripts/local_slurm.sh start|stop|status     a one-node SLURM cluster on this machine, for the tests and a laptop
#
# Runs Debian's munged, slurmctld and slurmd (SLURM 22.05; `apt-get install slurmctld slurmd slurm-client munge`)
# as root, with everything they write in one folder of their own: GPU_LAB_SLURM_DIR, default /tmp/gpu-lab-slurm.
# Nothing under /etc is touched; clients find the cluster through SLURM_CONF, so after `start`:
#   export SLURM_CONF=/tmp/gpu-lab-slurm/slurm.conf      (start prints this line; the tests set it themselves)
# No cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none) and no accounting database, so it runs in
# a container. `stop` ends the daemons it started and removes the folder. Both are idempotent.
set -euo pipefail

DIR="${GPU_LAB_SLURM_DIR:-/tmp/gpu-lab-slurm}"
CONF="$DIR/slurm.conf"
NODE="$(hostname -s)"

die() { echo "error: $*" >&2; exit 1; }

need_packages() {
  local missing=()
  for tool in munged mungekey slurmctld slurmd sinfo scontrol sbatch srun; do
    command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || missing+=("$tool")
  done
  [ ${#missing[@]} -eq 0 ] || die "SLURM is not installed (missing: ${missing[*]}); install it with:" \
    "apt-get install slurmctld slurmd slurm-client munge"
  [ "$(id -u)" -eq 0 ] || die "the local cluster runs its daemons as root; run it as root (or with sudo)"
  export PATH="$PATH:/usr/sbin"
}

alive() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

write_conf() {
  # The node as slurmd sees it (CPUs, sockets, memory), so that slurmd does not drain it for a mismatch.
  local node
  node="$(slurmd -C | head -n1)"
  cat >"$CONF" <<EOF
# Written by scripts/local_slurm.sh: a one-node cluster, everything under $DIR.
ClusterName=gpu-lab
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldPort=${GPU_LAB_SLURMCTLD_PORT:-6817}
SlurmdPort=${GPU_LAB_SLURMD_PORT:-6818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# Ended jobs leave squeue after 30 s; a job gets 10 s between SIGTERM and SIGKILL.
MinJobAge=30
KillWait=10
$node State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  need_packages
  if alive slurmctld && alive slurmd && alive munged; then
    echo "the local cluster is already running; export SLURM_CONF=$CONF"
    return
  fi
  stop_daemons
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge"
  chmod 700 "$DIR/munge"
  [ -f "$DIR/munge/munge.key" ] || mungekey --create --keyfile="$DIR/munge/munge.key" >/dev/null
  write_conf
  # --force: munged refuses to run as root or with a socket outside /run/munge without it.
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge.socket" --pid-file="$DIR/munged.pid" \
    --log-file="$DIR/munged.log" --seed-file="$DIR/munge/munge.seed"
  export SLURM_CONF="$CONF"
  slurmctld -f "$CONF"
  slurmd -f "$CONF"
  # Ready when the node accepts jobs (idle); bounded, with the daemons' logs when it does not come up.
  for _ in $(seq 60); do
    if sinfo -h -n "$NODE" -o %t 2>/dev/null | grep -qx idle; then
      echo "the local cluster is up (node $NODE, $(sinfo -h -o %c) CPUs); export SLURM_CONF=$CONF"
      return
    fi
    sleep 0.5
  done
  tail -n 20 "$DIR"/slurmctld.log "$DIR"/slurmd.log >&2 || true
  die "the local cluster did not come up in 30 s (logs above, in $DIR)"
}

stop_daemons() {
  for daemon in slurmd slurmctld munged; do
    if alive "$daemon"; then
      local pid
      pid="$(cat "$DIR/$daemon.pid")"
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$DIR/$daemon.pid"
  done
}

stop() {
  # Jobs first, so that no job step outlives the daemons that track it.
  if alive slurmctld; then
    SLURM_CONF="$CONF" scancel --full --quiet --user=root 2>/dev/null || true
    sleep 1
  fi
  stop_daemons
  rm -rf "$DIR"
  echo "the local cluster is stopped"
}

status() {
  if alive slurmctld && alive slurmd && alive munged; then
    SLURM_CONF="$CONF" sinfo
    SLURM_CONF="$CONF" squeue
  else
    echo "the local cluster is not running (start it with: scripts/local_slurm.sh start)"
    return 3
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
