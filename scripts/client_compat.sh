#!/usr/bin/env bash
# The real agent clients against strata, each given up to three tasks: one-step (note: read note.txt, answer with
# the launch code in it) and two-step (code: read note.txt, write the code into code.txt; sum: read numbers.txt,
# write their sum into sum.txt, which also asks the model for arithmetic). Checks each outcome itself and
# prints a table: a column per task, tool calls made / executed, turns, and the reuse of every later turn.
#
#   bash scripts/client_compat.sh [--clients codex,claude,opencode,llm] [--tasks note,code,sum] [--port 8190]
#                                 [--model qwen2.5-coder-0.5b] [--tool-call-format FORMAT]
#
# The server starts as a user would start it: `strata serve --model M` (and the port and --log-format json);
# only smollm2 gets the flags it needs to call tools at all (docs/CLIENTS.md, the SmolLM2 sections).
# Each client is installed at run time (npm or pip; never committed) by scripts/clients/NAME.sh
# PORT WORKDIR TASK into CLIENT_INSTALL_DIR (default SCRATCH/install; reused across runs), whose last line is
# "RESULT tool_calls=N executed=N answer=...". Every run works in the same folder, SCRATCH/work, moved to
# SCRATCH/runs/CLIENT-TASK afterwards, so the clients' prompts (which name their working folder) are the same
# from one task to the next. The tasks and their checks: scripts/clients/compat_report.py. The clients talk to
# the server through scripts/clients/capture_proxy.py on PORT+1, which writes down every request and response
# (SCRATCH/runs/CLIENT-TASK/capture.jsonl: the model's replies, and how each client sent them back).
# Environment: CLIENT_COMPAT_DIR (SCRATCH, default a new temp dir), CLIENT_TIMEOUT_S (per run, default 3600).
set -euo pipefail
cd "$(dirname "$0")/.."

clients="codex,claude,opencode,llm"
tasks="note,code,sum"
port=8190
model=qwen2.5-coder-0.5b
tool_format=""
while [ $# -gt 0 ]; do
  case "$1" in
    --clients) clients="$2"; shift 2 ;;
    --tasks) tasks="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --tool-call-format) tool_format="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

scratch="${CLIENT_COMPAT_DIR:-$(mktemp -d /tmp/strata-clients.XXXXXX)}"
scratch=$(mkdir -p "$scratch" && cd "$scratch" && pwd)
installs="${CLIENT_INSTALL_DIR:-$scratch/install}"
export CODEX_SCRATCH="$installs/codex" CLAUDE_PREFIX="$installs/claude" OPENCODE_PREFIX="$installs/opencode" \
  LLM_VENV="$installs/llm-venv"
report="python3 scripts/clients/compat_report.py"

serve_flags=()
if [ "$model" = smollm2 ]; then
  # SmolLM2-135M never opens a call when a plain answer may start the reply (generic_json makes every reply
  # JSON); trained to 8K, so 32K for the agents' prompts; it rambles, so a reply cap; greedy, repeatable.
  serve_flags=(--ctx-size 32768 --batch 2 --conversation-cache-mib 512 --default-max-tokens 512
               --tool-call-format generic_json --default-temperature 0)
fi
[ -z "$tool_format" ] || serve_flags+=(--tool-call-format "$tool_format")
log="$scratch/server.log"
echo "strata serve --model $model --port $port --log-format json ${serve_flags[*]}" | tee "$scratch/command.txt"
.venv/bin/strata serve --model "$model" --port "$port" --log-format json "${serve_flags[@]}" >>"$log" 2>&1 &
server=$! proxy=""
trap 'kill $server $proxy 2>/dev/null; wait $server $proxy 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "the server exited; its log: $log" >&2; tail -20 "$log" >&2; exit 1; }
  sleep 1
done
capture="$scratch/capture.jsonl" client_port=$((port + 1))
: >"$capture"
.venv/bin/python scripts/clients/capture_proxy.py "$client_port" "$port" "$capture" >>"$scratch/proxy.log" 2>&1 &
proxy=$!
for _ in $(seq 30); do curl -sf "http://127.0.0.1:$client_port/health" >/dev/null && break; sleep 1; done

runs="$scratch/runs.jsonl"
IFS=',' read -ra names <<<"$clients"
IFS=',' read -ra task_names <<<"$tasks"
for name in "${names[@]}"; do
  for task in "${task_names[@]}"; do
    work="$scratch/work" keep="$scratch/runs/$name-$task"
    rm -rf "$work" "$keep"
    mkdir -p "$keep"
    prompt=$($report setup "$task" "$work")
    start_line=$(wc -l <"$log") capture_line=$(wc -l <"$capture")
    started=$(date +%s)
    status=0
    echo "$(date -u +%H:%M:%S) $name $task: $prompt" >&2
    timeout "${CLIENT_TIMEOUT_S:-3600}" bash "scripts/clients/$name.sh" "$client_port" "$work" "$prompt" \
      >"$keep/out.txt" 2>&1 || status=$?
    seconds=$(( $(date +%s) - started ))
    if ! grep -q '^RESULT ' "$keep/out.txt" && [ "$name" != llm ]; then
      # Killed by the timeout before it printed its line: read the events it had written so far.
      python3 scripts/clients/summarize.py "$name" <"$keep/out.txt" | tail -1 >>"$keep/out.txt"
    fi
    tail -n +"$((start_line + 1))" "$log" >"$keep/server.log"
    tail -n +"$((capture_line + 1))" "$capture" >"$keep/capture.jsonl"
    $report row "$name" "$task" "$work" "$keep/out.txt" "$keep/server.log" "$status" "$seconds" | tee -a "$runs" >&2
    mv "$work" "$keep/work"
  done
done

echo
$report table "$runs" | tee "$scratch/table.md"
echo "logs: $scratch"
