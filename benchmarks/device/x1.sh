#!/usr/bin/env bash
# One GPU (nvidia-h100-x1 / nvidia-h200): the open one-GPU checks and suites, most urgent first.
#   bash benchmarks/device/x1.sh [step ...]      (no step: all, in this order; ~47 minutes on one H100)
# Steps and what they settle:
#   stage_proxy_70b  issue 47: whether stage 0 of the planner's TP=1 layout for LLaMA-3-70B on one 8 x H100 node (PP=8,
#                   selective recompute, the aggressive policy, agoq full; the planner's fastest, TP=2 x PP=4, cannot
#                   be proxied on one GPU) fits 80 GB: benchmarks/stage_proxy.py builds that stage alone on this GPU
#                   (embedding + layers 1-10, 8-bit gradients, agoq's AdamW, 8 micro-batches in flight through
#                   Megatron's 1F1B) and reports its peak per phase beside the planner's 77.29 GiB; plus the proxy's
#                   own check, stage 0 of the 8B PP=4 run measured on 4 H100 (16.29 GiB, docs/benchmarks/grads.md)
#                   -> $AGOQ_RESULTS/stage_proxy_70b.json                                                 ~4 min
#   stage_proxy_70b_es  issue 47: the PP=8 stage 0 again with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, 4
#                   iterations (on 2026-12-07 the default allocator's first iteration ran at 76.99 GiB, the second ran
#                   out of memory in backward with 0.90 GiB reserved but unallocated)
#                   -> $AGOQ_RESULTS/stage_proxy_70b_es.json                                              ~3 min
#   stage_proxy_70b_fp8  issue 47: the fastest TP=1 layout with FP8 (agoq-full-fp8, PP=8, full recompute, bf16
#                   policy; planner 77.18 GiB, 0.71 GiB under the 77.89 budget) with the default allocator and with
#                   expandable segments, 3 iterations each -> stage_proxy_70b_fp8{,_es}.json                  ~3 min
#                   On an H200, PROXY_GPU_GIB=79.18 stands it in for an H100 80GB (stage_proxy.py --gpu-memory-gib:
#                   PyTorch's allocator capped at 79.18 - 1.29 GiB, the H100's measured CUDA context)
#   commits         issue 44: the checkout before the one-step redesign (.old/a43a8b4, unpacked and carried: see
#                   benchmarks/bench_commits.py) against this one, ~1B at micro-batch 1: baseline and agoq full
#                   (COMMITS_VARIANTS adds agoq_full_fp8), 2 interleaved rounds: tokens/s, peak, losses
#                   bit-identical or not, against two runs of one checkout (COMMITS_FLAGS=--deterministic: deterministic
#                   algorithms in every rank)                                                             ~6 min
#   rope            issue 24: agoq's fused RoPE (agoq.megatron.rope) on CUDA: kernel = reference and model = Megatron's
#                   unfused RoPE bit for bit (tests), the ~1B harness bf16 / bf16@rope / agoq / agoq@rope in rounds,
#                   host time per function, and eager whole steps in 2 rounds: baseline, agoq (fused RoPE),
#                   Megatron + agoq RoPE only, agoq with Megatron's RoPE, bf16 / FP8 linears                  ~13 min
#   qkvrope         issue 24: the fused QKV split + RoPE on CUDA (kernel at model sizes, model vs Megatron's split path,
#                   CUDA graphs) and the harness A/B against agoq's per-tensor RoPE on the split path     ~6 min
#   hostcost        issue 24: the one-node linears (norm + QKV / fc1, SwiGLU + fc2, quantized-input out-projection)
#                   on CUDA (GPU test, graphs tests), host us per path, and the ~1B harness bf16 / agoq /
#                   agoq@twonode (all three off) in interleaved rounds                                        ~6 min
#   hostprof        issue 24: host time per function and layer inside steps (bf16 / agoq), launch anatomy and
#                   cProfile of the norm -> linear paths                                                      ~3 min
#   eager           issue 24 item 3 eager alone: baseline, agoq, bf16 and FP8 linears, 2 rounds A B A B       ~6 min
#   eager_diag      issue 24: why agoq's eager steps are bimodal on some leases: baseline / agoq / FP8 eager in 3
#                   rounds with every iteration's host readings (--log-json: steal time, enqueue time, per-thread
#                   CPU and run-queue time, Python collections) and the GPU's clocks, power and utilisation
#                   sampled every 250 ms beside it (eager_diag_gpu.csv)                                    ~8 min
#   profile         issue 24: where eager steps spend host time and whether they wait on the GPU, baseline / agoq  ~3 min
#   graphs          issue 24 item 3 (eager, eager --manual-gc, graphs), on its own GPU and cores; with the two
#                   RoPE rows (Megatron + agoq RoPE only, agoq with Megatron's RoPE)                        ~14 min
#   gpu_tier        the GPU tier on current code: every tests/gpu file (fused FP8, CUDA graphs, kernels)          ~8 min
#                   GPU_TESTS="tests/gpu/test_stage_proxy_gpu.py ..." runs only the files named (a short lease: those that
#                   have not yet run on a GPU)
#   fp8_scale       issue 27's suite on current code (plain FP8 now fused): one current result            ~8 min
#   equal_memory_1b  issue 23 item 2 at ~1B, with the agoq + FP8 Smooth-SwiGLU rows                         ~9 min
# Done on 2026-11-27 and left out: issue 25's convergence matrix (docs/benchmarks/convergence.md; rerun one run with
# benchmarks/bench_convergence.py --preset) and the CUDA-graph validation (docs/numerics.md).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
header
B=benchmarks/bench_pretrain.py
step stage_proxy_70b 580 "$PY" benchmarks/stage_proxy.py --out "$AGOQ_RESULTS/stage_proxy_70b.json" --iterations 3 \
  --timeout 240 \
  --case 8b_pp4_stage0 -- --config configs/model/llama3-8b.yaml --vocab-size 4096 --seq-length 4096 \
    --micro-batch-size 1 --global-batch-size 16 --agoq-grads int8_b256 --agoq-optimizer adamw \
  --case 70b_pp8_stage0 -- --config configs/model/llama3-70b.yaml --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 8 --agoq-preset agoq-full \
    --recompute-granularity selective --agoq-policy configs/policy/aggressive.yaml \
  --case 70b_pp8_stage0_full_recompute -- --config configs/model/llama3-70b.yaml --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 8 --agoq-preset agoq-full \
    --recompute-granularity full --agoq-policy configs/policy/bf16.yaml
