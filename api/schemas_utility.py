"""Request bodies of the routes that generate nothing: the tokenizer routes and the device-pool resize.

Tokenizer routes, in both dialects clients use:
- POST /tokenize: vLLM's ``{model?, prompt}`` or ``{model?, messages, tools?, add_generation_prompt?,
  add_special_tokens?}``, or llama-server's ``{content, add_special?, with_pieces?}``.
- POST /detokenize: ``{model?, tokens: [int]}`` (the same in both servers).
- POST /apply-template: llama-server's ``{messages, tools?}``.
The conventions of ``api.schemas_base`` apply (extra fields ignored, null = default, strict types).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from api.errors import bad_request
from api.schemas_base import Messages, RequestBody

TokenizeKind = Literal["prompt", "messages", "content"]


class TokenizeRequest(RequestBody):
    """A tokenize body; exactly one of ``prompt``, ``messages`` or ``content`` is set, and ``kind`` says which."""

    model: str | None = None
    prompt: str | None = None  # vLLM, completion form
    messages: Messages | None = None  # vLLM, chat form: rendered by the chat template first
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True  # vLLM
    content: str | None = None  # llama-server
    add_special: bool = False  # llama-server
    with_pieces: bool = False  # llama-server: answer [{id, piece}] instead of [id]

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        forms = [name for name in ("prompt", "messages", "content") if getattr(self, name) is not None]
        if len(forms) != 1:
            got = " and ".join(forms) or "none of them"
            raise ValueError(f"tokenize takes exactly one of 'prompt', 'messages' or 'content' (got {got})")
        return self

    @property
    def kind(self) -> TokenizeKind:
        """Which form the body used."""
        if self.messages is not None:
            return "messages"
        return "prompt" if self.prompt is not None else "content"

    @property
    def use_special_tokens(self) -> bool:
        """Whether the tokenizer adds BOS/EOS: ``add_special`` (default False, llama-server) for ``content``,
        ``add_special_tokens`` (default True, vLLM) for ``prompt``. For ``messages`` the server should
        encode as a chat completion does, whatever this says."""
        return self.add_special if self.kind == "content" else self.add_special_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (empty for the other forms)."""
        return [message.as_template_dict() for message in self.messages or []]


class DetokenizeRequest(RequestBody):
    """A detokenize body: the ids to turn back into text (range-checked against the vocabulary by the server)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class ApplyTemplateRequest(RequestBody):
    """An apply-template body (llama-server): render the conversation without generating."""

    model: str | None = None
    messages: Messages
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them."""
        return [message.as_template_dict() for message in self.messages]


class DevicePoolRequest(RequestBody):
    """POST /cache/device-pool: the elastic device pool's new ceiling, in MiB or in blocks (one of them)."""

    max_mib: Annotated[float, Field(gt=0)] | None = None
    max_blocks: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> "DevicePoolRequest":
        if (self.max_mib is None) == (self.max_blocks is None):
            raise bad_request('send one of {"max_mib": N} or {"max_blocks": N}', param="max_mib")
        return self
