#!/usr/bin/env bash
# `llm` (pip) against a running strata server, on chat completions with one Python tool.
# Usage: scripts/clients/llm.sh PORT WORKDIR   (installs llm into WORKDIR/llm-venv at run time; never committed)
# Prints llm's tool-debug output; the last line is "RESULT tool_calls=N executed=N answer=..." for the table.
set -euo pipefail
port="$1"; work="$2"
mkdir -p "$work"
[ -x "$work/llm-venv/bin/llm" ] || { python3 -m venv "$work/llm-venv" && "$work/llm-venv/bin/pip" install --quiet llm; }
export LLM_USER_PATH="$work/llm-home"
mkdir -p "$LLM_USER_PATH"
# supports_tools / supports_schema: llm sends tools and json_schema only to models that say they take them.
cat > "$LLM_USER_PATH/extra-openai-models.yaml" <<YAML
- model_id: strata
  model_name: smollm2
  api_base: "http://127.0.0.1:$port/v1"
  supports_tools: true
  supports_schema: true
YAML
functions='
def read_note(name: str) -> str:
    "Read the note with this name and return its text."
    print("TOOL_EXECUTED read_note", name, flush=True)
    return "The note says: the meeting is at 3pm."
'
# --cl 3: a call, the answer after it, one spare (llm 0.36 reports "Chain limit of 2 exceeded" after a
# finished call-then-answer chain at --cl 2; a 135M model must not call again and again)
out=$("$work/llm-venv/bin/llm" -m strata --functions "$functions" --td --cl 3 -o temperature 0 -o max_tokens 200 \
      "Use the read_note tool to read the note named meeting, then tell me what it says." </dev/null 2>&1) || true
echo "$out"
calls=$(grep -c "^Tool call: read_note" <<<"$out" || true)
executed=$(grep -c "^TOOL_EXECUTED" <<<"$out" || true)
answer=$(grep -v -e "^Tool call" -e "^TOOL_EXECUTED" -e "^  " <<<"$out" | tr '\n' ' ' | cut -c1-80)
echo "RESULT tool_calls=$calls executed=$executed answer=$answer"
