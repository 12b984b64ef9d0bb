#!/usr/bin/env bash
# Four GPUs of one host (nvidia-h100-x4 / nvidia-h200-x4) used as lanes: the one- and two-GPU plans' steps side by
# side on their own GPUs, so one 4-GPU lease does in ~25 minutes what x1.sh and x2.sh do one after the other.
#   bash benchmarks/device/x4_lanes.sh [step ...]   (no step: all; ~25 minutes on four H100)
# First the 4-GPU tests (all four GPUs), then three lanes at once (CUDA_VISIBLE_DEVICES per lane):
#   lane 0 (GPU 0):     x1.sh fused_fp8 graphs_tests graphs
#   lane 1 (GPU 1):     conv_baseline_s1236, conv_aggressive_s1234, then x1.sh gpu_tier
#   lane 2 (GPUs 2,3):  conv_agoq-full_s1235 on 2 beside conv_agoq-default_s1235 on 3, then x2.sh e2e allreduce
#                       graphs_pp2
# and last the seed-band report over every convergence run. A timing compares variants of one suite run inside
# one lane (same GPU, same minutes); the lanes beside it share the host's CPUs (64 cores) but not its GPUs or
# NVLink pairs. Steps of this file (the lanes' x1/x2 steps are listed in those plans):
#   e2e4                     issue 19 item 5 / 18: the 4-GPU e2e tests (DP=2 x PP=2 agoq full, PP=4 x VPP=2, 4-rank store) ~4 min
#   conv_baseline_s1236      issue 25: baseline seed 3                                                    ~6 min
#   conv_aggressive_s1234    issue 25: aggressive                                                         ~6 min
#   conv_agoq-full_s1235     issue 25: agoq full seed 2                                                   ~6 min
#   conv_agoq-default_s1235  issue 25: agoq default seed 2                                                ~6 min
#   conv_report              issue 25: seed bands from every run so far (conv/bands.json)                 seconds
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
header
nvidia-smi topo -m 2>/dev/null | head -6
ASKED=("$@")
DEVICE_DIR=benchmarks/device

# conv_run GPU PRESET SEED: one convergence run on one GPU (a step of its own, named like its JSON)
conv_run() {
  [ -f data/debdocs.bin ] || { echo "conv: data/debdocs.{bin,idx,tokenizer.model} are not here: carry them"; return; }
  CUDA_VISIBLE_DEVICES=$1 step "conv_$2_s$3" 900 "$PY" benchmarks/bench_convergence.py --preset "$2" --seed "$3" \
    --data-prefix data/debdocs --out "$AGOQ_RESULTS/conv/conv_$2_s$3.json"
}

# sub_plan GPUS PLAN STEP...: the named steps of another plan on these GPUs (only those also asked for here)
sub_plan() {
  local gpus=$1 plan=$2; shift 2
  local pick=() s
  for s in "$@"; do wanted "$s" && pick+=("$s"); done
  [ ${#pick[@]} -gt 0 ] || return 0
  CUDA_VISIBLE_DEVICES=$gpus bash "$DEVICE_DIR/$plan" "${pick[@]}"
}

mkdir -p "$AGOQ_RESULTS/conv" "$AGOQ_RESULTS/graph_reports"
cp benchmarks/results/conv/conv_*.json "$AGOQ_RESULTS/conv/" 2>/dev/null
export AGOQ_CUDA_GRAPHS_REPORT_DIR="$AGOQ_RESULTS/graph_reports"

step e2e4 420 "$PY" -m pytest -q -p no:cacheprovider -m multigpu -rA \
  "tests/e2e/test_layouts_multigpu.py::test_four_gpu_layouts_train_like_pp1" \
  "tests/e2e/test_peer_store_multigpu.py::test_peer_store_reductions_equal_nccl_transport[4]"

{ sub_plan 0 x1.sh fused_fp8 graphs_tests graphs; } > "$AGOQ_RESULTS/lane0.log" 2>&1 &
{ conv_run 1 baseline 1236; conv_run 1 aggressive 1234; sub_plan 1 x1.sh gpu_tier; } \
  > "$AGOQ_RESULTS/lane1.log" 2>&1 &
{ conv_run 2 agoq-full 1235 & conv_run 3 agoq-default 1235; wait
  sub_plan 2,3 x2.sh e2e allreduce graphs_pp2; } > "$AGOQ_RESULTS/lane2.log" 2>&1 &
wait
echo "== lanes finished $(date -u +%T)"; cat "$AGOQ_RESULTS/steps.tsv"

step conv_report 120 "$PY" benchmarks/bench_convergence.py --report "$AGOQ_RESULTS/conv" \
  --out "$AGOQ_RESULTS/conv/bands.json"
echo "== plan x4_lanes finished $(date -u +%T) (asked: ${ASKED[*]:-all})"
