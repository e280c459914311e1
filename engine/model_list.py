"""What `strata pull --list` shows besides the known models: the GGUF models already on this machine in
Ollama's store, LM Studio's folder and the Hugging Face cache, each by the name `--model` takes."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.gguf_names import is_model_file, split_name


@dataclass(frozen=True)
class LocalModel:
    """A model file found on disk, named as ``--model`` takes it."""

    spec: str  # ollama:qwen2.5:0.5b, lmstudio:publisher/repo/file.gguf, hf:owner/repo/file.gguf
    size: int  # bytes, all parts of a split model
    path: Path


def list_local_models() -> list[LocalModel]:
    """Every model in Ollama's store, LM Studio's folder and the Hugging Face cache (each skipped when absent)."""
    from engine.lmstudio_store import list_lmstudio_models
    from engine.ollama_store import list_ollama_models

    found = [LocalModel(f"ollama:{m.name}", m.size, m.path) for m in list_ollama_models()]
    found += [LocalModel(f"lmstudio:{m.name}", m.size, m.path) for m in list_lmstudio_models()]
    return found + list_hf_cached_models()


def list_hf_cached_models() -> list[LocalModel]:
    """The GGUF model files of every repository in the Hugging Face cache (the newest revision of each)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except (CacheNotFound, OSError):
        return []
    found = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = max(repo.revisions, key=lambda r: r.last_modified)
        files = {f.file_path.relative_to(revision.snapshot_path).as_posix(): f for f in revision.files}
        for name, info in sorted(files.items()):
            split = split_name(name)
            if not is_model_file(name) or split.index != 1:
                continue
            parts = [split.part_path(i) for i in range(1, split.count + 1)]
            if all(p in files for p in parts):
                size = sum(files[p].size_on_disk for p in parts)
                found.append(LocalModel(f"hf:{repo.repo_id}/{name}", size, info.file_path))
    return found
