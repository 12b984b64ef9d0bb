#!/usr/bin/env bash
# The CPU test suite (what CI runs). Two pytest processes, because TRITON_INTERPRET must be set before
# triton is imported: (1) megatron, dist and unit tiers; (2) Triton kernels under the interpreter.
# GPU tiers (pytest -m gpu / -m multigpu) are documented in tests/README.md.
#
# Both processes run on pytest-xdist workers (in the dev extra): AGOQ_TEST_WORKERS of them (default: 2,
# at most the number of cores; 0 = in-process, serial). --dist loadgroup keeps the tests that share a
# module-scoped fixture on one worker (tests/conftest.py); the megatron tier is collected first so that its
# long launches start early and the many short unit tests fill the end. Without pytest-xdist the tiers run
# serially, with a notice. Before the tiers, `ruff check .` (pyproject.toml's rules). Exit status: non-zero if
# ruff finds anything or any test of either process fails (the kernels process selecting no test, pytest's exit 5,
# is not a failure); the last line says which.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
cores="$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
workers="${AGOQ_TEST_WORKERS:-$(( cores < 2 ? cores : 2 ))}"
parallel=()
if [ "$workers" -gt 0 ]; then
  if "$PY" -c 'import xdist' 2>/dev/null; then
    parallel=(-n "$workers" --dist loadgroup)
  else
    echo "run_tests.sh: pytest-xdist is not installed (pip install -e '.[dev]'): running serially"
  fi
fi
if [ ${#parallel[@]} -gt 0 ]; then
  echo "run_tests.sh: each tier on $workers pytest-xdist workers (${parallel[*]})"
else
  echo "run_tests.sh: each tier in one serial pytest process"
fi
status=0
# Lint first (seconds): pyproject.toml's ruff rules over the whole checkout; a finding fails the run like a test.
"$PY" -m ruff check . || { echo "run_tests.sh: ruff found the problems above (ruff check --fix fixes the [*] ones)"; status=1; }
# AGOQ_TEST_EXTENDED=1: also the extended tier (pyproject.toml's marker: heavy tests whose coverage overlaps CI's)
select="not gpu and not multigpu"
[ "${AGOQ_TEST_EXTENDED:-0}" = "1" ] || select="$select and not extended"
"$PY" -m pytest tests/megatron tests/dist tests/unit -m "$select" -q -p no:cacheprovider \
  "${parallel[@]}" "$@" || status=$?
TRITON_INTERPRET=1 "$PY" -m pytest tests/kernels -m "not gpu" -q -p no:cacheprovider "${parallel[@]}" "$@" \
  || { rc=$?; [ $rc -eq 5 ] || status=$rc; }
[ $status -eq 0 ] && echo "run_tests.sh: all tiers passed" || echo "run_tests.sh: FAILED (exit $status)"
exit $status
