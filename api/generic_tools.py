"""The generic tool format's side of the prompt: for templates that do not render ``tools`` (SmolLM2, Gemma 3).

The server describes the tools in the system prompt (the text comes from the format itself) and the model
calls tools with JSON, ``{"tool_calls": [...]}``, or answers in plain text. The history must then be written
the way such a model would have produced and read it: an assistant turn that called tools becomes the JSON
of those calls (in the layout the grammar generates), a plain answer stays as it is, and tool results become user turns
of plain text (templates like Gemma's accept only user/assistant turns, alternating), consecutive results joined in one.
Every rewrite is a pure function of the history, so the rendered prefix stays byte-identical turn after turn.
"""
from __future__ import annotations

import json
from typing import Any


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    return {"name": function.get("name", ""), "arguments": function.get("arguments", {})}


def _result_text(content: Any) -> str:
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else _dumps(content)


def _results_message(results: list[dict[str, Any]], names_by_id: dict[str, str]) -> str:
    """Consecutive tool results as one user turn of plain text, each under the name of the tool that made it.

    Plain text, not JSON: SmolLM2-135M, shown its call and then the result as ``{"tool_results": [...]}``,
    repeats the call (P(answer) 0.06 at the reply's first choice); shown "Result of read_file:" and the text,
    with the closing request, it answers (0.76-0.95). Measured with ``/v1/completions`` logprobs.
    """
    parts = []
    for message in results:
        name = message.get("name") or names_by_id.get(message.get("tool_call_id") or "")
        parts.append(f"Result of {name}:\n" if name else "Tool result:\n")
        parts[-1] += _result_text(message.get("content") or "").rstrip("\n")
    ask = "this result" if len(results) == 1 else "these results"
    return "\n\n".join(parts) + f"\n\nNow answer my request with {ask}."


def rewrite_history(messages: list[dict[str, Any]], system_prompt: str, *,
                    json_answers: bool = False) -> list[dict[str, Any]]:
    """Template dicts for a generic-format model: the tool description joined to the first system message
    (or a system message of its own), tool calls and results written as the JSON the format uses, and with
    `json_answers` (generic_json) a plain assistant answer as the ``{"response": ...}`` it was sampled as."""
    out: list[dict[str, Any]] = []
    names_by_id: dict[str, str] = {}
    pending_results: list[dict[str, Any]] = []

    def flush_results() -> None:
        if pending_results:
            out.append({"role": "user", "content": _results_message(pending_results, names_by_id)})
            pending_results.clear()

    for message in messages:
        role = message["role"]
        if role == "tool":
            pending_results.append(message)
            continue
        flush_results()
        if role == "assistant" and message.get("tool_calls"):
            for call in message["tool_calls"]:
                if call.get("id"):
                    names_by_id[call["id"]] = (call.get("function") or {}).get("name", "")
            content = _dumps({"tool_calls": [_call_json(c) for c in message["tool_calls"]]})
            out.append({"role": "assistant", "content": content})
        elif role == "assistant" and json_answers and isinstance(message.get("content"), str) and message["content"]:
            out.append({"role": "assistant", "content": _dumps({"response": message["content"]})})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    flush_results()
    if out and out[0]["role"] in ("system", "developer"):
        first = out[0]
        out[0] = {**first, "role": "system", "content": ((first.get("content") or "") + "\n\n" + system_prompt).strip()}
    else:
        out.insert(0, {"role": "system", "content": system_prompt})
    return out
