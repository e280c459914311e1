"""Anthropic Messages API bodies (POST /v1/messages, /v1/messages/count_tokens) translated into a ``ChatTurn``.

The translation is a pure function of the body, so the same history renders to the
same prompt bytes turn after turn and the conversation cache keeps matching:

    system (string or text blocks)        -> one system message; Claude Code's per-request
                                             ``x-anthropic-billing-header:`` line is dropped
    a ``system`` message in ``messages``  -> (Claude Code 2.1.3xx sends its environment that way, after the
                                             first user message) a system turn where it stands if the template
                                             renders one there (ChatML, Qwen, Llama 3); else (Gemma's insists
                                             on alternating user/assistant) its text joins the user turn before
                                             it; first of all: part of the system prompt
    user text blocks                      -> a user message
    user tool_result blocks               -> one ``tool`` message each (before the user text of that message)
    assistant text / tool_use / thinking  -> content / tool_calls (arguments = input) / reasoning_content
    image / document blocks               -> 400 naming the block type (the engine is text only)
    tools with input_schema               -> function tools; server tools (web_search_*, bash_*) left out,
                                             and so are defer_loading tools until a tool_result's
                                             ``tool_reference`` block (Anthropic's tool search) loads them
    tool_choice auto|any|tool|none        -> auto | required | the named function | none
    thinking enabled|adaptive|disabled    -> template kwarg enable_thinking
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from pydantic import Field

from api.chat_turn import ChatTurn
from api.errors import bad_request
from api.schemas import RequestBody
from api.tool_specs import normalise_tools

log = logging.getLogger("strata.api")
BILLING_HEADER = "x-anthropic-billing-header:"
MAX_STOP_SEQUENCES = 16
_UNSUPPORTED_MEDIA = ("image", "document")
_logged_once: set[str] = set()  # what was worth one log line per process (dropped header, skipped tools)


def _log_once(key: str, message: str, *args: Any) -> None:
    if key not in _logged_once:
        _logged_once.add(key)
        log.info(message, *args)


class CountTokensRequest(RequestBody):
    """The fields that decide the prompt: body of POST /v1/messages/count_tokens."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """Body of POST /v1/messages: the prompt fields plus the reply's budget and sampling."""

    max_tokens: int = Field(ge=0)  # required, as in Anthropic's API; 0 only reads the prompt into the cache
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range; None: the model's default
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False

    def requested_sampling(self) -> dict[str, Any]:
        """The body's sampling fields, None where left out (api/sampling_defaults.sampling_for)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "stop": tuple(self.stop_sequences or ())}


def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    """The system prompt as one string (text blocks joined by newlines), without the billing header line."""
    if system is None:
        return None
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system
    parts = []
    for index, block in enumerate(blocks):
        text = _text_of(block, f"system.{index}")
        if text.startswith(BILLING_HEADER):
            # Its value changes per request in some Claude Code versions: kept, it would make every turn's
            # prompt differ from the first token on and nothing would ever be reused from the cache.
            _log_once("billing", "dropping Claude Code's %r system line from the prompt so the conversation "
                      "stays cached (CLAUDE_CODE_ATTRIBUTION_HEADER=0 stops Claude Code sending it)", BILLING_HEADER)
            text = text.partition("\n")[2]
            if not text:
                continue
        parts.append(text)
    return "\n".join(parts) if parts else None


def _text_of(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise bad_request(f"{where}: expected a text block {{'type': 'text', 'text': '...'}}, got {kind!r}",
                          param=where)
    return block["text"]


def _refuse_media(kind: Any, where: str) -> None:
    if kind in _UNSUPPORTED_MEDIA:
        raise bad_request(f"{where}: {kind!r} content blocks are not supported: this server's model reads text "
                          f"only; send the {kind} as text or leave it out", param=where)


def _tool_result_text(block: dict[str, Any], where: str, loaded: set[str]) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            _refuse_media(kind, f"{where}.content.{index}")
            if kind == "tool_reference" and isinstance(part.get("tool_name"), str):
                loaded.add(part["tool_name"])  # tool search found it: from now on it is offered
                texts.append(f"Tool {part['tool_name']} is now available.")
                continue
            texts.append(_text_of(part, f"{where}.content.{index}"))
        text = "\n".join(texts)
    else:
        raise bad_request(f"{where}.content must be a string or a list of text blocks", param=f"{where}.content")
    return "Error: " + text if block.get("is_error") else text


def _user_messages(content: list[dict[str, Any]], where: str, names: Mapping[str, str],
                   loaded: set[str]) -> list[dict[str, Any]]:
    """Tool results first (one ``tool`` message each, as chat templates expect them after the call), then the
    message's text as one user message."""
    results, texts = [], []
    for index, block in enumerate(content):
        path = f"{where}.{index}"
        kind = block.get("type") if isinstance(block, dict) else None
        _refuse_media(kind, path)
        if kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{path}: a tool_result needs its tool_use_id", param=f"{path}.tool_use_id")
            message = {"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, path, loaded)}
            if call_id in names:
                message["name"] = names[call_id]
            results.append(message)
        elif kind == "text":
            texts.append(_text_of(block, path))
        else:
            _log_once(f"user-block:{kind}", "a user %r content block has no text form; it is left out", kind)
    if texts or not results:
        results.append({"role": "user", "content": "\n".join(texts)})
    return results


def _assistant_message(content: list[dict[str, Any]], where: str, names: dict[str, str]) -> dict[str, Any]:
    texts, thinking, calls = [], [], []
    for index, block in enumerate(content):
        path = f"{where}.{index}"
        kind = block.get("type") if isinstance(block, dict) else None
        _refuse_media(kind, path)
        if kind == "text":
            texts.append(_text_of(block, path))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking") or ""))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not name:
                raise bad_request(f"{path}: a tool_use block needs an id and a name", param=path)
            # A mapping, as chat templates (and the generic format) read arguments: the same object comes back
            # every turn, so it renders to the same bytes the model produced.
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
            names[call_id] = name
        elif kind != "redacted_thinking":  # encrypted by Anthropic: nothing a local model can read
            _log_once(f"assistant-block:{kind}", "an assistant %r content block has no text form; it is left out",
                      kind)
    text = "\n".join(texts)
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def template_messages(system: Any, messages: list[dict[str, Any]], loaded: set[str] | None = None,
                      system_turns: bool = True) -> list[dict[str, Any]]:
    """The conversation as chat-template messages (see the module docstring); the names of the deferred
    tools that tool results loaded are added to ``loaded``. ``system_turns``: whether the template renders
    a system turn after others (else such a message joins the user turn before it)."""
    out: list[dict[str, Any]] = []
    text = system_text(system)
    if text is not None:
        out.append({"role": "system", "content": text})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer it
    loaded = set() if loaded is None else loaded
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}",
                              param=f"{where}.role")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of content blocks",
                              param=f"{where}.content")
        if role == "assistant":
            out.append(_assistant_message(content, f"{where}.content", names))
            continue
        if role == "system":
            text = system_text(content)
            if text is None:
                continue
            if all(m["role"] == "system" for m in out):  # nothing but system text so far: the system prompt
                out[:] = [{"role": "system", "content": "\n".join([m["content"] for m in out] + [text])}]
                continue
            turns = [{"role": "system" if system_turns else "user", "content": text}]
        else:
            turns = _user_messages(content, f"{where}.content", names, loaded)
        for turn in turns:
            if turn["role"] == "user" and out and out[-1]["role"] == "user":
                # Anthropic combines consecutive user turns; templates that insist on alternating turns
                # (Gemma's) would refuse them.
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + turn["content"]}
            else:
                out.append(turn)
    return out


