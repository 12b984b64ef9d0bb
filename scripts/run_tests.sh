#!/usr/bin/env bash
# The CPU test suite (what CI runs). Two pytest processes, because TRITON_INTERPRET must be set before
# triton is imported: (1) unit, dist and megatron tiers; (2) Triton kernels under the interpreter.
# GPU tiers (pytest -m gpu / -m multigpu) are documented in tests/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
status=0
"$PY" -m pytest tests/unit tests/dist tests/megatron -m "not gpu and not multigpu" -q -p no:cacheprovider "$@" || status=$?
TRITON_INTERPRET=1 "$PY" -m pytest tests/kernels -m "not gpu" -q -p no:cacheprovider "$@" || { rc=$?; [ $rc -eq 5 ] || status=$rc; }
[ $status -eq 0 ] && echo "run_tests.sh: all tiers passed" || echo "run_tests.sh: FAILED (exit $status)"
exit $status
