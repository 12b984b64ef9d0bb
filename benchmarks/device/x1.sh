#!/usr/bin/env bash
# One GPU (nvidia-h100-x1 / nvidia-h200): the open one-GPU checks and suites, most urgent first.
#   bash benchmarks/device/x1.sh [step ...]      (no step: all, in this order; ~75 minutes on one H100)
# Steps and what they settle:
#   fused_fp8       plain FP8's fused SwiGLU -> E4M3 path (on by default, CPU-validated only): its GPU test  ~1 min
#   graphs_tests    issue 24 item 1: agoq under Megatron's CUDA graphs, eager vs graphs bit for bit        ~5 min
#   gpu_tier        the rest of tests/gpu                                                                  ~6 min
#   fp8_scale       issue 27's suite on current code (plain FP8 now fused): one current result            ~8 min
#   graphs          issue 24 item 3: whole steps at the host-bound shape, eager and graphs                ~10 min
#   equal_memory_1b  issue 23 item 2 at ~1B, with the agoq + FP8 Smooth-SwiGLU rows                         ~9 min
#   conv            issue 25's remaining seed-band runs (needs data/debdocs.*; done runs are skipped)     ~26 min
#   conv_report     issue 25's seed bands from every run so far (conv/bands.json; with conv)            seconds
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
header
B=benchmarks/bench_pretrain.py
step fused_fp8 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_smooth_swiglu_fused_gpu.py
mkdir -p "$AGOQ_RESULTS/graph_reports"
step graphs_tests 600 env AGOQ_CUDA_GRAPHS_REPORT_DIR="$AGOQ_RESULTS/graph_reports" \
  "$PY" -m pytest -q -p no:cacheprovider -m gpu -s -rA tests/gpu/test_cuda_graphs_gpu.py
step gpu_tier 900 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu \
  --ignore tests/gpu/test_smooth_swiglu_fused_gpu.py --ignore tests/gpu/test_cuda_graphs_gpu.py
step fp8_scale 1200 "$PY" $B --suite fp8_scale --timeout 150 --out "$AGOQ_RESULTS/fp8_scale.json"
step graphs 1200 "$PY" $B --suite graphs --timeout 150 --out "$AGOQ_RESULTS/pretrain_graphs.json"
step equal_memory_1b 1200 "$PY" $B --suite equal_memory_1b --timeout 110 --out "$AGOQ_RESULTS/equal_memory_1b.json"
if wanted conv; then
  if [ ! -f data/debdocs.bin ]; then
    echo "conv: data/debdocs.{bin,idx,tokenizer.model} are not here: carry them (see benchmarks/device/README.md)" \
      | tee "$AGOQ_RESULTS/conv.log"
    printf 'conv\t2\t0\n' >> "$AGOQ_RESULTS/steps.tsv"
  else
    mkdir -p "$AGOQ_RESULTS/conv" && cp benchmarks/results/conv/conv_*.json "$AGOQ_RESULTS/conv/"
    step conv 3000 "$PY" benchmarks/bench_convergence.py --matrix issue25 --gpus 0 --data-prefix data/debdocs \
      --out-dir "$AGOQ_RESULTS/conv"
  fi
fi
step conv_report 120 "$PY" benchmarks/bench_convergence.py --report "$AGOQ_RESULTS/conv" \
  --out "$AGOQ_RESULTS/conv/bands.json"
echo "== plan x1 finished $(date -u +%T)"
