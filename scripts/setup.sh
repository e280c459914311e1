#!/usr/bin/env bash
# Sets up a fresh clone: a .venv in the repo root with strata installed (editable, with the test and cuda
# extras: NVRTC compiles the CUDA kernels on any machine, GPU or not, so CI checks them), and the default
# model (engine/model_store.default_model_name: what `strata serve` serves without --model) fetched into
# $STRATA_HOME (default ~/.cache/strata) with its CPU kernels compiled into numba's disk cache (strata pull's
# warm-up), so that the first `strata serve` is ready in seconds instead of compiling. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "setup: strata needs Python >= 3.11; $PYTHON is $("$PYTHON" --version 2>&1). Set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Reinstall only when pyproject.toml changed since the last successful install.
stamp=.venv/.strata-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet -e '.[test,cuda]'
  touch "$stamp"
fi
.venv/bin/strata pull >/dev/null
