#!/usr/bin/env bash
# Run the real Codex CLI against a strata server, headless, and print its JSON event log.
#
#   scripts/clients/codex.sh PORT WORKDIR [TASK]
#
# Installs @openai/codex with npm into a scratch prefix at run time (never into the repo), writes
# $CODEX_HOME/config.toml for a provider at http://127.0.0.1:PORT/v1 speaking the Responses API, and runs
# `codex exec` in WORKDIR (created if missing; with a hello.txt for the default task, which needs one tool call).
# Its JSON events are echoed, then a "RESULT tool_calls=N executed=N answer=..." line.
# Environment: CODEX_VERSION (default latest), CODEX_SCRATCH (default a new temp dir),
# CODEX_USE_CATALOG=1 to give Codex the server's model catalog (GET /v1/models, key "models"): the context
# window, and strata's short base instructions in place of Codex's ~10K-token prompt.
set -euo pipefail

PORT=${1:?usage: codex.sh PORT WORKDIR [TASK]}
WORKDIR=${2:?usage: codex.sh PORT WORKDIR [TASK]}
TASK=${3:-'Use the exec_command tool to run `cat hello.txt`, then tell me what it says.'}
SCRATCH=${CODEX_SCRATCH:-$(mktemp -d -t strata-codex.XXXXXX)}
BASE="http://127.0.0.1:$PORT/v1"
HERE=$(cd "$(dirname "$0")" && pwd)

if [ ! -x "$SCRATCH/npm/node_modules/.bin/codex" ]; then
  npm install --prefix "$SCRATCH/npm" --no-audit --no-fund --loglevel=error "@openai/codex@${CODEX_VERSION:-latest}" >&2
fi
CODEX="$SCRATCH/npm/node_modules/.bin/codex"
echo "codex: $("$CODEX" --version) in $SCRATCH" >&2

for _ in $(seq 120); do curl -fsS "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break; sleep 1; done
# The served model's name and context window, from the server itself.
read -r MODEL CTX < <(curl -fsS "$BASE/models" | python3 -c \
  'import json, sys; card = json.load(sys.stdin)["data"][0]; print(card["id"], card["max_model_len"])')

export CODEX_HOME="$SCRATCH/home"
mkdir -p "$CODEX_HOME" "$WORKDIR"
[ $# -ge 3 ] || [ -e "$WORKDIR/hello.txt" ] || echo "hello from strata" > "$WORKDIR/hello.txt"
CATALOG=""
if [ "${CODEX_USE_CATALOG:-0}" = 1 ]; then
  curl -fsS "$BASE/models" > "$CODEX_HOME/catalog.json"
  CATALOG="model_catalog_json = \"$CODEX_HOME/catalog.json\""
fi
# stream_idle_timeout_ms: a CPU server prefilling Codex's prompt sends only keepalives for minutes.
cat > "$CODEX_HOME/config.toml" <<TOML
model = "$MODEL"
model_provider = "local"
model_context_window = $CTX
$CATALOG

[model_providers.local]
name = "local"
base_url = "$BASE"
wire_api = "responses"
stream_idle_timeout_ms = 900000
request_max_retries = 1
stream_max_retries = 1
TOML

cd "$WORKDIR"
# stderr too: the calls Codex refuses before running them are only logged there (summarize.py counts them).
"$CODEX" exec --skip-git-repo-check --ephemeral --json -s workspace-write "$TASK" < /dev/null 2>&1 |
  python3 "$HERE/summarize.py" codex
