#!/usr/bin/env bash
# Four GPUs of one host (nvidia-h100-x4 / nvidia-h200-x4): the open 4-GPU checks and suites, most urgent first.
#   bash benchmarks/device/x4.sh [step ...]      (no step: all, in this order; ~44 minutes on four H100)
# Steps and what they settle:
#   e2e                 issue 19 item 5: every multi-GPU e2e test, the 4-GPU DP x PP one included          ~8 min
#   allreduce4          issue 19 item 2 / 46 item 1 at 4 ranks (with the bf16 baselines and the link's peak)  ~4 min
#   nccl_sweep4         issue 46 item 1 at 4 ranks: NCCL_ALGO x NCCL_PROTO, one launch each               ~7 min
#   best_baseline4      issue 46 item 1 at 4 ranks: the store vs the fastest bf16 baseline per size         ~0 min
#   capacity_4gpu       issue 23 item 1: the ~32B shape at PP=4 (Megatron expected out of memory)            ~8 min
#   equal_memory_8b_pp4  issue 23 item 2 at the 8B shape                                                      ~9 min
#   pp4_interleaved  the 8B shape at PP=4, 1F1B vs VPP=2, baseline and agoq (docs/benchmarks/scale.md)        ~6 min
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
header
nvidia-smi topo -m 2>/dev/null | head -6
B=benchmarks/bench_pretrain.py
mkdir -p "$AGOQ_RESULTS/graph_reports"
step e2e 900 env AGOQ_CUDA_GRAPHS_REPORT_DIR="$AGOQ_RESULTS/graph_reports" "$PY" -m pytest -q -p no:cacheprovider \
  -m multigpu -rA tests/e2e
step allreduce4 600 torchrun --standalone --nproc-per-node 4 benchmarks/bench_allreduce.py \
  --sizes-mib 16 64 160 256 1024 --out "$AGOQ_RESULTS/grads_4gpu.json"
step nccl_sweep4 1000 "$PY" benchmarks/nccl_sweep.py --nproc 4 --sizes-mib 16 64 160 256 1024 \
  --out-dir "$AGOQ_RESULTS/nccl_sweep_4gpu"
step best_baseline4 120 "$PY" benchmarks/allreduce_best.py --grads "$AGOQ_RESULTS/grads_4gpu.json" \
  --sweep "$AGOQ_RESULTS/nccl_sweep_4gpu" --out "$AGOQ_RESULTS/grads_4gpu_best_baseline.json"
step capacity_4gpu 1000 "$PY" $B --suite capacity_4gpu --timeout 300 --out "$AGOQ_RESULTS/capacity_4gpu.json"
step equal_memory_8b_pp4 1300 "$PY" $B --suite equal_memory_8b_pp4 --timeout 200 \
  --out "$AGOQ_RESULTS/equal_memory_8b_pp4.json"
step pp4_interleaved 1000 "$PY" $B --suite pp4_interleaved --timeout 200 --out "$AGOQ_RESULTS/pp4_interleaved.json"
echo "== plan x4 finished $(date -u +%T)"
