#!/usr/bin/env bash
# opencode, headless, against a strata server on chat completions (its AI SDK provider
# @ai-sdk/openai-compatible): installs opencode-ai into a scratch prefix (never into the repo), runs one task
# in WORKDIR and prints its JSON event log, then a "RESULT tool_calls=N executed=N answer=..." line.
#
#   scripts/clients/opencode.sh PORT WORKDIR ["TASK"]
#
# Environment: OPENCODE_VERSION (default latest), OPENCODE_PREFIX (npm prefix, default a fresh temp dir),
# STRATA_MODEL (default: the first id of GET /v1/models).
set -euo pipefail
PORT=${1:?usage: opencode.sh PORT WORKDIR [TASK]}
WORKDIR=$(cd "${2:?usage: opencode.sh PORT WORKDIR [TASK]}" && pwd)
TASK=${3:-"Use the read tool to read hello.txt, then tell me what it says."}
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=http://127.0.0.1:$PORT/v1
for _ in $(seq 120); do curl -fsS "$BASE/models" >/dev/null 2>&1 && break; sleep 1; done
MODEL=${STRATA_MODEL:-$(curl -fsS "$BASE/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')}
PREFIX=${OPENCODE_PREFIX:-$(mktemp -d /tmp/strata-opencode.XXXXXX)}
if [ ! -x "$PREFIX/npm/node_modules/.bin/opencode" ]; then
  npm install --prefix "$PREFIX/npm" --no-audit --no-fund --loglevel=error "opencode-ai@${OPENCODE_VERSION:-latest}" >&2
fi
OPENCODE=$PREFIX/npm/node_modules/.bin/opencode
echo "opencode $("$OPENCODE" --version) -> $BASE, model $MODEL, workdir $WORKDIR" >&2
[ $# -ge 3 ] || [ -e "$WORKDIR/hello.txt" ] || echo "The secret word is pineapple." > "$WORKDIR/hello.txt"
# A private HOME / XDG tree keeps opencode's auth, sessions and caches out of the user's own.
# Timeouts off: opencode gives a request 5 min by default (timeout, headerTimeout) and 15 min between streamed
# chunks (chunkTimeout), and a CPU server reading its ~7K-token first prompt sends no chunk for longer than that
# (chat completions stream nothing during prefill).
mkdir -p "$PREFIX/home"
CONFIG=$(python3 -c 'import json, sys; base, model = sys.argv[1:]; print(json.dumps({
    "$schema": "https://opencode.ai/config.json",
    "provider": {"strata": {"npm": "@ai-sdk/openai-compatible", "name": "strata",
                            "options": {"baseURL": base, "timeout": False, "headerTimeout": False,
                                        "chunkTimeout": False},
                            "models": {model: {"name": model}}}},
    "model": f"strata/{model}", "autoupdate": False, "share": "disabled"}))' "$BASE" "$MODEL")
cd "$WORKDIR"
env HOME="$PREFIX/home" XDG_CONFIG_HOME="$PREFIX/home/.config" XDG_DATA_HOME="$PREFIX/home/.local/share" \
  XDG_CACHE_HOME="$PREFIX/home/.cache" OPENCODE_DISABLE_MODELS_FETCH=1 OPENCODE_DISABLE_AUTOUPDATE=1 \
  OPENCODE_CONFIG_CONTENT="$CONFIG" \
  "$OPENCODE" run --format json "$TASK" </dev/null | python3 "$HERE/summarize.py" opencode
