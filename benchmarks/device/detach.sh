#!/usr/bin/env bash
# Run a plan (x1.sh, x2.sh, x4.sh) detached from the calling command, for hosts that cut one command off after a
# few minutes (the project's device tool: 600 s per call) while the machine stays up between calls.
#
#   bash benchmarks/device/detach.sh PLAN WAIT_S [step ...]
#
# The first call on a machine copies this checkout to $AGOQ_DETACH_ROOT/repo and starts
# `bash benchmarks/device/PLAN [step ...]` there in a new process session (setsid: it outlives the call). Every call
# (the first and each later poll) then waits up to WAIT_S seconds for the plan to finish and copies what it has
# written so far into $OUT (when set): every JSON under the results folder (subfolders kept), steps.tsv, the
# driver's log, and the last 60 lines of each step's log as logs/<step>.tail. Later calls need nothing carried:
#
#   cd /tmp/agoq_device/repo && bash benchmarks/device/detach.sh x1.sh 560
#
# Exit code: 0 when the plan has finished, 75 (EX_TEMPFAIL) while it still runs.
set -u
plan=${1:?usage: detach.sh PLAN WAIT_S [step ...]}
wait_s=${2:?usage: detach.sh PLAN WAIT_S [step ...]}
shift 2
ROOT=${AGOQ_DETACH_ROOT:-/tmp/agoq_device}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
[ -f "$here/benchmarks/device/$plan" ] || { echo "detach.sh: no plan benchmarks/device/$plan" >&2; exit 2; }

if [ ! -f "$ROOT/started" ]; then
  mkdir -p "$ROOT/results"
  if [ "$here" != "$ROOT/repo" ]; then
    rm -rf "$ROOT/repo" && cp -r "$here" "$ROOT/repo"
    # a carried .commit names the tree (a copy's own .git may lag behind it); else git's HEAD here
    if [ ! -f "$here/.commit" ] && commit=$(git -C "$here" rev-parse HEAD 2>/dev/null); then
      echo "$commit" > "$ROOT/repo/.commit"
    fi
  fi
  date -u +%FT%TZ > "$ROOT/started"
  # only the setsid command is backgrounded (a backgrounded "cd && ..." list would hold the caller's stdout open)
  (cd "$ROOT/repo" || exit 1
   AGOQ_RESULTS="$ROOT/results" setsid nohup bash -c \
     'bash benchmarks/device/"$0" "$@"; date -u +%FT%TZ > '"$ROOT"'/finished' "$plan" "$@" \
     > "$ROOT/results/driver.log" 2>&1 < /dev/null &)
  echo "detach.sh: started $plan $* at $(cat "$ROOT/started")"
fi

end=$((SECONDS + wait_s))
while [ $SECONDS -lt $end ] && [ ! -f "$ROOT/finished" ]; do sleep 5; done

if [ -n "${OUT:-}" ]; then
  (cd "$ROOT/results" && find . -name '*.json' -size -20M -exec cp --parents {} "$OUT/" \; 2>/dev/null)
  cp "$ROOT/results/steps.tsv" "$ROOT/results/driver.log" "$OUT/" 2>/dev/null
  mkdir -p "$OUT/logs"
  for log in "$ROOT"/results/*.log; do
    [ -f "$log" ] && [ "$(basename "$log")" != driver.log ] && tail -n 60 "$log" > "$OUT/logs/$(basename "$log" .log).tail"
  done
fi
tail -n 25 "$ROOT/results/driver.log"
if [ -f "$ROOT/finished" ]; then echo "detach.sh: finished $(cat "$ROOT/finished")"; exit 0; fi
echo "detach.sh: still running (poll again)"; exit 75
