#!/usr/bin/env bash
# Run N training processes on this machine, each with DEVICES_PER_PROCESS emulated CPU devices,
# joined by jax.distributed over 127.0.0.1 (gloo collectives): a multi-host run without a cluster.
#
#   launch/local_multiprocess.sh N [python -m boost_jax.train args...]
#   DEVICES_PER_PROCESS=4 launch/local_multiprocess.sh 2 --config.parallel.data=2 --config.parallel.tensor=4
#
# Env: DEVICES_PER_PROCESS (4), PYTHON (python), BOOST_PORT (a free port), KILL_GRACE_S (30), RUN_LOG_DIR
# (if set, process I writes RUN_LOG_DIR/process_I.log and its pid to process_I.pid instead of sharing
# this terminal).
# Exits non-zero if any process fails. A failure stops the others: SIGTERM, then SIGKILL after
# KILL_GRACE_S, because a process stuck in a collective with a dead peer never gets to act on SIGTERM.
# SIGTERM/SIGINT to this script are forwarded the same way (the trainer saves on SIGTERM; see
# launch/README.md for why a multi-process save on SIGTERM is not yet reliable, hence the SIGKILL).
set -uo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N [python -m boost_jax.train args...]   (N = number of processes, >= 1)" >&2
  exit 2
fi
N=$1
shift
DEVICES_PER_PROCESS=${DEVICES_PER_PROCESS:-4}
PYTHON=${PYTHON:-python}
KILL_GRACE_S=${KILL_GRACE_S:-30}
# Port 0 lets the OS pick a free port for the coordinator (process 0 binds it a moment later).
PORT=${BOOST_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# Replace (not append to) any device count already in XLA_FLAGS, e.g. one inherited from a test run.
XLA_FLAGS=$(sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g' <<<"${XLA_FLAGS:-}")
export XLA_FLAGS="${XLA_FLAGS} --xla_force_host_platform_device_count=${DEVICES_PER_PROCESS}"
export BOOST_COORDINATOR="127.0.0.1:${PORT}" BOOST_NUM_PROCESSES="$N"

pids=()
watchdog=""
signal_all() { for pid in "${pids[@]}"; do kill "-$1" "$pid" 2>/dev/null; done; }
stop_all() {  # SIGTERM now, SIGKILL whatever is left after KILL_GRACE_S
  signal_all TERM
  if [[ -z "$watchdog" ]]; then
    (sleep "$KILL_GRACE_S"; signal_all KILL) &
    watchdog=$!
  fi
}
trap stop_all INT TERM

for ((i = 0; i < N; i++)); do
  if [[ -n "${RUN_LOG_DIR:-}" ]]; then
    mkdir -p "$RUN_LOG_DIR"
    BOOST_PROCESS_ID=$i "$PYTHON" -m boost_jax.train "$@" >"$RUN_LOG_DIR/process_$i.log" 2>&1 &
    echo $! >"$RUN_LOG_DIR/process_$i.pid"
  else
    BOOST_PROCESS_ID=$i "$PYTHON" -m boost_jax.train "$@" &
  fi
  pids+=($!)
done

status=0
live=("${pids[@]}")
while ((${#live[@]} > 0)); do
  done_pid=""
  wait -n -p done_pid "${live[@]}"  # bash >= 5.1
  rc=$?
  [[ -z "${done_pid:-}" ]] && continue  # interrupted by a signal (forwarded by the trap): keep waiting
  rest=()
  for pid in "${live[@]}"; do [[ "$pid" != "$done_pid" ]] && rest+=("$pid"); done
  live=("${rest[@]}")
  if ((rc != 0 && status == 0)); then
    status=$rc
    echo "local_multiprocess: process with pid $done_pid exited with status $rc; stopping the others" >&2
    stop_all
  fi
done
[[ -n "$watchdog" ]] && kill "$watchdog" 2>/dev/null  # all exited: nothing left for it to kill
exit $status
