#!/usr/bin/env bash
# `llm` (pip) against a running strata server, on chat completions, with two Python tools on WORKDIR's files.
#
#   scripts/clients/llm.sh PORT WORKDIR [TASK]
#
# Installs llm into LLM_VENV (default WORKDIR/llm-venv) at run time (never into the repo), registers the
# served model (the first id of GET /v1/models, or STRATA_MODEL) in its extra-openai-models.yaml, and runs
# TASK in WORKDIR with the tools read_file and write_file. Sends no temperature and no max_tokens (the
# server's defaults apply, as for a user who sets none). Prints llm's tool-debug output; the last line is
# "RESULT tool_calls=N executed=N answer=..." for scripts/client_compat.sh.
set -euo pipefail
PORT=${1:?usage: llm.sh PORT WORKDIR [TASK]}
WORKDIR=$(mkdir -p "${2:?usage: llm.sh PORT WORKDIR [TASK]}" && cd "$2" && pwd)
TASK=${3:-"Read hello.txt and tell me what it says."}
[ $# -ge 3 ] || [ -e "$WORKDIR/hello.txt" ] || echo "The meeting is at 3pm." > "$WORKDIR/hello.txt"
BASE=http://127.0.0.1:$PORT/v1
VENV=${LLM_VENV:-$WORKDIR/llm-venv}
[ -x "$VENV/bin/llm" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install --quiet llm; }
for _ in $(seq 120); do curl -fsS "$BASE/models" >/dev/null 2>&1 && break; sleep 1; done
MODEL=${STRATA_MODEL:-$(curl -fsS "$BASE/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')}
export LLM_USER_PATH="$VENV/llm-home"
mkdir -p "$LLM_USER_PATH"
# supports_tools / supports_schema: llm sends tools and json_schema only to models that say they take them.
cat > "$LLM_USER_PATH/extra-openai-models.yaml" <<YAML
- model_id: strata
  model_name: $MODEL
  api_base: "$BASE"
  supports_tools: true
  supports_schema: true
YAML
echo "llm $("$VENV/bin/llm" --version) -> $BASE, model $MODEL, workdir $WORKDIR" >&2
# TOOL_EXECUTED goes to stderr, which is folded into the output below: a call llm ran to its end.
functions='
import pathlib, sys

def read_file(path: str) -> str:
    "Return the text of the file at this path (relative to the working folder)."
    text = pathlib.Path(path).read_text()
    print("TOOL_EXECUTED read_file", path, file=sys.stderr, flush=True)
    return text

def write_file(path: str, content: str) -> str:
    "Create or replace the file at this path (relative to the working folder) with this content."
    pathlib.Path(path).write_text(content)
    print("TOOL_EXECUTED write_file", path, file=sys.stderr, flush=True)
    return f"wrote {len(content)} characters to {path}"
'
cd "$WORKDIR"
out=$("$VENV/bin/llm" -m strata --functions "$functions" --td "$TASK" </dev/null 2>&1) || true
echo "$out"
calls=$(grep -c "^Tool call: " <<<"$out" || true)
executed=$(grep -c "^TOOL_EXECUTED" <<<"$out" || true)
# The answer: what follows the last tool call's result (its lines indented by two spaces), newlines folded.
answer=$(grep -v "^TOOL_EXECUTED" <<<"$out" | python3 -c '
import sys
lines = sys.stdin.read().splitlines()
calls = [i for i, line in enumerate(lines) if line.startswith("Tool call: ")]
rest = lines[calls[-1] + 1:] if calls else lines
while rest and (rest[0].startswith("  ") or not rest[0].strip()):
    rest = rest[1:]
print(" ".join(" ".join(rest).split())[:200])')
echo "RESULT tool_calls=$calls executed=$executed answer=$answer"
