#!/usr/bin/env bash
# Four GPUs of one host (nvidia-h100-x4 / nvidia-h200-x4) used as lanes: the one- and two-GPU plans' steps side by
# side on their own GPUs, so one 4-GPU lease does in ~20 minutes what x1.sh and x2.sh do one after the other.
#   bash benchmarks/device/x4_lanes.sh [step ...]   (no step: all; ~20 minutes on four H100)
# First the 4-GPU tests (all four GPUs), then three lanes at once (CUDA_VISIBLE_DEVICES per lane):
#   lane 0 (GPU 0):     x1.sh equal_memory_1b
#   lane 1 (GPU 1):     x1.sh fp8_scale gpu_tier
#   lane 2 (GPUs 2,3):  x2.sh e2e allreduce
# A timing compares variants of one suite run inside one lane (same GPU, same minutes); the lanes beside it share
# the host's CPUs (64 cores) but not its GPUs or NVLink pairs. Steps of this file (the lanes' steps are listed in
# x1.sh and x2.sh; name them here to run only those):
#   e2e4   issue 19 item 5 / 18: the 4-GPU e2e tests (DP=2 x PP=2 agoq full, PP=4 x VPP=2, 4-rank store)   ~2 min
# The lease of 2026-11-27 ran this file with issue 25's last four convergence runs in the lanes (git history).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
header
nvidia-smi topo -m 2>/dev/null | head -6
DEVICE_DIR=benchmarks/device

# sub_plan GPUS PLAN STEP...: the named steps of another plan on these GPUs (only those also asked for here)
sub_plan() {
  local gpus=$1 plan=$2; shift 2
  local pick=() s
  for s in "$@"; do wanted "$s" && pick+=("$s"); done
  [ ${#pick[@]} -gt 0 ] || return 0
  CUDA_VISIBLE_DEVICES=$gpus bash "$DEVICE_DIR/$plan" "${pick[@]}"
}

step e2e4 420 "$PY" -m pytest -q -p no:cacheprovider -m multigpu -rA \
  "tests/e2e/test_layouts_multigpu.py::test_four_gpu_layouts_train_like_pp1" \
  "tests/e2e/test_peer_store_multigpu.py::test_peer_store_reductions_equal_nccl_transport[4]"

{ sub_plan 0 x1.sh equal_memory_1b; } > "$AGOQ_RESULTS/lane0.log" 2>&1 &
{ sub_plan 1 x1.sh fp8_scale gpu_tier; } > "$AGOQ_RESULTS/lane1.log" 2>&1 &
{ sub_plan 2,3 x2.sh e2e allreduce; } > "$AGOQ_RESULTS/lane2.log" 2>&1 &
wait
echo "== plan x4_lanes finished $(date -u +%T)"; cat "$AGOQ_RESULTS/steps.tsv" 2>/dev/null
