#!/usr/bin/env bash
# scripts/local_slurm.sh start|stop|status|check [--nodes 1|2]     a SLURM cluster on this machine, for the tests and a laptop
#
# Runs Debian's munged, slurmctld and slurmd (SLURM 22.05; `apt-get install slurmctld slurmd slurm-client munge`)
# as root, with everything they write in one folder of their own: GPU_LAB_SLURM_DIR, default /tmp/gpu-lab-slurm
# (ports GPU_LAB_SLURMCTLD_PORT, GPU_LAB_SLURMD_PORT: 6817, 6818). Clients find the cluster through SLURM_CONF, so after `start`:
#   export SLURM_CONF=/tmp/gpu-lab-slurm/slurm.conf      (start prints this line; the tests set it themselves)
# No cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none) and no accounting database, so it runs in
# a container. `stop` ends the daemons it started and removes the folder. Both are idempotent.
#
# --nodes 2: two nodes on this machine. One slurmctld and munged here; two slurmd, each in a network namespace
# of its own (GPU_LAB_NETNS, default glab-n: glab-n1, glab-n2) with its own hostname (n1, n2), joined to a
# bridge (GPU_LAB_BRIDGE, default glab-br0, GPU_LAB_NET.1, default 10.88.0.1) by veth pairs (GPU_LAB_VETH,
# default glab-v: glab-v1, glab-v2 here), at GPU_LAB_NET.11 and .12, named in /etc/hosts by lines tagged
# "# gpu-lab local_slurm.sh <dir>". Its folder and ports have variables of their own, so both clusters can run at
# once: GPU_LAB_2NODES_DIR (default /tmp/gpu-lab-slurm-2nodes), GPU_LAB_2NODES_SLURMCTLD_PORT and
# GPU_LAB_2NODES_SLURMD_PORT (6827, 6828; each slurmd listens in its own namespace, so they share the port).
# Needs root, network and UTS namespaces, and a slurmd built with multiple-slurmd support (`slurmd -N`); `check`
# says in one line what this machine lacks (exit 1), or nothing. `start` on a running cluster starts a node's
# slurmd that was stopped (a lost node's return), leaving the rest, and its jobs, as they are.
set -euo pipefail

usage() { echo "usage: $0 start|stop|status|check [--nodes 1|2]" >&2; exit 2; }
ACTION="${1:-}"
NODES=1
[ $# -le 1 ] || { [ $# -eq 3 ] && [ "$2" = --nodes ] || usage; NODES="$3"; }
[[ "$NODES" =~ ^[12]$ ]] || { echo "error: --nodes $NODES: a cluster here has 1 or 2 nodes" >&2; exit 2; }

if [ "$NODES" -eq 1 ]; then
  DIR="${GPU_LAB_SLURM_DIR:-/tmp/gpu-lab-slurm}"
  CTLD_PORT="${GPU_LAB_SLURMCTLD_PORT:-6817}" SLURMD_PORT="${GPU_LAB_SLURMD_PORT:-6818}"
  NAMES=("$(hostname -s)")
else
  DIR="${GPU_LAB_2NODES_DIR:-/tmp/gpu-lab-slurm-2nodes}"
  CTLD_PORT="${GPU_LAB_2NODES_SLURMCTLD_PORT:-6827}" SLURMD_PORT="${GPU_LAB_2NODES_SLURMD_PORT:-6828}"
  NAMES=(n1 n2)
fi
CONF="$DIR/slurm.conf"
BRIDGE="${GPU_LAB_BRIDGE:-glab-br0}" NET="${GPU_LAB_NET:-10.88.0}"
NETNS="${GPU_LAB_NETNS:-glab-n}" VETH="${GPU_LAB_VETH:-glab-v}"
HOSTS_TAG="# gpu-lab local_slurm.sh $DIR"

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

# Can this machine hold two nodes? One line saying what it lacks (the multi-node tests skip with it).
need_namespaces() {
  command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null ||
    die "two nodes need ip, nsenter and unshare (apt-get install iproute2 util-linux)"
  slurmd -h 2>&1 | grep -q -- '-N node' || die "this slurmd has no multiple-slurmd support (slurmd -N), needed for two nodes"
  local probe="${NETNS}probe$$"
  ip netns add "$probe" 2>/dev/null || die "this machine cannot create network namespaces (ip netns add failed)"
  ip netns del "$probe"
  unshare --uts true 2>/dev/null || die "this machine cannot create UTS namespaces (unshare --uts failed)"
}

alive() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }
slurmd_pid() { [ "$NODES" -eq 1 ] && echo slurmd || echo "slurmd-$1"; }

