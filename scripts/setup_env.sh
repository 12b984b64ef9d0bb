#!/usr/bin/env bash
# Create ./.venv with Python 3.12 and install agoq (editable) with its test extras.
# Finds a working python3.12 on PATH, else pyenv's 3.12; says clearly when there is none.
# Idempotent: a second run only re-checks the install. Override the interpreter with PYTHON=/path/python3.12.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return 0; fi
  local candidates=(python3.12)
  if command -v pyenv >/dev/null 2>&1; then
    local root; root="$(pyenv root)"
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V -r); do
      candidates+=("$root/versions/$v/bin/python3.12")
    done
  fi
  candidates+=(/usr/bin/python3.12 /usr/local/bin/python3.12 python3)
  for py in "${candidates[@]}"; do
    if "$py" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; then
      command -v "$py" 2>/dev/null || echo "$py"; return 0
    fi
  done
  return 1
}

if ! PY="$(find_python312)"; then
  echo "setup_env.sh: no working Python 3.12 found (megatron-core 0.19.2 needs 3.12)." >&2
  echo "  Install one (e.g. 'pyenv install 3.12' or your distribution's python3.12) or set PYTHON=/path/to/python3.12" >&2
  exit 1
fi
echo "setup_env.sh: using $PY ($("$PY" --version 2>&1))"
# A fresh .venv (torch with its CUDA libraries, megatron-core, Triton) takes about 6 GiB (measured: 5.9 GiB);
# say so before pip fails with "No space left on device".
VENV_GIB=7
avail_kib=$(df -Pk . 2>/dev/null | awk 'NR == 2 {print $4}')
if [ ! -x .venv/bin/python ] && [ -n "$avail_kib" ] && [ "$avail_kib" -lt $((VENV_GIB * 1024 * 1024)) ]; then
  echo "setup_env.sh: warning: $((avail_kib / 1024 / 1024)) GiB free on $(pwd); a fresh .venv needs about ${VENV_GIB} GiB" >&2
fi
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)'; then
  rm -rf .venv
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -c 'import torch, megatron.core, agoq; from importlib.metadata import version; print("setup_env.sh: torch", torch.__version__, "| megatron-core", version("megatron-core"), "| agoq", agoq.__version__)'
