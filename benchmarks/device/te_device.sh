#!/usr/bin/env bash
# Transformer Engine on the GPU machine (run there, from the carried tree's root), in calls back to back while the
# machine stays warm (it goes back after ~30 s idle). Each call carries some of .te/ (benchmarks/device/te_wheels.sh
# made it here) and stages what it carried in /tmp/te; the tree plus the carried paths must stay under 64 MiB:
#   call 0: carry .te/p00 .te/core.sha256 .te/core.name .te/transformer_engine_torch-*.tar.gz   -> te_device.sh
#   calls 1-3: carry .te/p01 / .te/p02 / .te/p03                                                -> te_device.sh
#   call 4: carry .te/p04                                                                       -> te_device.sh
#   call 5: carry .te/deps                                                       -> te_device.sh --build [WAIT_S]
# --build reassembles and checks the core wheel, installs it and the deps into /tmp/te/site and builds
# transformer_engine_torch from its sdist with the machine's nvcc (sm_90) in a detached process; it and --wait
# [WAIT_S] wait for the build (default 480 s) and end by importing transformer_engine.pytorch. Afterwards:
#   export PYTHONPATH=/tmp/te/site:$PYTHONPATH       (benchmarks/device/te.sh does this)
# Measured on an H100 (2026-12-07): staging calls take seconds; the build ~80 s. Exit 0 once TE imports (or after a
# staging call), 1 on a failed build or checksum, 75 while the build still runs.
set -u
T=/tmp/te; mkdir -p $T/deps
for f in .te/p0* .te/*.tar.gz .te/core.sha256 .te/core.name; do [ -f "$f" ] && cp "$f" $T/; done
[ -d .te/deps ] && cp .te/deps/*.whl $T/deps/ 2>/dev/null
echo "te_device.sh: staged: $(cd $T && ls -d p0* *.tar.gz deps/*.whl 2>/dev/null | tr '\n' ' ')"
if [ "${1:-}" = "--build" ] && [ ! -f $T/build.started ]; then
  W=$T/$(cat $T/core.name)
  cat $T/p0* > "$W"
  [ "$(sha256sum "$W" | cut -d' ' -f1)" = "$(cat $T/core.sha256)" ] || { echo "te_device.sh: core wheel checksum mismatch (a piece is missing or was carried twice)"; rm -f "$W"; exit 1; }
  date +%s > $T/build.started
  python3 -m pip install -q --no-index --no-deps --no-compile --target $T/site "$W" $T/deps/*.whl || exit 1
  mkdir -p $T/src && tar xzf $T/transformer_engine_torch-*.tar.gz -C $T/src
  ( cd $T/src/transformer_engine_torch-* && export PYTHONPATH=$T/site NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=16 \
      NVTE_CUDA_ARCHS=90 && setsid nohup bash -c "python3 -m pip install -v --no-index --no-deps --no-build-isolation \
      --no-compile --target $T/ext . > $T/build.log 2>&1; echo rc=\$? >> $T/build.log; date +%s > $T/build.done" \
      >/dev/null 2>&1 < /dev/null & )
fi
if [ "${1:-}" = "--build" ] || [ "${1:-}" = "--wait" ]; then
  t0=$(date +%s); lim=${2:-480}
  while [ -f $T/build.started ] && [ ! -f $T/build.done ] && [ $(( $(date +%s) - t0 )) -lt "$lim" ]; do sleep 5; done
  tail -3 $T/build.log 2>/dev/null
  [ -f $T/build.done ] || { echo "te_device.sh: build still running"; exit 75; }
  echo "te_device.sh: install + build took $(( $(cat $T/build.done) - $(cat $T/build.started) )) s"
  cp -r $T/ext/. $T/site/ 2>/dev/null
  PYTHONPATH=$T/site python3 -c "import torch, transformer_engine.pytorch as te; from importlib.metadata import version; \
print('te_device.sh: transformer_engine', version('transformer-engine'), 'imports; torch', torch.__version__)" || exit 1
fi
exit 0
