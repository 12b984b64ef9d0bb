#!/usr/bin/env bash
# Sourced by the per-machine plans (x1.sh, x2.sh, x4.sh): the GPU machine's environment and the step runner.
#
# Environment: megatron-core from a carried wheel (.whl/*.whl, made by ../shared/tools/device-wheels.sh) when the
# machine has none, installed into $AGOQ_SITE (not the system site-packages); NVLink multicast off (the lent
# machines disable it; NCCL and torch's symmetric memory would otherwise probe it).
# Results: every step writes $AGOQ_RESULTS/<step>.log (and its own JSON there); steps.tsv holds one line per step
# (name, exit code, seconds). A failing step does not stop the plan: the next one runs.
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 1
AGOQ_RESULTS=${AGOQ_RESULTS:-/tmp/agoq_device/results}
AGOQ_SITE=${AGOQ_SITE:-/tmp/agoq_device/site}
mkdir -p "$AGOQ_RESULTS"
PY=${PYTHON:-python3}

if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('megatron.core') is None)" >/dev/null 2>&1; then
  shopt -s nullglob; wheels=(.whl/*.whl); shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "common.sh: megatron-core is not importable and no wheel is in .whl/ (run ../shared/tools/device-wheels.sh" \
         "on the machine that prepares the run, or pip install megatron-core==0.19.2)" >&2
    exit 2
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$AGOQ_SITE" "${wheels[@]}"
fi
export AGOQ_RESULTS
export PYTHONPATH="$AGOQ_SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export AGOQ_CACHE=${AGOQ_CACHE:-/tmp/agoq_device/cache}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1

# The ~1B LLaMA at seq 4096 and micro-batch 1 of the graphs suites (benchmarks/pretrain_suites.py), for the steps
# that run scripts/pretrain_llama.py directly (profile_pair.sh)
export LLAMA_1B_MBS1="--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --num-query-groups 8 --ffn-hidden-size 8192
  --seq-length 4096 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2 --log-interval 1 --train-iters 9 --micro-batch-size 1"

# The steps named on the plan's command line (all when none): STEPS=",a,b,"
STEPS=",${*:-all},"
STEPS=${STEPS// /,}

wanted() { [[ "$STEPS" == ",all," || "$STEPS" == *",$1,"* ]]; }

# step NAME LIMIT_S COMMAND...: run COMMAND (stdout and stderr to NAME.log) under a time limit, if NAME is wanted.
step() {
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  echo "== $name: start $(date -u +%T) (limit ${limit} s)"
  local t0=$SECONDS rc
  timeout --kill-after 30 "$limit" "$@" > "$AGOQ_RESULTS/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$AGOQ_RESULTS/steps.tsv"
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  tail -n 4 "$AGOQ_RESULTS/$name.log"
}

header() {
  echo "== machine $(date -u +%FT%TZ) commit $("$PY" -c 'from agoq.testing.procs import source_commit; print(source_commit())')"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, triton, megatron.core; from importlib.metadata import version; print('torch', torch.__version__, '| triton', triton.__version__, '| megatron-core', version('megatron-core'))"
}
