#!/bin/bash
# DeepSpeed's launcher on this machine, with Ctrl-C that saves and an exit code a requeue can trust:
#
#   launch/local_deepspeed.sh --num_gpus 2 train.py +recompute=selective train.run_name=ft   # as `deepspeed ...`
#
# Ctrl-C (SIGINT), SIGTERM and SIGUSR1 go to the ranks only: they save a checkpoint at the end of the step and
# exit 75, and this script exits 75 with them (a second Ctrl-C: the ranks quit at once, 130). Plain `deepspeed`
# cannot do this in DeepSpeed 0.19.8 (docs/preemption.md#ctrl-c): on Ctrl-C its runner dies in a KeyboardInterrupt
# traceback, and its per-node launcher (deepspeed/launcher/launch.py) SIGTERMs the ranks, SIGKILLs them 30 s
# later, and exits 1 whatever the ranks exit with.
#
# One node only: the launcher runs in a session of its own, so the terminal's Ctrl-C reaches this script alone,
# and the signal is passed to the launcher's grandchildren, the ranks. (On SLURM use launch/slurm.sbatch.)

set -uo pipefail  # not -e: the launcher's exit code is this script's

DEEPSPEED="${STAGECHECK_DEEPSPEED:-deepspeed}"
setsid "$DEEPSPEED" "$@" &
RUNNER=$!

# shellcheck disable=SC2317  # reached through the traps
to_ranks() {
  GOT_SIGNAL=1
  local launcher
  for launcher in $(pgrep -P "$RUNNER"); do  # deepspeed's runner -> deepspeed.launcher.launch -> the ranks
    pkill "-$1" -P "$launcher"
  done
}
trap 'to_ranks INT' INT
trap 'to_ranks TERM' TERM
trap 'to_ranks USR1' USR1

# `wait` returns early (status > 128) when a trap runs: wait again for the launcher's own status.
while :; do
  wait "$RUNNER"
  rc=$?
  if [[ $rc -gt 128 && -n "${GOT_SIGNAL:-}" ]]; then
    GOT_SIGNAL=
    continue
  fi
  break
done
exit "$rc"
