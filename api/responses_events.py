"""The Responses API's output: the streamed events of one response and the whole Response object.

``ResponseWriter`` turns the parsed reply (``ParsedDelta``s from api/chat_output.py) into OpenAI's event
sequence, in the order OpenAI sends it::

    response.created, response.in_progress
    per output item:  response.output_item.added
        reasoning:      content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
        message:        content_part.added, output_text.delta...,    output_text.done,    content_part.done
        function_call:  function_call_arguments.delta..., function_call_arguments.done
        custom_tool_call: (its input is known once the call is complete)
                    response.output_item.done (the complete item)
    response.completed | response.incomplete | response.failed (the whole Response)

Every event carries ``type`` and ``sequence_number``. A whole (non-streaming) response is built by the
same calls with the events dropped, so the two can never disagree.
"""
from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from api.chat_output import custom_tool_input
from api.tool_calls import ParsedDelta
from scheduler.request import Usage


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage_object(usage: Usage | None, reasoning_tokens: int = 0) -> dict[str, Any] | None:
    """``usage`` as Codex reads it; cached_tokens is the exact count of prompt tokens reused from the cache."""
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "total_tokens": usage.total_tokens}


def _copy(value: Any) -> Any:
    return orjson.loads(orjson.dumps(value))  # events must not share the dicts still being built


class ResponseWriter:
    """Builds one response: ``start()``, then ``feed(parsed)`` per parse result, then ``finish(...)``; each
    returns the events to send. ``response`` is the Response object as it stands."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any], custom_tool_names: frozenset[str]):
        self.custom_tool_names = custom_tool_names
        self.response: dict[str, Any] = {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "completed_at": None, "error": None, "incomplete_details": None, "model": model, "output": [],
            "usage": None, **echo}
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the output item being streamed
        self._calls: dict[int, dict[str, Any]] = {}  # parser call index -> its output item
        self._arguments: dict[str, str] = {}  # call item id -> arguments so far (custom calls: until done)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **_copy(fields)}
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def keepalive(self) -> dict[str, Any]:
        """OpenAI's heartbeat while nothing else is sent (a long prefill): Codex's idle timer counts events."""
        return self._event("keepalive")

    # -- items -----------------------------------------------------------------------------------------

    def _add_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.response["output"].append(item)
        self._open = item
        events.append(self._event("response.output_item.added", output_index=len(self.response["output"]) - 1,
                                  item=item))
        return events

    def _open_text_item(self, kind: str) -> list[dict[str, Any]]:
        """A new message (output_text) or reasoning (reasoning_text) item with its one content part."""
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item, part = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}, \
                {"type": "reasoning_text", "text": ""}
        events = self._add_item(item)
        item["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                  content_index=0, part=part))
        return events

    def _index(self) -> int:
        return len(self.response["output"]) - 1  # the open item is always the last one

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._open_text_item(kind)
        item = self._open
        item["content"][0]["text"] += text
        delta_type, extra = (("response.output_text.delta", {"logprobs": []}) if kind == "message"
                             else ("response.reasoning_text.delta", {}))
        events.append(self._event(delta_type, item_id=item["id"], output_index=self._index(), content_index=0,
                                  delta=text, **extra))
        return events

    def _call_delta(self, delta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._calls.get(delta.index)
        if item is None:  # the parser sends a call's id and name on its first fragment
            if delta.name in self.custom_tool_names:
                item = {"id": new_id("ctc"), "type": "custom_tool_call", "status": "in_progress",
                        "call_id": delta.id, "name": delta.name, "input": ""}
            else:
                item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": delta.id,
                        "name": delta.name, "arguments": ""}
            self._calls[delta.index] = item
            self._arguments[item["id"]] = ""
            events += self._add_item(item)
        self._arguments[item["id"]] += delta.arguments
        if delta.arguments and item["type"] == "function_call":
            item["arguments"] = self._arguments[item["id"]]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._index(), delta=delta.arguments))
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Events that complete the open item (``status`` "incomplete": it was cut off by max_output_tokens)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, events = self._index(), []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done, extra = (("response.output_text.done", {"logprobs": []}) if item["type"] == "message"
                           else ("response.reasoning_text.done", {}))
            events += [self._event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                                   **extra),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)]
        elif item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
        else:
            item["input"] = custom_tool_input(self._arguments[item["id"]])
        if item["type"] != "reasoning":
            item["status"] = status
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def feed(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        """Events for one parse result: reasoning, then content, then call fragments, as the parser orders them."""
        events: list[dict[str, Any]] = []
        if parsed.reasoning:
            events += self._text("reasoning", parsed.reasoning)
        if parsed.content:
            events += self._text("message", parsed.content)
        for delta in parsed.tool_calls:
            events += self._call_delta(delta)
        return events

    # -- the end ---------------------------------------------------------------------------------------

    def finish(self, status: str, usage: Usage | None = None, reasoning_tokens: int = 0,
               error: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Close the open item and end the response: status "completed", "incomplete" (the reply hit
        max_output_tokens) or "failed" (``error`` = {code, message})."""
        events = self._close("incomplete" if status == "incomplete" else "completed")
        if status != "failed" and not self.response["output"]:  # an empty reply is still one (empty) message
            events += self._open_text_item("message") + self._close()
        self.response.update(status=status, usage=usage_object(usage, reasoning_tokens), error=error)
        if status == "completed":
            self.response["completed_at"] = int(time.time())
        elif status == "incomplete":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        events.append(self._event(f"response.{status}", response=self.response))
        return events
