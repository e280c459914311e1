"""The tasks scripts/client_compat.sh gives each agent client, their checks, and its table.

    python3 compat_report.py setup TASK WORKDIR          # writes TASK's files into WORKDIR, prints its prompt
    python3 compat_report.py row CLIENT TASK WORKDIR OUT SERVER_LOG EXIT SECONDS   # one JSON line
    python3 compat_report.py table RUNS_JSONL            # the markdown table and one line per run

A task passes on what the client left behind, not on what it says about itself: the answer names the
launch code, code.txt holds the code, or sum.txt holds the sum. Turns and reuse come from the server's per-request JSON log lines
(logger strata.requests: prompt_tokens, reused_tokens, tools, finish_reason) of the run's own slice of the
log. A turn is a request that carried tools and was not aborted; requests without tools (opencode's title
request) are side requests, and one the client gave up on (then sent again) is counted apart, its reuse shown.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys

NUMBERS = (14, 23, 8, 41)
TASKS = {
    "note": {
        "title": "one-step: read note.txt, answer",
        "files": {"note.txt": "The launch code is 7481-ZETA.\n"},
        "prompt": "What is the launch code in note.txt? Read the file and answer with the code.",
    },
    "code": {
        "title": "two-step: read note.txt, write code.txt",
        "files": {"note.txt": "The launch code is 7481-ZETA.\n"},
        "prompt": "note.txt holds a launch code. Read the file, then write just the launch code into a new file "
                  "code.txt.",
    },
    "sum": {
        "title": "two-step: read numbers.txt, write sum.txt",
        "files": {"numbers.txt": "".join(f"{n}\n" for n in NUMBERS)},
        "prompt": "numbers.txt holds one integer per line. Read it, add the numbers up, and write their sum "
                  "(just the number) into a new file sum.txt.",
    },
}
REUSE_BAR = 0.9


def setup(task: str, workdir: str) -> None:
    root = pathlib.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    for name, text in TASKS[task]["files"].items():
        (root / name).write_text(text)
    print(TASKS[task]["prompt"])


def check(task: str, workdir: pathlib.Path, answer: str) -> tuple[bool, str]:
    """Whether the task was done, and what was found."""
    if task == "note":
        return "7481-ZETA" in answer, f"answer: {answer[:60]!r}"
    name, wanted = ("code.txt", "7481-ZETA") if task == "code" else ("sum.txt", str(sum(NUMBERS)))
    written = workdir / name
    if not written.exists():
        return False, f"no {name}"
    text = written.read_text(errors="replace")
    return text.strip() == wanted, f"{name}: {text[:30]!r}"


def server_turns(log_path: str) -> dict:
    requests, side, errors = [], 0, 0
    for line in open(log_path, encoding="utf-8", errors="replace"):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("logger") != "strata.requests" or "prompt_tokens" not in record:
            continue
        errors += record.get("finish_reason") == "error"
        if record.get("tools", 0) > 0:
            requests.append([record["reused_tokens"], record["prompt_tokens"], record.get("generated_tokens", 0),
                             record.get("finish_reason") == "abort"])
        else:
            side += 1
    return {"turns": requests, "side_requests": side, "engine_errors": errors}


def client_result(out_path: str) -> dict:
    lines = [ln for ln in open(out_path, encoding="utf-8", errors="replace") if ln.startswith("RESULT ")]
    if not lines:
        return {"calls": None, "executed": None, "answer": ""}
    head, _, answer = lines[-1].rstrip("\n").partition(" answer=")
    fields = dict(re.findall(r"(\w+)=(\S*)", head))
    return {"calls": int(fields.get("tool_calls", 0)), "executed": int(fields.get("executed", 0)),
            "answer": answer.strip()}


def row(client, task, workdir, out_path, log_path, status, seconds) -> None:
    result = client_result(out_path)
    passed, found = check(task, pathlib.Path(workdir), result["answer"])
    print(json.dumps({"client": client, "task": task, "passed": passed, "found": found, **result,
                      **server_turns(log_path), "exit": int(status), "seconds": int(seconds)}))


def reuse_note(turns: list, index: int) -> str:
    """Why a later turn reused under 90% of its prompt: it reused an earlier prompt whole (the new tokens, a tool
    result and the reply re-rendered, are over a tenth of a short prompt), or it is the conversation's first
    turn (after side requests of the client's own, such as Claude Code's short ones with tools; what it reused
    came from earlier runs)."""
    reused, prompt = turns[index][0], turns[index][1]
    if reused >= REUSE_BAR * prompt:
        return ""
    if all(earlier < prompt / 2 for _, earlier, _, _ in turns[:index]):
        return " (the conversation's first turn)"
    whole = [earlier for _, earlier, _, _ in turns[:index] if earlier - 1 <= reused]  # the last token is re-read
    if whole and max(whole) >= prompt / 2:
        return f" (<90%: all {max(whole)} of the earlier prompt)"
    return " (<90%)"


def reuse_cell(turns: list) -> str:
    if len(turns) < 2:
        return "-"
    parts = [f"{turns[i][0]}/{turns[i][1]}" + reuse_note(turns, i) + (" (aborted)" if turns[i][3] else "")
             for i in range(1, len(turns))]
    return ", ".join(parts)


def turn_count(run: dict) -> str:
    aborted = sum(1 for turn in run["turns"] if turn[3])
    return (f"{len(run['turns']) - aborted}" + (f" (+{aborted} aborted)" if aborted else "") +
            (f" (+{run['side_requests']} side)" if run["side_requests"] else ""))


def task_cell(run: dict | None) -> str:
    if run is None:
        return "not run"
    return ("pass" if run["passed"] else "FAIL") + f" ({run['found']})".replace("|", "\\|")


def table(runs_path: str) -> None:
    runs = [json.loads(ln) for ln in open(runs_path) if ln.strip()]
    clients = list(dict.fromkeys(r["client"] for r in runs))
    by_key = {(r["client"], r["task"]): r for r in runs}
    heads = [f"{name}: {TASKS[name]['title']}" for name in TASKS]
    print("| client | " + " | ".join(heads) + " | tool calls made/executed | turns | reuse of each later turn"
          " (reused/prompt tokens) | exit, time |")
    print("| --- | " + " | ".join("---" for _ in TASKS) + " | --- | --- | --- | --- |")
    for client in clients:
        mine = [(name, by_key.get((client, name))) for name in TASKS]
        done = [(name, run) for name, run in mine if run is not None]
        calls = "; ".join(f"{name} {run['calls']}/{run['executed']}" for name, run in done)
        turns = "; ".join(f"{name} {turn_count(run)}" for name, run in done)
        reuse = "; ".join(f"{name} {reuse_cell(run['turns'])}" for name, run in done)
        ends = "; ".join(f"{name} exit {run['exit']}, {run['seconds']} s" + (
            f", {run['engine_errors']} engine errors" if run["engine_errors"] else "") for name, run in done)
        print(f"| {client} | " + " | ".join(task_cell(run) for _, run in mine) +
              f" | {calls} | {turns} | {reuse} | {ends} |")
    print()
    for run in runs:
        first = run["turns"][0] if run["turns"] else None
        print(f"- {run['client']} {run['task']}: first turn {first[1] if first else '-'} prompt tokens"
              f" ({first[0] if first else '-'} reused from earlier runs){recomputed(run['turns'])};"
              f" answer: {run['answer'][:160]!r}")


def recomputed(turns: list) -> str:
    """What each later turn read again of the turn before it (its prompt and reply): the reply's tokens when it
    re-renders differently from how the model wrote it (a recovered call comes back as template markup)."""
    # An aborted request's reply never reached the client, so its retry can only reuse the prompt.
    again = [prompt + (0 if aborted else generated) - reused
             for (_, prompt, generated, aborted), (reused, *_) in zip(turns, turns[1:])]
    return f"; recomputed of the previous prompt + reply: {', '.join(map(str, again))}" if again else ""


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    {"setup": setup, "row": row, "table": table}[command](*args)


if __name__ == "__main__":
    main()
