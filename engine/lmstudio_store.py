"""Models in LM Studio's folder, served in place: `lmstudio:PUBLISHER/REPO[/FILE][:QUANT]`.

LM Studio keeps each download as ``<models>/<publisher>/<repo>/<file>.gguf`` (the Hugging Face owner and
repository it came from). ``<models>`` is the "downloadsFolder" of LM Studio's settings.json when set, else
``<home>/models``, where ``<home>`` is what ``~/.lmstudio-home-pointer`` names, else ``~/.lmstudio``; the
0.2-era ``~/.cache/lm-studio/models`` is used when only it exists. ``$LMSTUDIO_MODELS`` overrides all of them.

Without a FILE, a repository folder holding several quantisations is resolved like `hf:` (engine/gguf_names.py:
the QUANT tag, else Q4_K_M, then Q8_0, then the first); a split model is named by its first part.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from engine.gguf_names import is_model_file, model_files_listing, pick_model_file, split_parts


@dataclass(frozen=True)
class LMStudioModel:
    """One model file in the folder: its name as `lmstudio:` takes it, its path and size (all parts)."""

    name: str  # publisher/repo/file
    path: Path
    size: int


def lmstudio_home() -> Path:
    """LM Studio's home folder: the one ~/.lmstudio-home-pointer names, else ~/.lmstudio."""
    pointer = Path.home() / ".lmstudio-home-pointer"
    try:
        if text := pointer.read_text(encoding="utf-8").strip():
            return Path(text).expanduser()
    except OSError:
        pass
    return Path.home() / ".lmstudio"


def lmstudio_models_dir() -> Path:
    """The models folder LM Studio uses here (the module docstring says how it is found)."""
    if env := os.environ.get("LMSTUDIO_MODELS"):
        return Path(env).expanduser()
    home = lmstudio_home()
    try:
        folder = json.loads((home / "settings.json").read_text(encoding="utf-8")).get("downloadsFolder")
        if isinstance(folder, str) and folder:
            return Path(folder).expanduser()
    except (OSError, ValueError, AttributeError):
        pass
    legacy = Path.home() / ".cache" / "lm-studio" / "models"
    return legacy if not (home / "models").is_dir() and legacy.is_dir() else home / "models"


def find_lmstudio_model(spec: str, root: Path | None = None) -> LMStudioModel:
    """The GGUF file `lmstudio:spec` names; FileNotFoundError listing what the folder has when there is none."""
    root = root or lmstudio_models_dir()
    rest, _, tag = spec.partition(":")
    parts = [p for p in rest.split("/") if p]
    if len(parts) not in (2, 3) or any(p in (".", "..") for p in parts) or (tag and len(parts) == 3):
        raise ValueError(f"lmstudio:{spec}: expected lmstudio:PUBLISHER/REPO[:QUANT] or PUBLISHER/REPO/FILE.gguf")
    repo_dir = root / parts[0] / parts[1]
    if not repo_dir.is_dir():
        have = ", ".join(sorted({"/".join(m.name.split("/")[:2]) for m in list_lmstudio_models(root)})) or "none"
        raise FileNotFoundError(f"lmstudio:{spec}: no folder {repo_dir} (LM Studio's models folder {root} has: "
                                f"{have}; LMSTUDIO_MODELS names another folder)")
    files = sorted(p.name for p in repo_dir.iterdir() if p.is_file())
    chosen = parts[2] if len(parts) == 3 else pick_model_file(files, tag.upper())
    if chosen is None or chosen not in files:
        what = f"no file {parts[2]}" if len(parts) == 3 else f"no model file for quant {tag or 'Q4_K_M/Q8_0'}"
        raise FileNotFoundError(f"lmstudio:{spec}: {what} in {repo_dir}; it has: {model_files_listing(files)}")
    return _model(root, repo_dir, chosen, files)


def _model(root: Path, repo_dir: Path, file_name: str, files: list[str]) -> LMStudioModel:
    try:
        parts = split_parts(files, file_name)
    except ValueError as exc:
        raise FileNotFoundError(f"{repo_dir}: {exc}") from exc
    size = sum((repo_dir / p).stat().st_size for p in parts)
    return LMStudioModel(str((repo_dir / file_name).relative_to(root).as_posix()), repo_dir / file_name, size)


def list_lmstudio_models(root: Path | None = None) -> list[LMStudioModel]:
    """Every model file (first parts of split models) in the folder, by publisher/repo/file."""
    root = root or lmstudio_models_dir()
    found = []
    for repo_dir in sorted(p for p in root.glob("*/*") if p.is_dir()):
        files = sorted(p.name for p in repo_dir.iterdir() if p.is_file())
        for name in files:
            if is_model_file(name) and pick_model_file([name], "") == name:
                try:
                    found.append(_model(root, repo_dir, name, files))
                except FileNotFoundError:
                    continue  # a split model with parts missing: using it names them
    return found