all_alive() {
  alive slurmctld && alive munged || return 1
  for name in "${NAMES[@]}"; do alive "$(slurmd_pid "$name")" || return 1; done
}

write_conf() {
  # The node as slurmd sees it (CPUs, sockets, memory), so that slurmd does not drain it for a mismatch. Two
  # nodes share the machine's cores: each declares what `slurmd -C` reports, no more.
  local node nodes=() i=0
  node="$(slurmd -C | head -n1)"
  if [ "$NODES" -eq 1 ]; then
    nodes=("$node")
    local ctld_host="${NAMES[0]}" spool="$DIR/spool" slurmd_files="$DIR/slurmd"
  else
    for name in "${NAMES[@]}"; do
      i=$((i + 1))
      nodes+=("$(sed "s/^NodeName=[^ ]*/NodeName=$name NodeHostname=$name NodeAddr=$NET.1$i/" <<<"$node")")
    done
    # The nodes reach the controller at the bridge's address, not at this machine's 127.0.0.1.
    local ctld_host="$(hostname -s)($NET.1)" spool="$DIR/spool-%n" slurmd_files="$DIR/slurmd-%n"
  fi
  cat >"$CONF" <<CONF
# Written by scripts/local_slurm.sh: a $NODES-node cluster, everything under $DIR.
ClusterName=gpu-lab
SlurmctldHost=$ctld_host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$slurmd_files.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$slurmd_files.log
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# Ended jobs leave squeue after 30 s; a job gets 10 s between SIGTERM and SIGKILL. A node silent for 20 s is
# DOWN (its jobs requeued or ended), so a lost node shows within a test's time.
MinJobAge=30
KillWait=10
SlurmdTimeout=20
$(printf '%s State=UNKNOWN\n' "${nodes[@]}")
PartitionName=debug Nodes=$(IFS=,; echo "${NAMES[*]}") Default=YES MaxTime=INFINITE State=UP
CONF
}

# The two nodes' network: a bridge here, a namespace per node with a veth into the bridge, names in /etc/hosts.
make_network() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local i=0 lines=""
  for name in "${NAMES[@]}"; do
    i=$((i + 1))
    ip netns list | grep -qw "$NETNS$i" || ip netns add "$NETNS$i"
    ip link show "$VETH$i" >/dev/null 2>&1 || ip link add "$VETH$i" type veth peer name eth0 netns "$NETNS$i"
    ip link set "$VETH$i" master "$BRIDGE" up
    ip -n "$NETNS$i" link set lo up
    ip -n "$NETNS$i" addr replace "$NET.1$i/24" dev eth0
    ip -n "$NETNS$i" link set eth0 up
    lines+="$NET.1$i $name $HOSTS_TAG"$'\n'
  done
  remove_hosts_lines
  printf '%s' "$lines" >>/etc/hosts
}

# In place (cat >), not by rename: /etc/hosts is often a bind mount in a container.
remove_hosts_lines() {
  local kept
  kept="$(grep -vF "$HOSTS_TAG" /etc/hosts || true)"
  printf '%s\n' "$kept" >/etc/hosts
}

