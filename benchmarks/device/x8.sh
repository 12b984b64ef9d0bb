#!/usr/bin/env bash
# Eight GPUs of one host (nvidia-h100-x8 / nvidia-h200-x8, withheld so far): issues 26 and 47, most urgent first.
#   bash benchmarks/device/x8.sh [step ...]      (no step: all, in this order; ~60 minutes on eight H100)
# Steps and what they settle:
#   llama70b     issue 47: LLaMA-3-70B on the node, the planner's layouts (TP=2 x PP=4 agoq full; TP=1 x PP=8 selective
#                under expandable segments; FP8 at TP=4 x PP=2) and Megatron bf16 (expected out of memory), 20
#                iterations each: every stage's peak against the planner, tokens/s, MFU, the loss        ~25 min
#   e2e          issue 19 item 5 on the host that runs issue 26: every multi-GPU e2e test (2- and 4-GPU cases)   ~6 min
#   allreduce8   issue 26 run 2: bench_allreduce.py at 8 ranks (NVLink peer store vs NCCL fp32 / bf16)          ~2 min
#   dp8          issue 26 runs 2-3: ~1B at DP=8, distributed optimizer, NCCL and peer transport, NVLink and socket  ~10 min
#   dp2_pp4_8b   issue 26 run 1: the 8B shape at DP=2 x PP=4, Megatron baseline vs agoq full, stage peaks vs planner  ~15 min
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
header
nvidia-smi topo -m 2>/dev/null | head -10
B=benchmarks/bench_pretrain.py
mkdir -p "$AGOQ_RESULTS/graph_reports"
step llama70b 1800 "$PY" $B --suite llama70b_8gpu --timeout 600 --out "$AGOQ_RESULTS/llama70b_8gpu.json"
step e2e 900 env AGOQ_CUDA_GRAPHS_REPORT_DIR="$AGOQ_RESULTS/graph_reports" "$PY" -m pytest -q -p no:cacheprovider \
  -m multigpu -rA tests/e2e
step allreduce8 400 torchrun --standalone --nproc-per-node 8 benchmarks/bench_allreduce.py \
  --sizes-mib 16 64 160 256 1024 --out "$AGOQ_RESULTS/grads_8gpu.json"
step dp8 1200 "$PY" $B --suite dp8 --timeout 300 --out "$AGOQ_RESULTS/dp8.json"
step dp2_pp4_8b 1500 "$PY" $B --suite dp2_pp4_8b --timeout 600 --out "$AGOQ_RESULTS/dp2_pp4_8b.json"
echo "== plan x8 finished $(date -u +%T)"