step stage_proxy_70b_es 400 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$PY" benchmarks/stage_proxy.py \
  --out "$AGOQ_RESULTS/stage_proxy_70b_es.json" --iterations 4 --timeout 300 \
  --case 70b_pp8_stage0 -- --config configs/model/llama3-70b.yaml --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 8 --agoq-preset agoq-full \
    --recompute-granularity selective --agoq-policy configs/policy/aggressive.yaml
FP8_70B=(--config configs/model/llama3-70b.yaml --tensor-model-parallel-size 1 --pipeline-model-parallel-size 8
  --agoq-preset agoq-full-fp8 --recompute-granularity full --agoq-policy configs/policy/bf16.yaml)
step stage_proxy_70b_fp8 300 bash -c '"$0" benchmarks/stage_proxy.py --out "$AGOQ_RESULTS/stage_proxy_70b_fp8.json" \
  --iterations 3 --timeout 130 ${PROXY_GPU_GIB:+--gpu-memory-gib $PROXY_GPU_GIB} \
  --case 70b_pp8_fp8_full_default -- "${@}"; a=$?
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$0" benchmarks/stage_proxy.py --iterations 3 --timeout 130 \
  ${PROXY_GPU_GIB:+--gpu-memory-gib $PROXY_GPU_GIB} --out "$AGOQ_RESULTS/stage_proxy_70b_fp8_es.json" \
  --case 70b_pp8_fp8_full_expandable -- "${@}"; exit $((a | $?))' \
  "$PY" "${FP8_70B[@]}"
step commits 900 "$PY" benchmarks/bench_commits.py ${COMMITS_FLAGS:-} --tree old=.old/a43a8b4 --tree new=. --rounds "${COMMITS_ROUNDS:-2}" \
  --variants ${COMMITS_VARIANTS:-baseline agoq_full} --out "$AGOQ_RESULTS/commits.json"