remove_network() {
  local i=0
  for _ in "${NAMES[@]}"; do
    i=$((i + 1))
    if ip netns list 2>/dev/null | grep -qw "$NETNS$i"; then
      # Whatever the node still runs (a job step that outlived its slurmd) ends with it.
      for pid in $(ip netns pids "$NETNS$i"); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "$NETNS$i"  # takes the veth pair with it
    fi
    ip link del "$VETH$i" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  [ -w /etc/hosts ] && remove_hosts_lines
}

start_slurmd() {
  local name="$1" i="$2"
  if [ "$NODES" -eq 1 ]; then
    slurmd -f "$CONF"
  else
    # nsenter, not `ip netns exec`, which remounts /sys and hides the cgroup tree; unshare --uts: its own hostname.
    nsenter --net="/run/netns/$NETNS$i" -- unshare --uts -- \
      sh -c "hostname $name && exec slurmd -N $name -f $CONF"
  fi
}

start() {
  need_packages
  [ "$NODES" -eq 1 ] || need_namespaces
  if all_alive; then
    echo "the local cluster is already running; export SLURM_CONF=$CONF"
    return
  fi
  if [ "$NODES" -eq 2 ] && alive slurmctld && alive munged; then
    export SLURM_CONF="$CONF"
    start_lost_nodes
    return
  fi
  stop_daemons
  mkdir -p "$DIR/state" "$DIR/munge"
  chmod 700 "$DIR/munge"
  [ -f "$DIR/munge/munge.key" ] || mungekey --create --keyfile="$DIR/munge/munge.key" >/dev/null
  write_conf
  [ "$NODES" -eq 1 ] || make_network
  # --force: munged refuses to run as root or with a socket outside /run/munge without it.
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge.socket" --pid-file="$DIR/munged.pid" \
    --log-file="$DIR/munged.log" --seed-file="$DIR/munge/munge.seed"
  export SLURM_CONF="$CONF"
  slurmctld -f "$CONF"
  local i=0
  for name in "${NAMES[@]}"; do
    i=$((i + 1))
    if [ "$NODES" -eq 1 ]; then mkdir -p "$DIR/spool"; else mkdir -p "$DIR/spool-$name"; fi
    start_slurmd "$name" "$i"
  done
  wait_until_up
}

start_lost_nodes() {
  local i=0
  for name in "${NAMES[@]}"; do
    i=$((i + 1))
    alive "$(slurmd_pid "$name")" || start_slurmd "$name" "$i"
  done
  wait_until_up
}

wait_until_up() {
  # Ready when every node accepts jobs (idle, or running one); bounded, with the daemons' logs when it does not.
  for _ in $(seq 60); do
    if [ "$(sinfo -h -N -o %t 2>/dev/null | grep -cE '^(idle|mix|alloc)$')" -eq "$NODES" ]; then
      echo "the local cluster is up (nodes $(IFS=,; echo "${NAMES[*]}"), $(sinfo -h -N -o %c | head -n1) CPUs" \
        "each); export SLURM_CONF=$CONF"
      return
    fi
    sleep 0.5
  done
  tail -n 20 "$DIR"/*.log >&2 || true
  die "the local cluster did not come up in 30 s (logs above, in $DIR)"
}

stop_daemons() {
  local daemons=()
  for name in "${NAMES[@]}"; do daemons+=("$(slurmd_pid "$name")"); done
  for daemon in "${daemons[@]}" slurmctld munged; do
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
  [ "$NODES" -eq 1 ] || [ "$(id -u)" -ne 0 ] || remove_network
  rm -rf "$DIR"
  echo "the local cluster is stopped"
}

status() {
  if all_alive; then
    SLURM_CONF="$CONF" sinfo -N
    SLURM_CONF="$CONF" squeue
  else
    echo "the local cluster is not running (start it with: scripts/local_slurm.sh start --nodes $NODES)"
    return 3
  fi
}

case "$ACTION" in
  check) need_packages && { [ "$NODES" -eq 1 ] || need_namespaces; } ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) usage ;;
esac
