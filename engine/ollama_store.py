"""Models in Ollama's store, served in place: `ollama:NAME[:TAG]`.

Ollama keeps a model as a manifest (an OCI image manifest, JSON) under
``<root>/manifests/<registry>/<namespace>/<model>/<tag>`` whose layers point at content-addressed blobs
``<root>/blobs/sha256-<hex>``. The layer of media type ``application/vnd.ollama.image.model`` is the GGUF
file itself, so it is read where it lies: no copy, and the store is never written to. The root is
``$OLLAMA_MODELS``, else ``~/.ollama/models``, else the Linux service's ``/usr/share/ollama/.ollama/models``.

A name is Ollama's own: ``qwen2.5:0.5b`` is ``registry.ollama.ai/library/qwen2.5:0.5b``, ``user/model`` is in
the ``user`` namespace, ``hf.co/owner/repo:Q4_K_M`` is a model pulled from Hugging Face; no tag means
``latest``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REGISTRY, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
_SERVICE_ROOT = Path("/usr/share/ollama/.ollama/models")  # the Linux installer's service user
# Layers strata does not apply, and what it does instead (logged when a model has them).
_NOTED_LAYERS = {
    "application/vnd.ollama.image.template": "its Go template is not used; the GGUF's own chat template is "
                                             "(--chat-template FILE overrides it)",
    "application/vnd.ollama.image.params": "its default parameters are not applied (sampling comes from each "
                                           "request, else the GGUF's own defaults)",
    "application/vnd.ollama.image.system": "its system prompt is not added; send one in the request",
    "application/vnd.ollama.image.projector": "its vision projector is not loaded (text only)",
    "application/vnd.ollama.image.license": "license text only",
}
_REFUSED_LAYERS = {"application/vnd.ollama.image.adapter": "a LoRA adapter, which strata cannot apply"}


@dataclass(frozen=True)
class OllamaModel:
    """A model found in the store: its GGUF blob and what its other layers were (notes for the log)."""

    name: str  # the short name, as `ollama list` shows it
    path: Path  # the GGUF blob
    size: int
    notes: tuple[str, ...]


def ollama_root() -> Path:
    """The store Ollama uses here: $OLLAMA_MODELS, ~/.ollama/models, or the Linux service's."""
    if env := os.environ.get("OLLAMA_MODELS"):
        return Path(env).expanduser()
    home = Path.home() / ".ollama" / "models"
    return _SERVICE_ROOT if not home.is_dir() and _SERVICE_ROOT.is_dir() else home


def manifest_parts(name: str) -> tuple[str, str, str, str]:
    """(registry, namespace, model, tag) of an Ollama model name, with Ollama's defaults filled in."""
    rest, tag = name, DEFAULT_TAG
    if ":" in name.rsplit("/", 1)[-1]:
        rest, tag = name.rsplit(":", 1)
    parts = [p for p in rest.split("/") if p]
    if not parts or not tag or len(parts) > 3 or any(p in (".", "..") for p in parts + [tag]):
        raise ValueError(f"ollama:{name}: not an Ollama model name ([registry/][namespace/]model[:tag])")
    if len(parts) == 3:
        return parts[0], parts[1], parts[2], tag
    if len(parts) == 2 and "." in parts[0]:  # hf.co/repo: a registry without a namespace is not a thing
        raise ValueError(f"ollama:{name}: {parts[0]} looks like a registry; name the namespace too")
    namespace = parts[0] if len(parts) == 2 else DEFAULT_NAMESPACE
    return DEFAULT_REGISTRY, namespace, parts[-1], tag


def short_name(registry: str, namespace: str, model: str, tag: str) -> str:
    """The name `ollama list` shows: registry and library namespace left out when they are the defaults."""
    prefix = "" if registry == DEFAULT_REGISTRY else f"{registry}/"
    if registry != DEFAULT_REGISTRY or namespace != DEFAULT_NAMESPACE:
        prefix += f"{namespace}/"
    return f"{prefix}{model}:{tag}"


def find_ollama_model(name: str, root: Path | None = None) -> OllamaModel:
    """The GGUF blob of model ``name`` in the store; FileNotFoundError listing the store's models when absent,
    ValueError when its manifest is unreadable, has no model layer, or has a layer strata cannot honour."""
    root = root or ollama_root()
    registry, namespace, model, tag = manifest_parts(name)
    manifest_path = root / "manifests" / registry / namespace / model / tag
    if not manifest_path.is_file():
        have = ", ".join(entry.name for entry in list_ollama_models(root)) or "none"
        raise FileNotFoundError(f"ollama:{name}: no manifest {manifest_path} (the store at {root} has: {have}; "
                                f"OLLAMA_MODELS names another store)")
    try:
        layers = json.loads(manifest_path.read_text())["layers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"ollama:{name}: unreadable manifest {manifest_path}: {exc}") from exc
    models = [layer for layer in layers if layer.get("mediaType") == MODEL_MEDIA_TYPE]
    if len(models) != 1:
        raise ValueError(f"ollama:{name}: the manifest has {len(models)} model layers, not one")
    for layer in layers:
        if (why := _REFUSED_LAYERS.get(layer.get("mediaType", ""))) is not None:
            raise ValueError(f"ollama:{name}: the model has {why} ({layer['mediaType']})")
    blob = _blob_path(root, models[0], name)
    notes = tuple(f"{layer['mediaType'].rsplit('.', 1)[-1]} layer: {_NOTED_LAYERS[layer['mediaType']]}"
                  for layer in layers if layer.get("mediaType") in _NOTED_LAYERS)
    return OllamaModel(short_name(registry, namespace, model, tag), blob, blob.stat().st_size, notes)


def _blob_path(root: Path, layer: dict, name: str) -> Path:
    digest = str(layer.get("digest", ""))
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise ValueError(f"ollama:{name}: the model layer's digest {digest!r} is not sha256:<64 hex digits>")
    blob = root / "blobs" / f"sha256-{hexdigest}"
    if not blob.is_file():
        raise FileNotFoundError(f"ollama:{name}: the manifest names blob {blob.name}, which is not in {blob.parent}")
    if "size" in layer and blob.stat().st_size != int(layer["size"]):
        raise ValueError(f"ollama:{name}: blob {blob} has {blob.stat().st_size} bytes, the manifest says "
                         f"{layer['size']} (a pull still under way?)")
    return blob


def list_ollama_models(root: Path | None = None) -> list[OllamaModel]:
    """Every model of the store whose manifest has a model layer with its blob present, by short name."""
    root = root or ollama_root()
    found = []
    for manifest in sorted((root / "manifests").glob("*/*/*/*")):
        if not manifest.is_file():
            continue
        registry, namespace, model, tag = manifest.relative_to(root / "manifests").parts
        try:
            found.append(find_ollama_model(short_name(registry, namespace, model, tag), root))
        except (OSError, ValueError):
            continue  # a half-pulled or foreign entry: listing skips it, using it names the problem
    return found
