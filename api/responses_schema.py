"""POST /v1/responses bodies, and their translation into the dialect-free ``ChatTurn``.

The Responses API carries a conversation as *items* rather than messages. The translation, per item:

    message (user / assistant / system / developer)   -> a message of that role (developer -> system)
    reasoning                                         -> reasoning_content of the next assistant message
    function_call / custom_tool_call                  -> a tool call of that assistant message
    function_call_output / custom_tool_call_output    -> a tool message
    anything else (web_search_call, item_reference..) -> left out, with a log line naming the type

Consecutive assistant-side items (reasoning, an assistant message, calls) are ONE assistant message: that is
how the model produced them, so the history re-renders byte-identically and the next turn reuses the whole
cached prefix (the check in tests/test_responses_api.py). ``instructions`` and the leading system /
developer messages become one system message, since many chat templates accept only one, at the start.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import Field, ValidationError, field_validator

from api.chat_turn import ChatTurn
from api.errors import bad_request
from api.schemas_base import ChatMessage, RequestBody
from api.tool_specs import CUSTOM_INPUT_ARGUMENT, normalise_tools

log = logging.getLogger("strata.api")

TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
ASSISTANT_SIDE = ("reasoning", "function_call", "custom_tool_call")


class ResponsesRequest(RequestBody):
    """Body of POST /v1/responses. Fields we cannot act on (``include``, ``truncation``, ``service_tier``,
    ``background``, ``user``, ``client_metadata``) are accepted and ignored, as OpenAI clients send them."""

    model: str | None = None  # None: the served model (vLLM's rule; OpenAI's document makes it optional)
    input: str | list[Any] = Field(default_factory=list)
    instructions: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: the format's default (true but for generic_json)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**64)  # not OpenAI's; llama-server and vLLM take it
    prompt_cache_key: str | None = None
    store: bool = True  # OpenAI's default; Codex sends false
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    include: list[Any] | None = None
    stream: bool = False

    def requested_sampling(self) -> dict[str, Any]:
        """The body's sampling fields, None where left out (api/sampling_defaults.sampling_for)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or an object")
        return value

    @property
    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` in the chat shape ChatTurn takes; raises APIError for a format we cannot honour."""
        fmt = (self.text or {}).get("format")
        if not fmt:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema" and isinstance(fmt.get("schema", {}), dict):
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                           "schema": fmt.get("schema") or {},
                                                           "strict": fmt.get("strict", True) is not False}}
        raise bad_request("text.format must be {'type': 'text'}, {'type': 'json_object'} or "
                          "{'type': 'json_schema', 'name': ..., 'schema': {...}}", param="text.format")

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)


def part_text(content: Any, where: str) -> str | None:
    """A content string or list of parts as one string (text parts joined with "\\n", as chat content is);
    images, files and audio are left out with a log line. None when there is no content at all."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PART_TYPES and isinstance(part.get("text", part.get("refusal")), str):
            texts.append(part.get("text", part.get("refusal")))
        else:
            log.info("%s: content part of type %r left out (only text is supported)", where, kind,
                     extra={"fields": {"part_type": kind}})
    return "\n".join(texts)


def _call(call_id: Any, name: Any, arguments: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where} needs a name", param=f"{where}.name")
    return {"id": call_id if isinstance(call_id, str) else "", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else "{}"}}


def _custom_arguments(text: Any) -> str:
    """A custom call's freeform input back as the one-argument JSON the model wrote it in."""
    return json.dumps({CUSTOM_INPUT_ARGUMENT: text if isinstance(text, str) else ""}, ensure_ascii=False)


class _History:
    """Accumulates chat-shape messages from items, merging assistant-side items into one message."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.assistant: dict[str, Any] | None = None  # the assistant message being built

    def flush(self) -> None:
        if self.assistant is not None:
            self.messages.append(self.assistant)
            self.assistant = None

    def open_assistant(self, fresh: bool) -> dict[str, Any]:
        if fresh or self.assistant is None:
            self.flush()
            self.assistant = {"role": "assistant", "content": None}
        return self.assistant

    def add(self, index: int, item: Any) -> None:
        where = f"input.{index}"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role, text = item.get("role"), part_text(item.get("content"), where)
            if role == "assistant":
                current = self.assistant
                # A message after calls or text of its own starts a new assistant turn; after reasoning it is
                # that turn's answer.
                fresh = current is not None and (current.get("content") is not None or "tool_calls" in current)
                self.open_assistant(fresh)["content"] = text or ""
                return
            if role not in ("user", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer", param=f"{where}.role")
            self.flush()
            self.messages.append({"role": "system" if role == "developer" else role, "content": text or ""})
        elif kind == "reasoning":
            text = part_text(item.get("content"), where) or part_text(item.get("summary"), where) or ""
            current = self.assistant
            fresh = current is not None and (current.get("content") is not None or "tool_calls" in current)
            message = self.open_assistant(fresh)
            if text:
                message["reasoning_content"] = (message.get("reasoning_content", "") + text)
        elif kind in ("function_call", "custom_tool_call"):
            arguments = item.get("arguments") if kind == "function_call" else _custom_arguments(item.get("input"))
            call = _call(item.get("call_id"), item.get("name"), arguments, where)
            self.open_assistant(False).setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self.flush()
            output = part_text(item.get("output"), where) or ""
            self.messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": output})
        else:
            log.info("%s: item of type %r left out of the prompt (no chat equivalent)", where, kind,
                     extra={"fields": {"item_type": kind}})


def _validated(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Through the same ChatMessage model chat completions uses, so both render a history identically."""
    out = []
    for index, message in enumerate(messages):
        try:
            out.append(ChatMessage.model_validate(message).as_template_dict())
        except ValidationError as exc:
            raise bad_request(f"input: message {index} is not valid: {exc.errors()[0]['msg']}", param="input") from None
    return out


def items_to_messages(instructions: str | None, items: list[Any]) -> list[dict[str, Any]]:
    """Template messages for ``instructions`` plus a list of Responses items (see the module docstring)."""
    history = _History()
    for index, item in enumerate(items):
        history.add(index, item)
    history.flush()
    messages = history.messages
    head = [instructions] if instructions else []
    while messages and messages[0]["role"] == "system":
        head.append(messages.pop(0)["content"])
    if head:
        messages.insert(0, {"role": "system", "content": "\n\n".join(head)})
    if not messages:
        raise bad_request("input must not be empty", param="input")
    return _validated(messages)


def _choice(value: Any) -> Any:
    """Responses-only tool_choice forms mapped to what normalise_tools takes."""
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        return value.get("mode", "auto")  # the subset is not enforced; the mode is
    if isinstance(value, dict) and value.get("type") not in ("function", "custom", "auto", "none", "required"):
        log.info("tool_choice of type %r names a built-in tool, which is not offered; using 'auto'", value.get("type"))
        return "auto"
    return value


def turn_from_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatTurn:
    """The ChatTurn of a request whose conversation is ``history`` (stored items, for previous_response_id)
    followed by its own input items."""
    instructions = body.instructions if isinstance(body.instructions, str) else None
    leading = body.instructions if isinstance(body.instructions, list) else []  # instructions given as items
    items = leading + history + body.input_items()
    specs = normalise_tools(body.tools, _choice(body.tool_choice), body.parallel_tool_calls)
    kwargs: dict[str, Any] = {}
    effort = (body.reasoning or {}).get("effort")
    if isinstance(effort, str):
        kwargs["reasoning_effort"] = effort
    return ChatTurn(items_to_messages(instructions, items), specs, body.response_format, kwargs,
                    conversation_key=body.prompt_cache_key)
