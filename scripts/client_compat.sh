#!/usr/bin/env bash
# The real agent clients against strata, one after the other, with the same small task that needs one tool
# call; prints a table: connected, turns, tool calls made / executed, final answer, cached tokens on turn 2.
#
#   bash scripts/client_compat.sh [--clients codex,claude,opencode,llm] [--port 8190] [--model smollm2]
#                                 [--tool-call-format generic_json]
#
# Each client is installed at run time into a scratch folder (npm or pip; never committed) by its own script
# in scripts/clients/NAME.sh PORT WORKDIR, whose last line is "RESULT tool_calls=N executed=N answer=...".
# Turns and cached tokens come from the server's own per-request log lines (JSON log format).
set -euo pipefail
cd "$(dirname "$0")/.."

clients="codex,claude,opencode,llm"
port=8190
model=smollm2
# generic_json (llama.cpp's generic format): SmolLM2-135M never opens a call when a plain answer is allowed as
# its first token; with every reply JSON it calls, and answers after the result (docs/CLIENTS.md).
tool_format=generic_json
while [ $# -gt 0 ]; do
  case "$1" in
    --clients) clients="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --tool-call-format) tool_format="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

scratch="${CLIENT_COMPAT_DIR:-$(mktemp -d /tmp/strata-clients.XXXXXX)}"
mkdir -p "$scratch"
log="$scratch/server.log"
# Agents' system prompts and tool lists are 10K-25K tokens: a 32K context, a small host tier. Codex and
# Claude Code send no output limit; a 135M model that rambles would write 20K+ tokens, so 512 by default.
# Codex sends no temperature either: 0 by default here, so a run can be repeated token for token.
.venv/bin/strata serve --model "$model" --port "$port" --ctx-size 32768 --batch 2 \
  --conversation-cache-mib 512 --default-max-tokens "${DEFAULT_MAX_TOKENS:-512}" \
  --tool-call-format "$tool_format" --default-temperature "${DEFAULT_TEMPERATURE:-0}" --log-format json >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 1
done

rows="$scratch/rows.tsv"
: >"$rows"
IFS=',' read -ra names <<<"$clients"
for name in "${names[@]}"; do
  work="$scratch/$name"
  mkdir -p "$work"
  echo "hello from the scratch folder" >"$work/hello.txt"
  start_line=$(wc -l <"$log")
  started=$(date +%s)
  status=0
  timeout "${CLIENT_TIMEOUT_S:-1500}" bash "scripts/clients/$name.sh" "$port" "$work" >"$work/out.txt" 2>&1 || status=$?
  seconds=$(( $(date +%s) - started ))
  result=$(grep '^RESULT ' "$work/out.txt" | tail -1 || true)
  if [ -z "$result" ] && [ -f "scripts/clients/summarize.py" ] && [ "$name" != llm ]; then
    # Killed by the timeout before it printed its line: read the events it had written so far.
    result=$(python3 scripts/clients/summarize.py "$name" <"$work/out.txt" | tail -1)
  fi
  tail -n +"$((start_line + 1))" "$log" >"$work/server.log"
  .venv/bin/python - "$name" "$status" "$seconds" "$result" "$work/server.log" >>"$rows" <<'PY'
import json, re, sys
name, status, seconds, result, log_path = sys.argv[1:]
turns = []
for line in open(log_path, encoding="utf-8", errors="replace"):
    try:
        record = json.loads(line)
    except ValueError:
        continue
    if record.get("logger") == "strata.requests" and "prompt_tokens" in record:
        turns.append(record)
fields = dict(re.findall(r"(\w+)=(\S*)", result.split(" answer=")[0])) if result else {}
answer = result.split(" answer=", 1)[1].strip() if " answer=" in result else ""
second = f"{turns[1]['reused_tokens']} of {turns[1]['prompt_tokens']}" if len(turns) > 1 else "-"
errors = sum(1 for t in turns if t.get("finish_reason") == "error")
row = [name, "yes" if turns else "no", str(len(turns)), fields.get("tool_calls", "?"), fields.get("executed", "?"),
       (answer[:40] or "-").replace("\t", " "), second, f"exit {status}, {errors} engine errors, {seconds} s"]
print("\t".join(row))
PY
done

printf '\n| client | connected | turns | tool calls | executed | final answer | cached on turn 2 | errors |\n'
printf '| --- | --- | ---: | ---: | ---: | --- | --- | --- |\n'
while IFS=$'\t' read -r c connected turns calls executed answer second errors; do
  printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' "$c" "$connected" "$turns" "$calls" "$executed" "$answer" \
    "$second" "$errors"
done <"$rows"
echo "logs: $scratch"
