"""Chat templates: turn a conversation into the prompt text a model was trained on.

Templates are Jinja2, rendered the way HF transformers' ``apply_chat_template`` does (sandboxed,
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII, ``{% generation %}`` blocks, ``break``/``continue``), because that is the environment
the templates stored in GGUF files were written for.

Like llama.cpp (common/chat.cpp), a leading BOS text (and trailing EOS text) is removed from the
rendered prompt when the tokenizer adds that token itself, so ``Tokenizer.encode(prompt)`` with
``add_special=True`` yields exactly one BOS.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.tokenizer import default_add_bos

log = logging.getLogger("strata.template")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma's turn format (as in the Gemma 3 instruct template): no system role, so a system message is
# prepended to the first user turn; the assistant role is called "model"; contents are trimmed.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = (messages[0]['content'] or '') + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
    {{- (message['content'] or '') | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

_GEMMA_ARCHS = {"gemma", "gemma2", "gemma3", "gemma3n"}


class _GenerationTag(Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    for inference it just renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes and forces ASCII; HF's keeps text as-is.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _flatten(message: dict[str, Any]) -> dict[str, Any]:
    """Copy of ``message`` whose list-of-parts content is joined into one string
    (text parts joined by newlines, other parts dropped, as llama.cpp does)."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = [p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return {**message, "content": "\n".join(texts)}


class ChatTemplate:
    """A compiled chat template plus the special-token texts it is rendered with.

    ``source`` says where the template came from: 'gguf', 'fallback:gemma', 'fallback:chatml'
    or 'file:PATH'.
    """

    def __init__(self, template: str, source: str, bos_token: str = "", eos_token: str = "",
                 strip_bos: bool = False, strip_eos: bool = False):
        self.template = template
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.strip_bos = strip_bos
        self.strip_eos = strip_eos
        try:
            self._compiled = _make_env().from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template ({source}) does not compile: {exc}") from exc

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], arch: str, override_path: str | None = None) -> "ChatTemplate":
        """Template from ``override_path`` if given, else 'tokenizer.chat_template', else the family
        fallback (Gemma turns for Gemma archs, ChatML otherwise, logged). BOS/EOS texts and whether
        to strip them come from the tokenizer.ggml.* keys."""
        tokens = fields.get("tokenizer.ggml.tokens") or []

        def token_text(key: str) -> str:
            tid = fields.get(key)
            return tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else ""

        if override_path is not None:
            text, source = Path(override_path).read_text(encoding="utf-8"), f"file:{override_path}"
        elif fields.get("tokenizer.chat_template"):
            text, source = str(fields["tokenizer.chat_template"]), "gguf"
        else:
            gemma = arch in _GEMMA_ARCHS
            text = GEMMA_TEMPLATE if gemma else CHATML_TEMPLATE
            source = "fallback:gemma" if gemma else "fallback:chatml"
            log.warning("GGUF has no tokenizer.chat_template; using the built-in %s template for arch %r",
                        source.split(":")[1], arch)
        return cls(
            text, source,
            bos_token=token_text("tokenizer.ggml.bos_token_id"),
            eos_token=token_text("tokenizer.ggml.eos_token_id"),
            strip_bos=default_add_bos(fields),
            strip_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        )

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        """Prompt text for ``messages`` (OpenAI-style dicts). ``tools`` is passed only when given;
        ``extra`` variables (e.g. enable_thinking) are visible to the template. Any template error
        (including ``raise_exception``) is raised as ValueError."""
        context = dict(extra)
        context.update(messages=[_flatten(m) for m in messages], add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token)
        if tools is not None:
            context["tools"] = tools
        try:
            out = self._compiled.render(**context)
        except Exception as exc:  # templates are untrusted code: any failure is a bad request
            raise ValueError(f"chat template ({self.source}) failed: {exc}") from exc
        if self.strip_bos and self.bos_token and out.startswith(self.bos_token):
            out = out[len(self.bos_token):]
        if self.strip_eos and self.eos_token and out.endswith(self.eos_token):
            out = out[: -len(self.eos_token)]
        return out
