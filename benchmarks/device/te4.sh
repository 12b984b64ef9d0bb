#!/usr/bin/env bash
# Four GPUs of one host with Transformer Engine installed by benchmarks/device/te_device.sh (in /tmp/te/site), issue 46
# items 2 and 4: the suites of benchmarks/bench_te.py (benchmarks/te_layouts.py), 20 iterations a row (TE4_ITERS).
#   bash benchmarks/device/te4.sh [step ...]       (no step: all; detach.sh te4.sh WAIT_S runs it past one call)
# On two GPUs name the 2-GPU steps only (dp2_1b, cp_16k). TE4_ROWS="row ..." runs only those rows of a step's suite.
# Steps and what they settle:
#   dp2_1b      item 2: ~1B at DP=2 (distributed optimizer, --overlap-grad-reduce, default buckets): Megatron + TE
#               bf16 / FP8 with fp32 and bf16 gradient reduction against agoq + TE full (bf16, FP8), and the FP8
#               rows on the socket link (inter-node stand-in)                                            ~10 min
#   dp4_1b      item 2: the same six rows at DP=4                                                         ~6 min
#   dp2_pp2_3b  item 2: the LLaMA-3.2-3B body at DP=2 x PP=2, the six rows and the FP8 ones on the socket link,
#               every pipeline stage's peak                                                              ~12 min
#   eqmem_8b  item 2: the LLaMA-3-8B shape on 4 GPUs, Megatron + TE FP8 at its layouts and levers against agoq +
#               TE FP8 at its layouts; the summary's equal_memory_8b table (target >= 1.3x)             ~20 min
#   cp_16k      item 4: ~1B at sequence 16k, CP=2 against its CP=1 twin (agoq + TE bf16 and FP8, Megatron + TE
#               bf16): losses against CP=1, per-GPU peaks, the planner's CP=1 prediction ("CP not modelled")
#                                                                                                        ~8 min
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[ -d /tmp/te/site/transformer_engine ] || { echo "te4.sh: Transformer Engine is not installed (benchmarks/device/te_device.sh)" >&2; exit 2; }
export PYTHONPATH="/tmp/te/site:$PYTHONPATH"
header
nvidia-smi topo -m 2>/dev/null | head -6
B="benchmarks/bench_te.py --iters ${TE4_ITERS:-20} --row-timeout 600"
# shellcheck disable=SC2086  # B and TE4_ROWS are word lists
step dp2_1b 1200 "$PY" $B --suite dp_1b --nproc 2 ${TE4_ROWS:+--rows $TE4_ROWS} --out "$AGOQ_RESULTS/te4_dp2_1b.json"
# shellcheck disable=SC2086
step dp4_1b 900 "$PY" $B --suite dp_1b --nproc 4 ${TE4_ROWS:+--rows $TE4_ROWS} --out "$AGOQ_RESULTS/te4_dp4_1b.json"
# shellcheck disable=SC2086
step dp2_pp2_3b 1500 "$PY" $B --suite dp2_pp2_3b ${TE4_ROWS:+--rows $TE4_ROWS} --out "$AGOQ_RESULTS/te4_dp2_pp2_3b.json"
# shellcheck disable=SC2086
step eqmem_8b 2400 "$PY" $B --suite eqmem_8b ${TE4_ROWS:+--rows $TE4_ROWS} --out "$AGOQ_RESULTS/te4_eqmem_8b.json"
# shellcheck disable=SC2086
step cp_16k 1200 "$PY" $B --suite cp_16k ${TE4_ROWS:+--rows $TE4_ROWS} --out "$AGOQ_RESULTS/te4_cp_16k.json"
echo "== plan te4 finished $(date -u +%T)"
