"""Request bodies of the OpenAI-style routes (and the tokenizer routes), validated with pydantic.

Import everything from here: the shared pieces (``RequestBody``, ``ChatMessage``, ``parse_body``,
``usage_dict``) live in ``api.schemas_base`` and are re-exported. Besides the conventions described
there (extra fields ignored, null = default, strict types), fields we cannot honour are rejected by name
rather than silently dropped: ``n`` != 1, a ``response_format`` type other than text / json_object /
json_schema, a non-empty ``logit_bias``, for chat the legacy ``functions`` / ``function_call`` (use ``tools``
/ ``tool_choice``), and for completions ``best_of`` != 1 and ``suffix``. Harmless hints (``store``,
``metadata``, ``service_tier``, ``verbosity``, ``user``) are accepted and ignored.

The tokenizer routes' and the device-pool route's bodies live in ``api.schemas_utility`` and are
re-exported here.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from api.errors import bad_request
from api.schemas_base import ChatMessage, Messages, RequestBody, parse_body, usage_dict
from api.schemas_utility import ApplyTemplateRequest, DetokenizeRequest, DevicePoolRequest, TokenizeRequest

__all__ = [
    "ApplyTemplateRequest", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "DetokenizeRequest",
    "DevicePoolRequest", "Messages", "RequestBody", "SamplingFields", "StreamOptions", "TokenizeRequest", "parse_body",
    "usage_dict",
]

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # chat completions
MAX_LEGACY_LOGPROBS = 5  # completions: `logprobs` is itself the number of alternatives
TOOL_CHOICE_MODES = ("none", "auto", "required")


class StreamOptions(RequestBody):
    """``stream_options``: whether the last SSE chunk carries ``usage``."""

    include_usage: bool = False


class SamplingFields(RequestBody):
    """Fields common to chat and text completions: model, sampling, stop strings, streaming."""

    model: str
    # None (here and in the sampling fields below): the model's default (api/sampling_defaults.py)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # vLLM's extension; 1: off
    seed: int | None = Field(default=None, ge=-1, lt=2**64)  # -1: unset (llama.cpp's "random")
    stop: tuple[str, ...] = ()  # a string or a list of strings in the body
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None  # ignored unless stream is true
    user: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None  # requests with different salts never share cached KV (vLLM's field)
    ignore_eos: bool = False  # vLLM extension
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (through the grammar)
    logit_bias: dict[str, Any] | None = None  # only {} is accepted

    @field_validator("response_format", mode="before")
    @classmethod
    def _check_response_format(cls, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise ValueError("response_format must be an object like {'type': 'json_object'}")
        kind = value.get("type")
        if kind in ("text", "json_object"):
            return value
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("type 'json_schema' needs json_schema: {name, schema: {...}, strict?}")
            return value
        raise ValueError(f"type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise ValueError("logit_bias must be an object mapping token ids to biases")
        if value:
            raise ValueError("not supported yet; omit logit_bias (or send an empty object)")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> tuple[str, ...]:
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return tuple(stops)

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def requested_sampling(self) -> dict[str, Any]:
        """The body's sampling fields under SamplingParams' names, None where left out (seed -1 and top_k
        -1 are llama.cpp's "unset" and "off"), for api/sampling_defaults.sampling_for."""
        return {"temperature": self.temperature, "top_k": None if self.top_k is None else max(0, self.top_k),
                "top_p": self.top_p, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "seed": None if self.seed == -1 else self.seed, "stop": self.stop, "ignore_eos": self.ignore_eos}


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


class ChatCompletionRequest(SamplingFields):
    """Body of POST /v1/chat/completions."""

    messages: Messages
    tools: list[dict[str, Any]] | None = None  # normalised by api/tool_specs.py (non-function tools included)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: the format's default (true but for generic_json)
    reasoning_effort: str | None = None  # passed to the chat template (gpt-oss, Qwen3 variants read it)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True  # llama-server / vLLM extension
    chat_template_kwargs: dict[str, Any] | None = None  # llama-server / vLLM extension
    functions: Any = None  # legacy OpenAI function calling: always refused, pointing at tools
    function_call: Any = None

    @field_validator("functions", "function_call", mode="before")
    @classmethod
    def _refuse_legacy_functions(cls, value: Any, info: ValidationInfo) -> Any:
        modern = "tools" if info.field_name == "functions" else "tool_choice"
        raise ValueError(f"the legacy form of function calling is not supported; send {modern} instead")

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> str | dict[str, Any]:
        if not isinstance(value, dict) and value not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or an object")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int, info: ValidationInfo) -> int:
        if not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's limit (max_completion_tokens, else max_tokens), or None when it set neither."""
        return _default(self.max_completion_tokens, self.max_tokens)

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them."""
        return [message.as_template_dict() for message in self.messages]

    def top_logprobs_count(self) -> int | None:
        """Alternatives to report per token: None without ``logprobs``, else ``top_logprobs`` (default 0)."""
        return _default(self.top_logprobs, 0) if self.logprobs else None


def _single_prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("prompt must be a string or a non-empty list of token ids")
    if all(isinstance(item, (str, list)) for item in value):
        if len(value) > 1:
            raise ValueError("only one prompt per request is supported")
        return _single_prompt(value[0]) if isinstance(value[0], str) else _token_ids(value[0])
    return _token_ids(value)


def _token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError("a token-id prompt must be a non-empty list of integers")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError("prompt token ids must be integers >= 0")
    return value


class CompletionRequest(SamplingFields):
    """Body of POST /v1/completions. ``prompt`` is normalised to one string or one list of token ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)  # 16 like OpenAI
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LEGACY_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> str | list[int]:
        return _single_prompt(value)

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: str) -> str:
        raise ValueError("suffix is not supported")

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only best_of=1 is supported")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's limit (OpenAI's default of 16 when it sent none)."""
        return self.max_tokens

    def prompt_ids_or_text(self) -> str | list[int]:
        """The one prompt: text to tokenize, or token ids to use as they are."""
        return self.prompt

    def top_logprobs_count(self) -> int | None:
        """Alternatives to report per token: the legacy ``logprobs`` integer, None when absent."""
        return self.logprobs