step rope 900 bash -c '"$0" -m pytest -q -p no:cacheprovider -rA tests/kernels/test_rope_kernels.py \
  tests/megatron/test_rope.py; rc=$?
  "$0" benchmarks/bench_memory.py --policies bf16 bf16@rope agoq agoq@rope --mbs 1 --steps 8 --rounds 4 \
    --json "$1/activations_rope.json" || rc=1
  "$0" benchmarks/bench_host_profile.py --policies bf16 agoq agoq@rope --steps 10 \
    --json "$1/activations_host_profile.json" || rc=1
  "$0" benchmarks/bench_pretrain.py --suite graphs --skip manual_gc /graphs smooth-swiglu --rounds 2 --timeout 150 \
    --out "$1/pretrain_eager.json" || rc=1
  exit $rc' "$PY" "$AGOQ_RESULTS"
step qkvrope 900 bash -c '"$0" -m pytest -q -p no:cacheprovider -rA tests/kernels/test_rope_kernels.py \
  tests/megatron/test_rope.py tests/unit/test_rope_op.py tests/gpu/test_cuda_graphs_gpu.py; rc=$?
  "$0" benchmarks/bench_memory.py --policies bf16 bf16@rope agoq@splitrope agoq@rope --mbs 1 --steps 8 --rounds 4 \
    --json "$1/activations_qkv_rope.json" || rc=1
  exit $rc' "$PY" "$AGOQ_RESULTS"
step hostcost 720 bash -c '"$0" -m pytest -q -p no:cacheprovider -m gpu -rA tests/gpu/test_norm_linear_gpu.py \
  tests/gpu/test_saved_act_gpu.py tests/gpu/test_cuda_graphs_gpu.py; rc=$?
  "$0" benchmarks/bench_launch.py --json "$1/activations_launch.json" || rc=1
  "$0" benchmarks/bench_memory.py --policies bf16 agoq agoq@twonode --mbs 1 --steps 8 --rounds 4 \
    --json "$1/activations_norm_node.json" || rc=1
  exit $rc' "$PY" "$AGOQ_RESULTS"
step hostprof 600 bash -c '"$0" benchmarks/bench_host_profile.py --policies bf16 agoq --steps 10 \
  --json "$1/activations_host_profile.json"; rc=$?
  "$0" benchmarks/bench_launch.py --calls 1000 --anatomy --cprofile 30 || rc=1
  exit $rc' "$PY" "$AGOQ_RESULTS"
step eager 900 "$PY" $B --suite graphs --skip manual_gc /graphs smooth-swiglu --rounds 2 --timeout 150 \
  --out "$AGOQ_RESULTS/pretrain_eager.json"
step eager_diag 900 bash -c 'nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,\
utilization.gpu --format=csv -lms 250 > "$1/eager_diag_gpu.csv" 2>&1 & smi=$!
  "$0" benchmarks/bench_pretrain.py --suite graphs --only "baseline (Megatron)" "agoq activations" \
    "fp8 delayed (bf16 policy)" --skip manual_gc /graphs --rounds 3 --timeout 150 --out "$1/pretrain_eager_diag.json"; rc=$?
  kill $smi 2>/dev/null; exit $rc' "$PY" "$AGOQ_RESULTS"
step profile 600 bash benchmarks/device/profile_pair.sh 1 step_profile --global-batch-size 8
step graphs 1500 "$PY" $B --suite graphs --timeout 150 --out "$AGOQ_RESULTS/pretrain_graphs.json"
mkdir -p "$AGOQ_RESULTS/graph_reports"
step gpu_tier 900 env AGOQ_CUDA_GRAPHS_REPORT_DIR="$AGOQ_RESULTS/graph_reports" "$PY" -m pytest -q -p no:cacheprovider \
  -m gpu -rA ${GPU_TESTS:-tests/gpu}
step fp8_scale 1200 "$PY" $B --suite fp8_scale --timeout 150 --out "$AGOQ_RESULTS/fp8_scale.json"
step equal_memory_1b 1200 "$PY" $B --suite equal_memory_1b --timeout 110 --out "$AGOQ_RESULTS/equal_memory_1b.json"
echo "== plan x1 finished $(date -u +%T)"
