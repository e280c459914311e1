"""One call from a model name or path to everything needed to run it: model, tokenizer, chat template."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.backends.base import Backend
from engine.chat_template import ChatTemplate
from engine.model import LoadInfo, Model, load_model
from engine.model_store import resolve_model
from engine.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: Model
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    info: LoadInfo

    @property
    def path(self) -> Path:
        return self.info.path


def create_backend(name: str = "numpy") -> Backend:
    """The backend called `name`; only numpy exists for now."""
    if name in ("numpy", "auto"):
        from engine.backends.numpy_backend import NumpyBackend

        return NumpyBackend()
    raise ValueError(f"unknown backend {name!r}; available: numpy")


def open_model(
    name_or_path: str,
    backend: Backend | None = None,
    chat_template_path: str | None = None,
    max_positions: int | None = None,
    fetch: bool = True,
) -> LoadedModel:
    """Resolve (fetching if needed), load and wrap a model. Raises ValueError on unsupported files."""
    path = resolve_model(name_or_path, fetch=fetch)
    model, gguf, info = load_model(path, backend or create_backend(), max_positions)
    tokenizer = Tokenizer.from_gguf_fields(gguf.fields)
    template = ChatTemplate.from_gguf_fields(gguf.fields, model.config.arch, chat_template_path)
    return LoadedModel(model, tokenizer, template, info)


def encode_chat_prompt(tokenizer: Tokenizer, rendered: str) -> list[int]:
    """Token ids of a rendered chat prompt: special tokens parsed, BOS added where the model wants one.

    Many templates already start with the BOS token (Gemma, Llama 3); like llama.cpp, keep one BOS rather
    than doubling it.
    """
    ids = tokenizer.encode(rendered, add_special=True, parse_special=True)
    bos = tokenizer.bos_id
    if len(ids) >= 2 and bos is not None and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids
