#!/usr/bin/env bash
# A throwaway two-node Slurm cluster on this one machine, for tests.
#
#   launch/local_slurm.sh up      install (if needed) and start munged, slurmctld, slurmd n1/n2
#   launch/local_slurm.sh down    stop every daemon this script started
#   launch/local_slurm.sh status  exit 0 only if all daemons are alive and the nodes answer
#
# State (slurm.conf, pid files, logs, spool) lives in $STAGECHECK_SLURM_DIR
# (default /tmp/stagecheck-slurm). Clients find the cluster through
# SLURM_CONF=$STAGECHECK_SLURM_DIR/slurm.conf; /etc/slurm/slurm.conf is also made a
# symlink to it (unless a real file is already there) so that tools which drop the
# environment, e.g. `sbatch --export=NONE` or submitit, still reach it.
#
# Exit codes: 0 ok, 77 cannot run here (not root, or packages cannot be installed),
# anything else is a real failure.
set -euo pipefail

STATE_DIR="${STAGECHECK_SLURM_DIR:-/tmp/stagecheck-slurm}"
CONF="$STATE_DIR/slurm.conf"
RUN_DIR="$STATE_DIR/run"
LOG_DIR="$STATE_DIR/log"
NODES=(n1 n2)
declare -A NODE_PORT=([n1]=17001 [n2]=17002)
UP_TIMEOUT_S="${STAGECHECK_SLURM_UP_TIMEOUT:-60}"
EXIT_SKIP=77

export SLURM_CONF="$CONF"

log() { echo "local_slurm: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
skip() { log "SKIP: $*"; exit "$EXIT_SKIP"; }

# PID 1 on these VMs does not always reap orphaned daemons, so a dead daemon can
# linger as a zombie that `kill -0` still reports as alive. Read the state
# instead, and check the name so a recycled pid is not mistaken for ours.
pid_alive() {
  local pid="$1" name="$2" state comm
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [[ -r "/proc/$pid/status" ]] || return 1
  state=$(awk '/^State:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [[ -n "$state" && "$state" != Z && "$state" != X && "$comm" == "$name" ]]
}

# pid file name -> process name (comm) of the daemon it records.
daemon_name() {
  case "$1" in
    munged) echo munged ;;
    slurmctld) echo slurmctld ;;
    slurmd-*) echo slurmd ;;
  esac
}

# True if the daemon recorded in $RUN_DIR/<id>.pid is running.
daemon_alive() {
  local id="$1" pidfile="$RUN_DIR/$1.pid"
  [[ -s "$pidfile" ]] && pid_alive "$(<"$pidfile")" "$(daemon_name "$id")"
}

# Daemonised Slurm/munge processes write their pid file a moment after the
# parent returns, so poll for it.
wait_for_pidfile() {
  local pidfile="$1" name="$2" i
  for ((i = 0; i < 100; i++)); do
    if [[ -s "$pidfile" ]] && pid_alive "$(<"$pidfile")" "$name"; then
      return 0
    fi
    sleep 0.1
  done
  return 1
}

log_tails() {
  local f
  for f in "$LOG_DIR"/slurm*.log; do
    [[ -e "$f" ]] || continue
    echo "----- tail of $f -----" >&2
    tail -n 25 "$f" >&2 || true
  done
}

# Each node prints "<name> <state>"; states carry suffixes such as `*` (not
# responding) or `~`, so compare exact words.
nodes_in_state() {
  local want="$1" out
  out=$(timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
  local node
  for node in "${NODES[@]}"; do
    grep -Eq "^$node ($want)\$" <<<"$out" || return 1
  done
}

# munged counts as up if ours is alive, or if one we did not start answers.
munge_up() {
  daemon_alive munged || { [[ ! -s "$RUN_DIR/munged.pid" ]] && munge_works; }
}

all_alive() {
  local id
  munge_up || return 1
  for id in slurmctld "${NODES[@]/#/slurmd-}"; do
    daemon_alive "$id" || return 1
  done
}

healthy() {
  all_alive && nodes_in_state 'idle|mix|alloc|comp'
}

munge_works() {
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1
}

ensure_packages() {
  local missing=() bin
  for bin in slurmctld slurmd sbatch munged; do
    command -v "$bin" >/dev/null 2>&1 || [[ -x "/usr/sbin/$bin" ]] || missing+=("$bin")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  log "installing slurm and munge (missing: ${missing[*]})"
  local pkgs=(slurmctld slurmd slurm-client munge) apt_log="$LOG_DIR/apt.log"
  # Wait for a concurrent apt/dpkg instead of failing on its lock.
  local install=(apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=120 "${pkgs[@]}")
  export DEBIAN_FRONTEND=noninteractive
  : >"$apt_log"
  # The package lists are usually present; an update costs time and network,
  # so only pay for it when the plain install fails.
  "${install[@]}" >>"$apt_log" 2>&1 && return 0
  if ! { apt-get update && "${install[@]}"; } >>"$apt_log" 2>&1; then
    tail -n 20 "$apt_log" >&2
    skip "apt-get could not install ${pkgs[*]} (log: $apt_log)"
  fi
}

ensure_munge_key() {
  [[ -s /etc/munge/munge.key ]] && return 0
  log "creating /etc/munge/munge.key"
  install -d -o munge -g munge -m 0700 /etc/munge
  mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
}

start_munged() {
  daemon_alive munged && return 0
  rm -f "$RUN_DIR/munged.pid"
  # A munged we did not start (e.g. a system service) is fine to share, but it
  # is not ours to stop, so record no pid for it.
  if munge_works; then
    log "using an already running munged"
    return 0
  fi
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged 9>&-
  wait_for_pidfile /run/munge/munged.pid munged || die "munged did not start"
  cp /run/munge/munged.pid "$RUN_DIR/munged.pid"
}

write_conf() {
  local cpus mem_mb node
  cpus=$(nproc)
  # Both virtual nodes share the machine; give each half the memory so the
  # totals stay honest. Memory is not a consumable resource (CR_Core) anyway.
  mem_mb=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 / 2))
  mkdir -p "$STATE_DIR/state" "$STATE_DIR/spool" "$RUN_DIR" "$LOG_DIR"
  {
    # Unquoted heredoc for $STATE_DIR etc.: keep backticks out of it, they would run.
    cat <<EOF
# Written by launch/local_slurm.sh; rewritten on every cold start.
ClusterName=stagecheck
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire (default 120 s) before it may start again; releasing it earlier
# (scontrol update StartTime=now) fails it with "Job credential revoked". 30 s keeps requeue tests short.
AuthInfo=cred_expire=30
CredType=cred/munge
MpiDefault=none
# No cgroups in this VM: track processes via /proc and do no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd, so plain sacct is disabled; finished jobs (purged from the
# controller after MinJobAge) stay readable with "sacct -c" from this file.
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.txt
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# sbatch --wait polls every 2 s only while 2 < MinJobAge/2; with the default
# (300) it backs off 2, 8, 32 s and a short job costs up to half a minute.
MinJobAge=4
ReturnToService=2
InactiveLimit=0
KillWait=5
SlurmctldTimeout=30
SlurmdTimeout=30
StateSaveLocation=$STATE_DIR/state
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
# %n is the node name given to slurmd -N, so the two slurmds stay apart.
SlurmdSpoolDir=$STATE_DIR/spool/%n
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
EOF
    for node in "${NODES[@]}"; do
      echo "NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$node Port=${NODE_PORT[$node]} CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"
    done
    # FORCE:4 lets up to four jobs share a core, so a 2-core box can run a
    # multi-node job next to small ones instead of queueing them.
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE OverSubscribe=FORCE:4 State=UP"
  } >"$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
  # A cold start numbers jobs from 1 again; old records would shadow new ones.
  : >"$LOG_DIR/jobcomp.txt"

  # Leave an admin's real slurm.conf alone; SLURM_CONF still works then.
  mkdir -p /etc/slurm
  if [[ -L /etc/slurm/slurm.conf || ! -e /etc/slurm/slurm.conf ]]; then
    ln -sfn "$CONF" /etc/slurm/slurm.conf
  else
    log "/etc/slurm/slurm.conf is a real file; callers must set SLURM_CONF=$CONF"
  fi
}

ensure_hosts() {
  local node
  for node in "${NODES[@]}"; do
    grep -Eq "^[^#]*[[:space:]]$node([[:space:]]|\$)" /etc/hosts ||
      echo "127.0.0.1 $node" >>/etc/hosts
  done
}

start_slurm() {
  local node
  # -c: cold start, forget jobs and node states from an earlier run.
  slurmctld -c -f "$CONF" 9>&-
  wait_for_pidfile "$RUN_DIR/slurmctld.pid" slurmctld || { log_tails; die "slurmctld did not start"; }
  for node in "${NODES[@]}"; do
    mkdir -p "$STATE_DIR/spool/$node"
    slurmd -N "$node" -f "$CONF" 9>&-
    wait_for_pidfile "$RUN_DIR/slurmd-$node.pid" slurmd || { log_tails; die "slurmd $node did not start"; }
  done
}

wait_idle() {
  local deadline=$((SECONDS + UP_TIMEOUT_S))
  until nodes_in_state 'idle|mix|alloc'; do
    if ((SECONDS >= deadline)); then
      timeout 10 sinfo -N -l >&2 || true
      log_tails
      die "nodes ${NODES[*]} not idle after ${UP_TIMEOUT_S}s (logs above, state in $STATE_DIR)"
    fi
    sleep 0.5
  done
}

start_cluster() {
  ensure_packages
  ensure_munge_key
  ensure_hosts
  start_munged
  # An unhealthy cluster (half started, a node down) gets a cold restart
  # rather than repairs: simpler, and tests must not inherit old jobs anyway.
  stop_slurm
  write_conf
  start_slurm
  wait_idle
  log "up: ${NODES[*]} idle (SLURM_CONF=$CONF)"
}

# stdout carries exactly one word, "already-up" or "started", so a caller
# knows whether the cluster is its to stop; everything else goes to stderr.
cmd_up() {
  if healthy; then
    log "already up (SLURM_CONF=$CONF)"
    echo already-up
  else
    start_cluster >&2
    echo started
  fi
}

# Stop one daemon by its pid file: TERM, wait, then KILL.
stop_daemon() {
  local id="$1" pidfile="$RUN_DIR/$1.pid" name pid i
  [[ -s "$pidfile" ]] || { rm -f "$pidfile"; return 0; }
  name=$(daemon_name "$id")
  pid=$(<"$pidfile")
  if pid_alive "$pid" "$name"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
      pid_alive "$pid" "$name" || break
      sleep 0.1
    done
    if pid_alive "$pid" "$name"; then
      log "$id (pid $pid) ignored SIGTERM; killing"
      kill -KILL "$pid" 2>/dev/null || true
      sleep 0.2
    fi
  fi
  rm -f "$pidfile"
}

stop_slurm() {
  local node jobs
  # Running jobs' slurmstepd processes outlive slurmd; cancel them while the
  # controller can still do it.
  if daemon_alive slurmctld; then
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [[ -n "$jobs" ]]; then
      # shellcheck disable=SC2086
      timeout 10 scancel $jobs 2>/dev/null || true
      sleep 1
    fi
  fi
  for node in "${NODES[@]}"; do
    stop_daemon "slurmd-$node"
  done
  stop_daemon slurmctld
}

cmd_down() {
  stop_slurm
  stop_daemon munged
  log "down"
}

cmd_status() {
  local id rc=0
  for id in munged slurmctld "${NODES[@]/#/slurmd-}"; do
    if daemon_alive "$id"; then
      echo "$id: running (pid $(<"$RUN_DIR/$id.pid"))"
    elif [[ $id == munged ]] && munge_up; then
      echo "munged: running (not started by this script)"
    else
      echo "$id: not running"
      rc=1
    fi
  done
  timeout 10 sinfo -N -o '%N %t' 2>/dev/null || { echo "sinfo: no answer"; rc=1; }
  return "$rc"
}

main() {
  local cmd="${1:-}"
  case "$cmd" in
    up | down | status) ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
  esac
  [[ $EUID -eq 0 ]] || skip "must run as root (installs packages, runs daemons as root)"
  mkdir -p "$RUN_DIR" "$LOG_DIR"
  # status only reads, so it answers even while an up/down is in progress.
  if [[ $cmd != status ]]; then
    # Serialise up/down callers (e.g. several pytest sessions) on the state dir.
    # Daemons are started with `9>&-`: they keep inherited fds, and a daemon
    # holding this lock would block every later call forever.
    exec 9>"$STATE_DIR/.lock"
    flock -w 300 9 || die "another local_slurm.sh holds $STATE_DIR/.lock for >300s"
  fi
  "cmd_$cmd"
}

main "$@"
