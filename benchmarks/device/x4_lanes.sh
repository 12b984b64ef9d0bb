#!/usr/bin/env bash
# Four GPUs of one host (nvidia-h100-x4 / nvidia-h200-x4): the two- and four-GPU plans' steps in one lease, the
# timings that a shared host would blur one after another with nothing beside them, the checks side by side.
#   bash benchmarks/device/x4_lanes.sh [step ...]   (no step: all; ~31 minutes on four H100, ~47 with the suites)
# Phase 1, one step at a time, nothing beside it (2026-11-27: eager steps beside other lanes jittered by +-10 %, pinned
# core ranges need not be disjoint physical cores):
#   x2.sh allreduce, nccl_sweep, best_baseline (GPUs 0,1), x4.sh allreduce4, nccl_sweep4, best_baseline4 (all four),
#   x2.sh dp2_socket, eager_pp2 and profile_pp2 (GPUs 0,1)
# Phase 2, two lanes at once (checks, and ratios measured inside one lane against a baseline of the same minutes):
#   lane A (GPUs 0,1, first half of the cores):  x2.sh allreduce_socket, then x1.sh gpu_tier (GPU 0)
#   lane B (GPUs 2,3, second half of the cores): x2.sh e2e
# Phase 3, all four GPUs: this file's e2e4, then x4.sh capacity_4gpu and equal_memory_8b_pp4 (only when named: they
# are not among the "all" of this plan). Steps of this file (the sub-plans' steps are listed in x2.sh and x4.sh; name
# them here to run only those):
#   e2e4   issue 19 item 5 / 18: the 4-GPU e2e tests (DP=2 x PP=2 agoq full, PP=4 x VPP=2, 4-rank store)   ~2 min
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

# the 4-GPU suites run only when named (STEPS is ",all," otherwise)
named() { [[ "$STEPS" == *",$1,"* ]]; }

sub_plan 0,1 "" x2.sh allreduce nccl_sweep best_baseline
sub_plan 0,1,2,3 "" x4.sh allreduce4 nccl_sweep4 best_baseline4
sub_plan 0,1 "" x2.sh dp2_socket eager_pp2 profile_pp2

{ sub_plan 0,1 "$(cores 0 2)" x2.sh allreduce_socket; sub_plan 0 "$(cores 0 2)" x1.sh gpu_tier; } \
  > "$AGOQ_RESULTS/laneA.log" 2>&1 &
{ sub_plan 2,3 "$(cores 2 2)" x2.sh e2e; } > "$AGOQ_RESULTS/laneB.log" 2>&1 &
wait

step e2e4 420 "$PY" -m pytest -q -p no:cacheprovider -m multigpu -rA \
  "tests/e2e/test_layouts_multigpu.py::test_four_gpu_layouts_train_like_pp1" \
  "tests/e2e/test_peer_store_multigpu.py::test_peer_store_reductions_equal_nccl_transport[4]"
for suite in capacity_4gpu equal_memory_8b_pp4; do
  named "$suite" && sub_plan 0,1,2,3 "" x4.sh "$suite"
done
echo "== plan x4_lanes finished $(date -u +%T)"; cat "$AGOQ_RESULTS/steps.tsv" 2>/dev/null
