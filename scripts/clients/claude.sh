#!/usr/bin/env bash
# Claude Code, headless, against a strata server: installs @anthropic-ai/claude-code into a scratch prefix (never
# into the repo), runs one task in WORKDIR and prints its stream-json event log,
# then a "RESULT tool_calls=N executed=N answer=..." line.
#
#   scripts/clients/claude.sh PORT WORKDIR ["TASK"]
#
# Without a TASK, WORKDIR gets a hello.txt when it has none (the default task reads it). Environment:
#   CLAUDE_CODE_VERSION (default latest)   CLAUDE_PREFIX (npm prefix, default a fresh temp dir)
#   STRATA_MODEL (default: the first id of GET /v1/models)
#   CLAUDE_CODE_MAX_OUTPUT_TOKENS (default 256: Claude Code asks for 32000, which a small model on a CPU
#   would spend rambling)   CLAUDE_EXTRA_ARGS (more claude flags, e.g. "--tools Read")
#   CLAUDE_STREAM_IDLE_TIMEOUT_MS and API_TIMEOUT_MS (default 2 h: Claude Code gives up on a stream after 5-10 min without an
#   event its SDK shows it, and the SDK drops pings, so a long prefill on a CPU counts as idle)
#   CLAUDE_CODE_EXTRA_BODY (JSON merged into every request, e.g. '{"temperature": 0}': Claude Code sends none)
#   CLAUDE_CODE_AUTO_COMPACT_WINDOW (default the server's max_model_len: Claude Code assumes a huge window for
#   a model it does not know)
set -euo pipefail
PORT=${1:?usage: claude.sh PORT WORKDIR [TASK]}
WORKDIR=$(cd "${2:?usage: claude.sh PORT WORKDIR [TASK]}" && pwd)
TASK=${3:-"Use the Read tool to read hello.txt, then tell me what it says."}
BASE=http://127.0.0.1:$PORT
HERE=$(cd "$(dirname "$0")" && pwd)

CARD=$(curl -sf "$BASE/v1/models" |
  python3 -c 'import json, sys; m = json.load(sys.stdin)["data"][0]; print(m["id"], m.get("max_model_len", ""))')
MODEL=${STRATA_MODEL:-${CARD% *}}
CONTEXT=${CARD#* }
PREFIX=${CLAUDE_PREFIX:-$(mktemp -d /tmp/strata-claude.XXXXXX)}
if [ ! -x "$PREFIX/node_modules/.bin/claude" ]; then
  npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error \
    "@anthropic-ai/claude-code@${CLAUDE_CODE_VERSION:-latest}" >&2
fi
CLAUDE=$PREFIX/node_modules/.bin/claude
# npm >= 11 may skip the postinstall that puts the native binary in place of the stub: run it by hand.
if ! "$CLAUDE" --version >/dev/null 2>&1; then
  (cd "$PREFIX/node_modules/@anthropic-ai/claude-code" && node install.cjs) >&2
fi
echo "claude $("$CLAUDE" --version) -> $BASE, model $MODEL, workdir $WORKDIR" >&2

[ $# -ge 3 ] || [ -e "$WORKDIR/hello.txt" ] || echo "The secret word is pineapple." > "$WORKDIR/hello.txt"
mkdir -p "$PREFIX/config"
# Claude Code refuses --dangerously-skip-permissions as root unless told it runs in a sandbox (containers, CI).
SANDBOX=$([ "$(id -u)" = 0 ] && echo 1 || echo "${IS_SANDBOX:-}")
cd "$WORKDIR"
# CLAUDE_CONFIG_DIR keeps Claude Code's settings and transcripts out of the user's ~/.claude.
# CLAUDE_CODE_ATTRIBUTION_HEADER=0 would stop the per-request billing line; the server drops it anyway.
# ${CLAUDE_EXTRA_ARGS} is split on spaces on purpose (several flags).
# shellcheck disable=SC2086
env CLAUDE_CONFIG_DIR="$PREFIX/config" IS_SANDBOX="$SANDBOX" \
  ANTHROPIC_BASE_URL="$BASE" ANTHROPIC_AUTH_TOKEN="${STRATA_API_KEY:-x}" \
  ANTHROPIC_MODEL="$MODEL" ANTHROPIC_DEFAULT_HAIKU_MODEL="$MODEL" \
  CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 \
  CLAUDE_CODE_MAX_OUTPUT_TOKENS="${CLAUDE_CODE_MAX_OUTPUT_TOKENS:-256}" \
  API_TIMEOUT_MS="${API_TIMEOUT_MS:-7200000}" \
  CLAUDE_STREAM_IDLE_TIMEOUT_MS="${CLAUDE_STREAM_IDLE_TIMEOUT_MS:-7200000}" \
  CLAUDE_CODE_AUTO_COMPACT_WINDOW="${CLAUDE_CODE_AUTO_COMPACT_WINDOW:-$CONTEXT}" \
  "$CLAUDE" -p "$TASK" --output-format stream-json --verbose --dangerously-skip-permissions ${CLAUDE_EXTRA_ARGS:-} |
  python3 "$HERE/summarize.py" claude
