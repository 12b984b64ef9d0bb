#!/usr/bin/env bash
# Two GPUs of one host (nvidia-h100-x2 / nvidia-h200-x2): the open 2-GPU checks and suites, most urgent first.
#   bash benchmarks/device/x2.sh [step ...]      (no step: all, in this order; ~36 minutes on two H100)
# Steps and what they settle:
#   allreduce    issue 19 item 2 / 46 item 1: the 8-bit reductions vs NCCL on NVLink, with the torch symmetric-memory and NCCL-window bf16 baselines, bus bandwidths, the link's peak   ~2 min
#   nccl_sweep   issue 46 item 1: NCCL's bf16 all-reduce / reduce-scatter under each NCCL_ALGO x NCCL_PROTO, one launch each, NCCL's TUNING log   ~6 min
#   best_baseline  issue 46 item 1: the store's all-reduce / reduce-to-owners vs the fastest bf16 baseline per size (targets 1.3x at 64-256 MiB, 1.6x at 1 GiB)   ~0 min
#   allreduce_socket  issue 19 item 3: the same over NCCL sockets (inter-node stand-in), with the all-gather floor  ~4 min
#   dp2_socket   issue 19 item 3: DP=2 ~1B steps on the socket link without the distributed optimizer        ~4 min
#   eager_pp2    issue 24 item 3 eager at PP=2 alone: baseline, agoq, Megatron + agoq RoPE, 2 rounds        ~5 min
#   profile_pp2  issue 24: the eager PP=2 steps profiled (host per thread, GPU idle, blocking calls), baseline / agoq  ~3 min
#   graphs_pp2   issue 24 item 3 at PP=2, nothing beside it; eager also with --manual-gc                     ~7 min
#   graphs_pp2_fp8  issue 24 item 3's FP8 target at PP=2: bf16 vs FP8 delayed linears, eager and graphs         ~4 min
#   e2e          issue 19 / 24: peer store, 8-bit gradients and PP=2 CUDA graphs, each against its reference  ~5 min
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
header
nvidia-smi topo -m 2>/dev/null | head -4
step allreduce 400 torchrun --standalone --nproc-per-node 2 benchmarks/bench_allreduce.py \
  --sizes-mib 16 64 160 256 1024 --out "$AGOQ_RESULTS/grads.json"
step nccl_sweep 900 "$PY" benchmarks/nccl_sweep.py --nproc 2 --sizes-mib 16 64 160 256 1024 \
  --out-dir "$AGOQ_RESULTS/nccl_sweep_2gpu"
step best_baseline 120 "$PY" benchmarks/allreduce_best.py --grads "$AGOQ_RESULTS/grads.json" \
  --sweep "$AGOQ_RESULTS/nccl_sweep_2gpu" --out "$AGOQ_RESULTS/grads_best_baseline.json"
step allreduce_socket 420 torchrun --standalone --nproc-per-node 2 benchmarks/bench_allreduce.py --link socket \
  --sizes-mib 16 64 160 256 --chunk-mib 0 --warmup 2 --iters 5 --out "$AGOQ_RESULTS/grads_socket.json"
step dp2_socket 600 "$PY" benchmarks/bench_pretrain.py --suite dp2_socket_allreduce --timeout 150 \
  --out "$AGOQ_RESULTS/dp2_socket_allreduce.json"
step eager_pp2 600 "$PY" benchmarks/bench_pretrain.py --suite graphs_pp2 --skip manual_gc /graphs --rounds 2 \
  --timeout 150 --out "$AGOQ_RESULTS/pretrain_eager_pp2.json"
step profile_pp2 600 bash benchmarks/device/profile_pair.sh 2 step_profile_pp2 --global-batch-size 16 --pipeline-model-parallel-size 2
step graphs_pp2 600 "$PY" benchmarks/bench_pretrain.py --suite graphs_pp2 --timeout 150 \
  --out "$AGOQ_RESULTS/pretrain_graphs_pp2.json"
step graphs_pp2_fp8 600 "$PY" benchmarks/bench_pretrain.py --suite graphs_pp2_fp8 --timeout 150 \
  --out "$AGOQ_RESULTS/pretrain_graphs_pp2_fp8.json"
mkdir -p "$AGOQ_RESULTS/graph_reports"
step e2e 600 env AGOQ_CUDA_GRAPHS_REPORT_DIR="$AGOQ_RESULTS/graph_reports" "$PY" -m pytest -q -p no:cacheprovider \
  -m multigpu -rA tests/e2e/test_peer_store_multigpu.py tests/e2e/test_grads_multigpu.py \
  tests/e2e/test_cuda_graphs_multigpu.py
echo "== plan x2 finished $(date -u +%T)"
