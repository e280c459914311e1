#!/usr/bin/env bash
# Runs the whole test suite on a fresh clone: sets up .venv and the default model first (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Gemma 3 270M exercises the SentencePiece tokenizer, the fallback template and the gemma3 model path.
.venv/bin/strata pull gemma3-270m >/dev/null
# Over every core (pytest-xdist): one process ran the suite on one of CI's two cores, 19-20 minutes; two, 12.
exec .venv/bin/python -m pytest -q -n "${STRATA_TEST_WORKERS:-auto}" "$@"
