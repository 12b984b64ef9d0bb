#!/usr/bin/env bash
# Four GPUs of one host (nvidia-h100-x4 / nvidia-h200-x4) used as lanes: the one- and two-GPU plans' steps side by
# side on their own GPUs and CPU cores, then the 4-GPU suites, so one 4-GPU lease does in ~27 minutes what x1.sh,
# x2.sh and x4.sh's capacity steps do one after the other.
#   bash benchmarks/device/x4_lanes.sh [step ...]   (no step: all; ~27 minutes on four H100)
# First three lanes at once (CUDA_VISIBLE_DEVICES and, where taskset exists, a disjoint quarter/half of the host's
# cores per lane, so that no lane's Python host thread waits on another's):
#   lane 0 (GPU 0):     x1.sh graphs
#   lane 1 (GPU 1):     x1.sh equal_memory_1b
#   lane 2 (GPUs 2,3):  x2.sh allreduce graphs_pp2
# then x4.sh's capacity_4gpu and equal_memory_8b_pp4 on all four GPUs. A timing compares variants of one suite run
# inside one lane (same GPU, same minutes). Host-bound eager timings are not clean beside other lanes even pinned
# (2026-11-27: eager steps jittered by +-10 %; the core ranges need not be disjoint physical cores): measure those on
# a machine of their own (x1.sh graphs, x2.sh graphs_pp2). Steps of this file (the lanes' steps are listed in x1.sh, x2.sh and x4.sh;
# name them here to run only those):
#   e2e4   issue 19 item 5 / 18: the 4-GPU e2e tests (DP=2 x PP=2 agoq full, PP=4 x VPP=2, 4-rank store)   ~2 min
# The lease of 2026-11-27 ran e2e4 with issue 25's last four convergence runs in the lanes (git history).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
header
nvidia-smi topo -m 2>/dev/null | head -6
DEVICE_DIR=benchmarks/device

# cores FIRST_QUARTER QUARTERS: "taskset -c A-B" over that share of the host's cores (nothing without taskset)
cores() {
  command -v taskset >/dev/null 2>&1 || return 0
  local n quarter; n=$(nproc); quarter=$((n / 4))
  [ "$quarter" -gt 0 ] || return 0
  echo "taskset -c $(($1 * quarter))-$((($1 + $2) * quarter - 1))"
}

# sub_plan GPUS CORES PLAN STEP...: the named steps of another plan on these GPUs (only those also asked for here)
sub_plan() {
  local gpus=$1 pin=$2 plan=$3; shift 3
  local pick=() s
  for s in "$@"; do wanted "$s" && pick+=("$s"); done
  [ ${#pick[@]} -gt 0 ] || return 0
  CUDA_VISIBLE_DEVICES=$gpus $pin bash "$DEVICE_DIR/$plan" "${pick[@]}"
}

step e2e4 420 "$PY" -m pytest -q -p no:cacheprovider -m multigpu -rA \
  "tests/e2e/test_layouts_multigpu.py::test_four_gpu_layouts_train_like_pp1" \
  "tests/e2e/test_peer_store_multigpu.py::test_peer_store_reductions_equal_nccl_transport[4]"

{ sub_plan 0 "$(cores 0 1)" x1.sh graphs; } > "$AGOQ_RESULTS/lane0.log" 2>&1 &
{ sub_plan 1 "$(cores 1 1)" x1.sh equal_memory_1b; } > "$AGOQ_RESULTS/lane1.log" 2>&1 &
{ sub_plan 2,3 "$(cores 2 2)" x2.sh allreduce graphs_pp2; } > "$AGOQ_RESULTS/lane2.log" 2>&1 &
wait
sub_plan 0,1,2,3 "" x4.sh capacity_4gpu equal_memory_8b_pp4
echo "== plan x4_lanes finished $(date -u +%T)"; cat "$AGOQ_RESULTS/steps.tsv" 2>/dev/null
