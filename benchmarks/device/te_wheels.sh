#!/usr/bin/env bash
# Transformer Engine for the GPU machines, prepared here (run in the project root; takes ~1 minute, ~290 MB).
# TE ships its core as one ~276 MB wheel (transformer-engine-cu13: the GPU machines run torch with CUDA 13) and its
# PyTorch extension only as an sdist, while one device call carries at most 64 MiB with the tree. This writes, under
# .te/ (git-ignored through .git/info/exclude):
#   p00 .. p04                                the core wheel in 55 MiB pieces (one piece per device call)
#   transformer_engine_torch-<v>.tar.gz       the extension's sdist, built there with the machine's nvcc
#   deps/                                     small wheels TE needs that the machine lacks (cudnn-frontend headers,
#                                             pydantic, the `transformer-engine` meta wheel TE's import checks for)
#   core.sha256, core.name                    the reassembled core wheel's checksum and file name
# Then benchmarks/device/te_device.sh (there) stages, installs and builds; benchmarks/device/README.md has the call
# sequence. TE_VERSION overrides the version (2.20.2: the one measured; Megatron-core 0.19.2 supports >= 2.x).
set -eu
V=${TE_VERSION:-2.20.2}
cd "$(git rev-parse --show-toplevel)"
grep -qx "/.te/" .git/info/exclude 2>/dev/null || echo "/.te/" >> .git/info/exclude
[ -x .venv/bin/pip ] || { echo "te_wheels.sh: run scripts/setup_env.sh first (the sdist's metadata step imports torch)" >&2; exit 1; }
py=python3.12; "$py" --version >/dev/null 2>&1 || py="$(pyenv root 2>/dev/null)/versions/$(pyenv versions --bare 2>/dev/null | grep "^3\.12" | tail -1)/bin/python3.12"
rm -rf .te && mkdir -p .te/deps .te/tmp
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
"$py" -m pip download -q --no-deps $plat -d .te/tmp "transformer-engine-cu13==$V"
"$py" -m pip download -q --no-deps $plat -d .te/deps nvidia-cudnn-frontend pydantic pydantic-core annotated-types \
  typing-inspection nvdlfw-inspect
# --isolated: index settings of this machine break sdist downloads; the metadata step imports torch (the venv's)
.venv/bin/pip download --isolated -q --no-deps --no-binary=:all: --no-build-isolation -d .te "transformer-engine-torch==$V"
.venv/bin/pip download --isolated -q --no-deps --only-binary=:all: -d .te/deps "transformer-engine==$V"
w=$(ls .te/tmp/transformer_engine_cu13-*.whl)
sha256sum "$w" | cut -d' ' -f1 > .te/core.sha256
basename "$w" > .te/core.name
( cd .te && split -b 55M -d "tmp/$(cat core.name)" p && rm -rf tmp )
du -sb .te/p0* .te/*.tar.gz .te/deps