def function_tools(tools: list[dict[str, Any]] | None, loaded: set[str] = frozenset()) -> list[dict[str, Any]]:
    """Client tools (those with an input_schema) as OpenAI function tools; Anthropic's server tools
    (web_search_20250305, bash_20250124, ...) have no schema here to render and are left out, and so are
    ``defer_loading`` tools whose name is not in ``loaded`` (Anthropic keeps them out of the context until
    tool search returns a reference to them)."""
    out = []
    for index, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise bad_request(f"tools.{index} must be an object", param=f"tools.{index}")
        schema, name = tool.get("input_schema"), tool.get("name")
        if tool.get("defer_loading") and name not in loaded:
            _log_once(f"deferred:{name}", "tool %r has defer_loading; it is left out until a tool_result's "
                      "tool_reference loads it", name)
            continue
        if isinstance(schema, dict) and isinstance(name, str) and name:
            function = {"name": name, "parameters": schema}
            if tool.get("description"):
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
        else:
            kind = tool.get("type", "?")
            _log_once(f"tool:{kind}:{name}", "tool %r of type %r has no input_schema (an Anthropic server tool); it "
                      "is left out of the prompt", name, kind)
    return out


def tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool]:
    """(the chat-completions tool_choice, parallel_tool_calls) of an Anthropic tool_choice."""
    if choice is None:
        return None, None
    # absent: the format's default (Anthropic's is parallel; generic_json's, as llama.cpp's, one call)
    parallel = None if "disable_parallel_tool_use" not in choice else not choice["disable_parallel_tool_use"]
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                      param="tool_choice")


def thinking_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """Template variables for ``thinking``: Qwen3-style templates read ``enable_thinking``."""
    kind = (thinking or {}).get("type")
    if kind in ("enabled", "adaptive"):
        return {"enable_thinking": True}
    if kind == "disabled":
        return {"enable_thinking": False}
    return {}


def chat_turn(body: CountTokensRequest, conversation_key: str | None = None, system_turns: bool = True) -> ChatTurn:
    """The dialect-free turn of a Messages body (``system_turns``: see ``template_messages``). Raises
    APIError 400."""
    choice, parallel = tool_choice(body.tool_choice)
    loaded: set[str] = set()
    messages = template_messages(body.system, body.messages, loaded, system_turns)
    specs = normalise_tools(function_tools(body.tools, loaded), choice, parallel)
    return ChatTurn(messages, specs,
                    template_kwargs=thinking_kwargs(body.thinking),
                    conversation_key=conversation_key)
