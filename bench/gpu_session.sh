#!/usr/bin/env bash
# One device session's checks, in order: build the C++ extension (timed), then each step named on the
# command line: native (the native runtime's GPU tests), gpu (every GPU test), host (the host-cost table),
# e2e:<e2e.py arguments joined by +> (end-to-end rows, merged into a copy of bench/results/e2e.json).
# Everything lands in $OUT (the device tool's folder), the last lines of each step on stdout.
# Run it as `BENCH_REVISION=$(git rev-parse --short HEAD) bash bench/gpu_session.sh ...`: the copy of the tree
# on the device may carry an older .git, and the result files name the revision they measured.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CONVTUNE_CACHE_DIR=/tmp/convtune-cache CONVTUNE_EXTENSION_DIR=/tmp/convtune-ext CONVTUNE_PROGRESS=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
python3 -m convtune.cli native --json 2>&1 | tee "$OUT/native.json"
for step in "$@"; do
  case "$step" in
    native) python3 -m pytest -q -rP -p no:cacheprovider tests/gpu/test_gpu_native.py 2>&1 | tee "$OUT/gpu_native.txt" | tail -25 ;;
    gpu) python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25 ;;
    host) python3 bench/tuning_cost.py --layers 1 --out "$OUT" --name tuning_cost_native 2>&1 | tail -40 ;;
    e2e:*) cp bench/results/e2e.json "$OUT/" 2>/dev/null; args=${step#e2e:}
           python3 bench/e2e.py ${args//+/ } --out "$OUT" --name e2e 2>&1 | tail -30 ;;
  esac
done
