#!/usr/bin/env bash
# Installs SGLang's router (PyPI `sglang-router`, a Rust binary in an abi3 wheel) into its own venv, apart
# from strata's: it brings fastapi/aiohttp that strata does not use. Safe to run again (pip skips what is
# installed). Prints the router venv's python on its last line; exits non-zero when the wheel cannot be had
# (no network, no wheel for this platform), which the router test turns into a skip.
#   ROUTER_VENV   where the venv goes (default: .venv-router in the repo root)
#   ROUTER_SPEC   the requirement (default: the 0.3 line, whose probes and policies docs/DEPLOY.md describes)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUTER_VENV="${ROUTER_VENV:-.venv-router}"
ROUTER_SPEC="${ROUTER_SPEC:-sglang-router>=0.3.2,<0.4}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$ROUTER_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$ROUTER_VENV" >&2
fi
if ! "$ROUTER_VENV/bin/python" -c 'import sglang_router.sglang_router_rs' 2>/dev/null; then
  "$ROUTER_VENV/bin/python" -m pip install --quiet --disable-pip-version-check --retries 2 --timeout 30 \
    "$ROUTER_SPEC" >&2
fi
"$ROUTER_VENV/bin/python" -c 'import sglang_router.sglang_router_rs' >&2
echo "$(cd "$ROUTER_VENV" && pwd)/bin/python"
