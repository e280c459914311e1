"""One call from a model name or path to everything needed to run it: model, tokenizer, chat template."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from engine.backends.base import Backend
from engine.backends.placement import backend_for_arch
from engine.chat_template import ChatTemplate
from engine.gguf_file import GGUFFile
from engine.model import LoadInfo, Model, load_model
from engine.model_store import resolve_model_source
from engine.tokenizer import Tokenizer

log = logging.getLogger("strata.loader")
BACKEND_NAMES = ("auto", "numpy", "cuda")
# How the numpy backend holds linear weights: float32 (the reference) or the file's quantised blocks.
CPU_WEIGHTS = ("quantized", "quantized-int8act", "quantized-f32act", "f32")  # the default first
_ACTIVATIONS = {"quantized": "int16", "quantized-int8act": "int8", "quantized-f32act": "f32"}


@dataclass
class LoadedModel:
    model: Model
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    info: LoadInfo
    source_name: str = ""  # the name its source gives it (ollama:qwen2.5:0.5b -> "qwen2.5:0.5b"); "": the file's

    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def served_name(self) -> str:
        """The model id the API shows unless --served-model-name says otherwise."""
        return self.source_name or self.path.stem


def choose_backend(name: str, device: int | None = None) -> tuple[str, str]:
    """(backend to use, why) for a requested name: auto means cuda when cuda-python imports, the driver
    initialises and the device exists, else numpy. Raises ValueError for cuda without a usable device."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKEND_NAMES)}")
    if name == "numpy":
        return "numpy", "asked for (--backend numpy)"
    from engine.backends.cuda.device import probe

    available, reason = probe(device or 0)
    if available:
        return "cuda", reason
    if name == "cuda":
        raise ValueError(f"--backend cuda: {reason}; use --backend auto or numpy to run on the CPU")
    return "numpy", reason


def create_backend(name: str = "numpy", stage: int = 0, device: int | None = None,
                   cpu_weights: str = "quantized") -> Backend:
    """The backend `name` (auto, numpy, cuda) for pipeline stage `stage` on GPU `device` (default 0).

    `cpu_weights` (f32, or quantized: decode products on int16-quantised activations, quantized-int8act on
    int8 ones, quantized-f32act on float32 ones) says how the numpy backend holds and uses the weights;
    cuda ignores it.
    Logs which backend was picked and why. Several cuda backends on one device (one per stage) share its
    context, memory arena and kernels; each has its own stream. Every kernel is compiled (or read from the
    on-disk cache) here, so a broken toolchain is a start-up error, not a failure at the first request.
    """
    if cpu_weights not in CPU_WEIGHTS:
        raise ValueError(f"unknown --cpu-weights {cpu_weights!r}; available: {', '.join(CPU_WEIGHTS)}")
    chosen, reason = choose_backend(name, device)
    if chosen == "cuda":
        try:
            from engine.backends.cuda.backend import CudaBackend

            backend = CudaBackend(device=device or 0, stage=stage)
            backend.kernels.load_all()
        except Exception as exc:
            if name == "cuda":
                raise ValueError(f"--backend cuda: the CUDA backend could not start: {exc}") from exc
            chosen, reason = "numpy", f"CUDA backend could not start ({type(exc).__name__}: {exc})"
        else:
            log.info("backend cuda (stage %d): %s", stage, reason)
            return backend
    log.info("backend numpy: %s (%s weights)", reason, cpu_weights)
    if cpu_weights == "f32":
        from engine.backends.reference.backend import NumpyBackend

        return NumpyBackend()
    from engine.backends.cpu.backend import QuantizedNumpyBackend

    return QuantizedNumpyBackend(activations=_ACTIVATIONS[cpu_weights])


def open_model(
    name_or_path: str,
    backend: Backend | None = None,
    chat_template_path: str | None = None,
    max_positions: int | None = None,
    fetch: bool = True,
    backend_name: str = "numpy",
    cpu_weights: str = "quantized",
    expert_cache_mib: str | None = None,
) -> LoadedModel:
    """Resolve (fetching if needed), load and wrap a model on `backend` (default: create_backend(backend_name,
    cpu_weights=cpu_weights)). Raises ValueError on unsupported files."""
    resolved = resolve_model_source(name_or_path, fetch=fetch)
    path = resolved.path
    if backend is None and backend_name in ("auto", "cuda"):
        backend_name = backend_for_arch(GGUFFile(path).architecture, backend_name, path.name)
    backend = backend or create_backend(backend_name, cpu_weights=cpu_weights)
    if expert_cache_mib:  # before the weights load: the experts then go to the pinned host arena
        from engine.backends.cuda.expert_cache.setup import configure_expert_cache

        configure_expert_cache(backend, expert_cache_mib)
    model, gguf, info = load_model(path, backend, max_positions)
    tokenizer = Tokenizer.from_gguf_fields(gguf.fields)
    template = ChatTemplate.from_gguf_fields(gguf.fields, model.config.arch, chat_template_path)
    return LoadedModel(model, tokenizer, template, info, resolved.name)


def encode_chat_prompt(tokenizer: Tokenizer, rendered: str | Sequence[str | list[int]]) -> list[int]:
    """Token ids of a rendered chat prompt: special tokens parsed, BOS added where the model wants one.

    ``rendered`` may come in parts: text, and ids that stand for a span of it as they were generated (a
    reply's own tokens, api/prompt_ids.py); text after such ids goes on from them (``Tokenizer.encode``'s
    ``continues``). Many templates already start with the BOS token (Gemma, Llama 3); like llama.cpp, keep
    one BOS rather than doubling it.
    """
    return encode_chat_parts(tokenizer, [rendered] if isinstance(rendered, str) else rendered)[0]


def encode_chat_parts(tokenizer: Tokenizer, parts: Sequence[str | list[int]]) -> tuple[list[int], list[int]]:
    """encode_chat_prompt of parts, and where each part's ids start."""
    ids, starts = [tokenizer.bos_id] if tokenizer.add_bos else [], []
    for k, part in enumerate(parts):
        starts.append(len(ids))
        ids += tokenizer.encode(part, add_special=False, continues=k > 0) if isinstance(part, str) else part
    if tokenizer.add_eos:
        ids.append(tokenizer.eos_id)
    bos = tokenizer.bos_id
    if len(ids) >= 2 and bos is not None and ids[0] == bos and ids[1] == bos:
        ids, starts = ids[1:], [max(0, s - 1) for s in starts]
    return ids, starts
