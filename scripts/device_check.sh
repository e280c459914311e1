#!/usr/bin/env bash
# The GPU checks of the CUDA backend, for a machine with a GPU and no network, in under 8 minutes:
# environment, NVRTC build of every kernel, the cuda-marked tests, and the benchmark. Logs go to OUTDIR
# (6 files). Through the device tool, from the repository root, after scripts/fetch_device_wheels.sh here:
#     run(command="scripts/device_check.sh $OUT", carry=[".whl"], timeout_s=540)
# Each step has its own time limit, so a hang in one still leaves the logs of the others.
set -uo pipefail
OUT=${1:?usage: scripts/device_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 STRATA_HOME=${STRATA_HOME:-/tmp/strata-home}
PY=${PYTHON:-python3}
failed=()

if compgen -G ".whl/*.whl" >/dev/null; then
  # The device README's command: the carried wheels into /tmp/site, first on the path.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || failed+=(pip)
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the tree itself, not an installed copy

step() {  # step NAME SECONDS COMMAND...: run with a limit, tee to OUT/NAME.log, remember failures
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($limit s): $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc" | tee -a "$OUT/$name.log"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

{
  date -u
  nvidia-smi || true
  "$PY" - <<'PYEOF'
import sys, numpy
print("python", sys.version.split()[0], "numpy", numpy.__version__)
try:
    import cuda.bindings as cb
    print("cuda-bindings", cb.__version__)
except Exception as exc:
    print("cuda-bindings missing:", exc)
from engine.backends.cuda.device import probe
print("probe:", probe())
PYEOF
} 2>&1 | tee "$OUT/env.log"

if command -v strata >/dev/null; then KERNELS=(strata kernels); else KERNELS=("$PY" -m api.cli kernels); fi
step kernels 120 "${KERNELS[@]}" --check --arch sm_90
# -m cuda selects every GPU variant, among them tests/test_cuda_kv_types.py (f16 / int8 K/V: store, paged and
# split-K attention, block moves, tiny models) and tests/test_cuda_step.py (steps launched from the loop, their
# events awaited, no thread but the event waiter blocking), tests/test_cuda_elastic_pool.py (the elastic K/V pool:
# cuMemAddressReserve / cuMemCreate / cuMemMap chunks, grow / shrink, segment-major kernels), tests/test_cuda_elastic_engine.py
# (seed 002's sequence and the shrink plan's relocations on the CUDA pool)
# and tests/test_cuda_lfm2.py (lfm2's short convolutions and state checkpoints); tests/test_cuda_selection.py
# checks nothing is left out.
step tests 170 "$PY" -m pytest -m cuda -q -p no:cacheprovider -o addopts="" tests/
step bench 190 "$PY" scripts/bench_cuda.py

if [ ${#failed[@]} -eq 0 ]; then
  echo "device check: all steps passed" | tee "$OUT/summary.log"
else
  echo "device check: FAILED steps: ${failed[*]}" | tee "$OUT/summary.log"
  exit 1
fi
