"""Shared pieces of the request bodies: the strict base model, chat messages, and ``parse_body``.

Conventions shared by every body (``RequestBody``):
- unknown fields are ignored (clients send many we do not use), and each is logged once per process by name
  (``ignored_fields``), so a field a client counted on is never dropped without a trace;
- ``null`` means "use the default", as in the OpenAI API;
- types are strict, as in OpenAI's JSON schema: ``"0.7"`` is not a number, ``true`` is not 1; NaN and
  infinities are refused.
Every failure surfaces as an ``APIError`` 400 naming the field (see ``api.errors.from_validation_error``).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import logging

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo
from pydantic import field_validator, model_validator

from api.errors import bad_request, from_validation_error

log = logging.getLogger("strata.api")
_MAX_LOGGED_FIELDS = 256  # distinct (body, field) pairs logged per process: a fuzzer's random keys stop there
_logged_fields: set[tuple[str, str]] = set()


class RequestBody(BaseModel):
    """Base of every request body: extra fields ignored, strict types, finite floats, null = default."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


def _check_text_part(index: int, part: Any) -> str:
    if not isinstance(part, dict):
        raise ValueError(f"content part {index} must be an object like {{'type': 'text', 'text': '...'}}")
    if part.get("type") != "text":
        raise ValueError(f"content part {index} has type {part.get('type')!r}; only 'text' parts are supported")
    if not isinstance(part.get("text"), str):
        raise ValueError(f"content part {index} needs a string 'text'")
    return part["text"]


class ChatMessage(RequestBody):
    """One message of a conversation. ``content`` is a string, a list of text parts, or null
    (assistant messages only: a reply that was only tool calls)."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    tool_calls: list[dict[str, Any]] | None = None  # to the template with arguments as a mapping
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # llama-server / vLLM extension; Qwen3-style templates read it
    content: str | list[dict[str, Any]] | None = Field(default=None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            if info.data.get("role") == "assistant":
                return None
            raise ValueError("content is required (only assistant messages may omit it)")
        if isinstance(value, list):
            for index, part in enumerate(value):
                _check_text_part(index, part)
            return value
        if not isinstance(value, str):
            raise ValueError("content must be a string or a list of text parts")
        return value

    @property
    def text(self) -> str | None:
        """The content as one string: text parts joined with "\\n" (as llama.cpp and vLLM do); None stays None."""
        if isinstance(self.content, list):
            return "\n".join(part["text"] for part in self.content)
        return self.content

    def as_template_dict(self) -> dict[str, Any]:
        """The dict the chat template sees: role, flattened content, and the optional fields that are set."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        for key in ("name", "tool_call_id", "reasoning_content"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.tool_calls:
            out["tool_calls"] = [_template_tool_call(call) for call in self.tool_calls]
        return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A history tool call in the shape HF chat templates read: ``arguments`` as a mapping (clients send the
    OpenAI JSON string; templates apply ``tojson`` to it), the rest as sent. Parsing is deterministic, so the
    same history renders byte-identically every turn; arguments that are not JSON stay a string."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments) if arguments.strip() else {}
        except orjson.JSONDecodeError:
            parsed = arguments
        function["arguments"] = parsed
    return {**call, "type": call.get("type", "function"), "function": function}


def _check_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    if not messages:
        raise ValueError("messages must not be empty")
    return messages


# The type of every request field that carries a conversation.
Messages = Annotated[list[ChatMessage], AfterValidator(_check_messages)]


Body = TypeVar("Body", bound=BaseModel)


def parse_body(model_cls: type[Body], raw: bytes) -> Body:
    """Decode (strict UTF-8), parse (orjson) and validate a request body; any failure is an APIError 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (bad byte at offset {exc.start})") from None
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        kind = "an array" if isinstance(data, list) else "null" if data is None else f"a {type(data).__name__}"
        raise bad_request(f"request body must be a JSON object, not {kind}")
    try:
        body = model_cls.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    _log_ignored(model_cls, data)
    return body


def ignored_fields(model_cls: type[BaseModel], data: dict[str, Any]) -> list[str]:
    """The top-level keys of ``data`` that ``model_cls`` has no field for (so validation dropped them)."""
    return sorted(key for key in data if key not in model_cls.model_fields)


def _log_ignored(model_cls: type[BaseModel], data: dict[str, Any]) -> None:
    fresh = [name for name in ignored_fields(model_cls, data) if (model_cls.__name__, name) not in _logged_fields]
    fresh = fresh[:max(0, _MAX_LOGGED_FIELDS - len(_logged_fields))]
    if fresh:
        _logged_fields.update((model_cls.__name__, name) for name in fresh)
        shown = [name[:64] for name in fresh]
        log.info("%s: ignoring fields this server does not use: %s (logged once per field)", model_cls.__name__,
                 ", ".join(shown), extra={"fields": {"ignored_fields": shown}})


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``usage`` object; ``cached_tokens`` is the part of the prompt that was reused, not recomputed."""
    assert 0 <= cached_tokens <= prompt_tokens, (cached_tokens, prompt_tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
