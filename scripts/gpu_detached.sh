#!/usr/bin/env bash
# Runs scripts/gpu_round.sh detached on the device machine, so a round may outlast one device call:
#   bash scripts/gpu_detached.sh WAIT_S step...   start the round (unless one runs), wait up to WAIT_S
#   bash scripts/gpu_detached.sh WAIT_S           wait for the running round up to WAIT_S
# Each call copies the round's log and results so far into $OUT.
set -u
WAIT=$1; shift
DIR=/tmp/strata_round
if [ $# -gt 0 ] && ! pgrep -f "scripts/gpu_round.sh" >/dev/null; then
  rm -rf "$DIR"; mkdir -p "$DIR"
  # setsid: the device tool ends the calling process group when a call returns; the round lives on.
  OUT=$DIR setsid nohup bash scripts/gpu_round.sh "$@" >"$DIR/nohup.log" 2>&1 </dev/null &
  sleep 2
fi
t0=$SECONDS
while pgrep -f "scripts/gpu_round.sh" >/dev/null && [ $((SECONDS - t0)) -lt "$WAIT" ]; do sleep 5; done
pgrep -f "scripts/gpu_round.sh" >/dev/null && echo "ROUND STILL RUNNING" || echo "ROUND DONE"
cp "$DIR"/round.log "$DIR"/results.tgz "${OUT:-.}"/ 2>/dev/null
tail -c 11000 "$DIR/round.log"
