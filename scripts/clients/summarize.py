"""Reduce a client's JSON event log to the one line scripts/client_compat.sh reads.

    codex exec --json ... | python3 scripts/clients/summarize.py codex
    claude -p --output-format stream-json ... | python3 scripts/clients/summarize.py claude
    opencode run --format json ... | python3 scripts/clients/summarize.py opencode

Every input line is echoed unchanged (the log stays readable), then the last line printed is
"RESULT tool_calls=N executed=N answer=TEXT": calls the model made (Codex: the ones it started plus the ones
it refused), calls the client ran to completion (a result came back without an error), and the client's final
answer, newlines folded.
Lines that are not JSON (progress text) are echoed and otherwise ignored.
"""
from __future__ import annotations

import json
import sys


def codex(event: dict, tally: dict) -> None:
    # codex exec --json: item.started / item.completed with item.type command_execution, agent_message, ...
    item = event.get("item") or {}
    kind = item.get("type")
    if event.get("type") == "item.started" and kind in ("command_execution", "mcp_tool_call", "file_change"):
        tally["calls"] += 1
    elif event.get("type") == "item.completed":
        if kind in ("command_execution", "mcp_tool_call", "file_change"):
            tally["seen"].add(item.get("id"))
            if item.get("status") == "completed" and item.get("exit_code", 0) in (0, None):
                tally["executed"] += 1
        elif kind == "agent_message":
            tally["answer"] = item.get("text", "")


def claude(event: dict, tally: dict) -> None:
    # stream-json: assistant messages carry tool_use blocks, user messages the tool_result blocks.
    content = (event.get("message") or {}).get("content") or []
    blocks = [b for b in content if isinstance(b, dict)]
    if event.get("type") == "assistant":
        tally["calls"] += sum(1 for b in blocks if b.get("type") == "tool_use")
    elif event.get("type") == "user":
        tally["executed"] += sum(1 for b in blocks if b.get("type") == "tool_result" and not b.get("is_error"))
    elif event.get("type") == "result":
        tally["answer"] = str(event.get("result") or event.get("subtype") or "")


def opencode(event: dict, tally: dict) -> None:
    # opencode run --format json: one event per message part; tool parts carry their state.
    part = event.get("part") or {}
    if event.get("type") == "tool_use" or part.get("type") == "tool":
        tally["calls"] += 1
        if (part.get("state") or {}).get("status") == "completed":
            tally["executed"] += 1
    elif event.get("type") == "text" and part.get("text"):
        tally["answer"] = part["text"]


READERS = {"codex": codex, "claude": claude, "opencode": opencode}


def main() -> None:
    reader = READERS[sys.argv[1]]
    tally = {"calls": 0, "executed": 0, "answer": "", "seen": set()}
    for line in sys.stdin:
        sys.stdout.write(line)
        try:
            event = json.loads(line)
        except ValueError:
            # Codex refuses some calls before it runs them (a call asking for escalated permissions under
            # approval policy never) and says so only on stderr, which codex.sh folds into this stream.
            tally["calls"] += "codex_core::tools::router: error=" in line
            continue
        if isinstance(event, dict):
            reader(event, tally)
    # Codex reports a command only when it completes if it never sent item.started: count those too.
    tally["calls"] = max(tally["calls"], len(tally["seen"]))
    answer = " ".join(tally["answer"].split())[:200]
    print(f"RESULT tool_calls={tally['calls']} executed={tally['executed']} answer={answer}", flush=True)


if __name__ == "__main__":
    main()
