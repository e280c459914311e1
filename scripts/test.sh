#!/usr/bin/env bash
# Runs the whole test suite on a fresh clone: sets up .venv and the default model first (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The dashboard's browser test (tests/test_dashboard.py) renders the page in headless Chromium, Debian's package;
# without it (not root, no apt) that one test is skipped and says why.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
    >/dev/null 2>&1 || echo "test.sh: chromium could not be installed; the dashboard's browser test is skipped" >&2
fi
# The models the tests load, each warmed (strata pull compiles its kernels into numba's disk cache, so the test
# workers read them from there instead of each compiling them): SmolLM2, the tests' small model; Gemma 3 270M,
# for the SentencePiece tokenizer, the fallback template and the gemma3 model path; Qwen2.5-Coder 0.5B, which
# setup.sh pulled and warmed as the default model (named here because tests load it whatever the default is).
.venv/bin/strata pull smollm2 >/dev/null
.venv/bin/strata pull gemma3-270m >/dev/null
.venv/bin/strata pull qwen2.5-coder-0.5b --no-warm >/dev/null
# Over every core (pytest-xdist): one process ran the suite on one of CI's two cores, 19-20 minutes; two, 12.
exec .venv/bin/python -m pytest -q -n "${STRATA_TEST_WORKERS:-auto}" "$@"
