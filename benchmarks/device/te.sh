#!/usr/bin/env bash
# One GPU with Transformer Engine installed by benchmarks/device/te_device.sh (in /tmp/te/site):
#   bash benchmarks/device/te.sh [step ...]         (no step: all; detach.sh te.sh WAIT_S runs it past one call)
# Steps and what they settle:
#   te_tests   agoq on TE's layers (tests/gpu/test_te_agoq_gpu.py: bf16 policy bit-identical to plain TE, the
#              default policy above nf4's floor in bf16 and TE FP8)                                       ~1 min
#   door_gpu   the zero-edit door through megatron.training on both construction paths, local spec
#              (tests/gpu/test_megatron_lm_gpu.py -k zero_edit_door)                                        ~3 min
#   te_bench   the Transformer Engine baseline and agoq side by side (benchmarks/bench_te.py, every row):
#              Megatron + TE bf16 / FP8 delayed / tensorwise / mbs 4 / precision-aware optimizer (bf16 and FP8
#              moments) / + selective, full recompute, activation offloading; Megatron local bf16; agoq full and
#              agoq full + FP8 on the local spec; the FP8 learning-speed ablation rows; agoq on TE through the
#              zero-edit door (agoq_te/*). TE_ROWS="row row ..." runs only those rows, TE_ITERS iterations
#              (default 10; ~45 s a row at 10)                                                             ~16 min
#   te_bench_8b  the LLaMA-3-8B shape (128,256 vocabulary) at micro-batch 1, global batch 8: agoq + TE FP8
#              against what Megatron + TE fits with its levers (TE_ROWS_8B, default below)            ~5 min
#   te_profile  where agoq + TE FP8's 0.89x of TE FP8 goes (docs/benchmarks/te.md): the pair at micro-batch 2
#              (TE_PROFILE_ROWS, default te/fp8_delayed agoq_te/full_fp8 te/bf16 agoq_te/full), 12 iterations,
#              Megatron-LM's torch profiler over iterations 8-9 (bench_te.py --profile 8 10): GPU busy time and
#              kernel time by category per row in te_profile.json, the traces in traces/, agoq's rows against
#              TE's in te_profile_fp8.txt / te_profile_bf16.txt (benchmarks/trace_summary.py --against)  ~4 min
#   te_mbs16   the open finding of docs/benchmarks/te.md (agoq + TE FP8 at micro-batch 16 = the global batch: loss
#              6.56 at iteration 3, 2.4-2.5 at every other micro-batch): TE FP8 and agoq + TE FP8 both at micro-batch
#              16 (one micro-batch per step, so delayed scaling's first step has no amax history within the step),
#              8 iterations, losses per iteration -> te_mbs16.json (TE FP8 at 16 needs ~98 GiB: an H200, or an
#              out-of-memory row on an H100)                                                              ~3 min
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[ -d /tmp/te/site/transformer_engine ] || { echo "te.sh: Transformer Engine is not installed (benchmarks/device/te_device.sh)" >&2; exit 2; }
export PYTHONPATH="/tmp/te/site:$PYTHONPATH"
header
"$PY" -c "from importlib.metadata import version; print('transformer-engine', version('transformer-engine'))"
step te_tests 600 "$PY" -m pytest -q -p no:cacheprovider -rA tests/gpu/test_te_agoq_gpu.py
step door_gpu 600 "$PY" -m pytest -q -p no:cacheprovider -rA tests/gpu/test_megatron_lm_gpu.py -k zero_edit_door
# shellcheck disable=SC2086  # TE_ROWS is a list of row names
step te_bench 1500 "$PY" benchmarks/bench_te.py --out "$AGOQ_RESULTS/te.json" --iters "${TE_ITERS:-10}" \
  ${TE_ROWS:+--rows $TE_ROWS}
TE_ROWS_8B="${TE_ROWS_8B:-agoq_te/full_fp8 agoq/full_fp8 te/fp8_precision_aware_bf16_full_recompute}"
# shellcheck disable=SC2086
step te_bench_8b 1200 "$PY" benchmarks/bench_te.py --out "$AGOQ_RESULTS/te_8b.json" --shape 8b --global-batch 8 \
  --micro-batch 1 --iters "${TE_ITERS_8B:-10}" --rows $TE_ROWS_8B
TE_PROFILE_ROWS="${TE_PROFILE_ROWS:-te/fp8_delayed agoq_te/full_fp8 te/bf16 agoq_te/full}"
# shellcheck disable=SC2016,SC2086
step te_profile 900 bash -c '"$0" benchmarks/bench_te.py --out "$1/te_profile.json" --iters 12 --profile 8 10 \
  --keep-traces "$1/traces" --rows $2; rc=$?; t="$1/traces"
  [ -f "$t/agoq_te_full_fp8.trace.json.gz" ] && "$0" benchmarks/trace_summary.py "$t/agoq_te_full_fp8.trace.json.gz" \
    --against "$t/te_fp8_delayed.trace.json.gz" --json "$1/te_profile_fp8_vs.json" > "$1/te_profile_fp8.txt"
  [ -f "$t/agoq_te_full.trace.json.gz" ] && "$0" benchmarks/trace_summary.py "$t/agoq_te_full.trace.json.gz" \
    --against "$t/te_bf16.trace.json.gz" --json "$1/te_profile_bf16_vs.json" > "$1/te_profile_bf16.txt"
  exit $rc' "$PY" "$AGOQ_RESULTS" "$TE_PROFILE_ROWS"
step te_mbs16 600 "$PY" benchmarks/bench_te.py --out "$AGOQ_RESULTS/te_mbs16.json" --micro-batch 16 --iters 8 \
  --rows te/fp8_delayed agoq_te/full_fp8 te/bf16
