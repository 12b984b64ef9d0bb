#!/usr/bin/env bash
# profile_pair.sh NPROC NAME ARGS...: benchmarks/bench_step_profile.py over iterations 6-7 of the ~1B run at
# micro-batch 1 ($LLAMA_1B_MBS1 of common.sh) plus ARGS, the baseline (--agoq-disable) then agoq's default policy,
# into $AGOQ_RESULTS/NAME_{baseline,agoq}.rankN.json. A script (not a function of common.sh): the step runner
# starts its command under timeout, which runs programs only.
set -u
nproc=$1 name=$2; shift 2
rc=0
for side in baseline agoq; do
  extra=(); [ "$side" = baseline ] && extra=(--agoq-disable)
  # shellcheck disable=SC2086
  torchrun --standalone --nproc-per-node "$nproc" benchmarks/bench_step_profile.py --iterations 6 7 \
    --out "$AGOQ_RESULTS/${name}_$side.json" -- $LLAMA_1B_MBS1 "$@" "${extra[@]}" || rc=1
done
exit $rc
