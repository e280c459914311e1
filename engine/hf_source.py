"""Models on Hugging Face: `hf:OWNER/REPO[:QUANT]` (llama-server's `-hf OWNER/REPO:QUANT`, Ollama's
`hf.co/OWNER/REPO:QUANT`) or `hf:OWNER/REPO/PATH/FILE.gguf`, fetched with huggingface_hub.

huggingface_hub does the fetching because it already is what every other tool here uses: its cache
(``$HF_HOME``/``$HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``) is shared with them, so a model another
tool fetched is not fetched again; a download whose connection drops resumes with a range request;
``HF_TOKEN`` (or ``huggingface-cli login``) opens gated repositories, ``HF_ENDPOINT`` names a mirror,
``HF_HUB_OFFLINE=1`` resolves from the cache alone. The file a
quant tag picks is llama-server's (engine/gguf_names.py); every part of a split model is fetched and the
first part returned (engine/gguf_file.py opens the rest beside it).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.gguf_names import model_files_listing, pick_model_file, split_name, split_parts

HF_PREFIXES = ("hf:", "hf.co/", "huggingface.co/", "https://huggingface.co/")


class HubFetchError(RuntimeError):
    """The hub could not be asked, or refused (no such repository, gated, no file for the tag)."""


@dataclass(frozen=True)
class HFModel:
    """A model file fetched into (or found in) the hub cache."""

    name: str  # OWNER/REPO:QUANT or OWNER/REPO/FILE, as the model is served
    path: Path  # the first part, in the cache's snapshot folder
    size: int  # all parts


def parse_hf_spec(spec: str) -> tuple[str, str, str]:
    """(repo, quant tag, file) of ``OWNER/REPO[:QUANT]`` or ``OWNER/REPO/FILE.gguf``; ValueError otherwise."""
    rest, _, tag = spec.partition(":")
    parts = [p for p in rest.split("/") if p]
    if len(parts) < 2 or any(p in (".", "..") for p in parts) or (len(parts) > 2 and tag):
        raise ValueError(f"hf:{spec}: expected hf:OWNER/REPO[:QUANT] or hf:OWNER/REPO/FILE.gguf")
    file_name = "/".join(parts[2:])
    if file_name and not file_name.lower().endswith(".gguf"):
        raise ValueError(f"hf:{spec}: {file_name} is not a .gguf file")
    return f"{parts[0]}/{parts[1]}", tag.upper(), file_name


def fetch_hf_model(spec: str, log: Callable[[str], None], offline: bool = False) -> HFModel:
    """Fetch (or find in the cache) the model ``hf:spec`` names; HubFetchError / FileNotFoundError say why not.

    ``offline`` (or ``HF_HUB_OFFLINE``) resolves from the cache alone, without asking the hub.
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.utils import disable_progress_bars

    repo, tag, file_name = parse_hf_spec(spec)
    if not sys.stderr.isatty():  # tqdm's bars are for a terminal; in a log they are noise
        disable_progress_bars()
    offline = offline or constants.HF_HUB_OFFLINE
    files = _cached_files(repo) if offline else _repo_files(repo, log)
    first = file_name or pick_model_file(files, tag)
    if first is None or first not in files:
        wanted = file_name or (f"quant {tag}" if tag else "any model file")
        raise FileNotFoundError(f"hf:{spec}: no GGUF for {wanted} in {repo}; it has: {model_files_listing(files)}")
    try:
        parts = split_parts(files, first)
    except ValueError as exc:
        raise FileNotFoundError(f"hf:{spec}: {exc}") from exc
    log(f"strata: hf:{spec} -> {repo}/{first}" + (f" and {len(parts) - 1} more parts" if len(parts) > 1 else ""))
    # The default revision (main), not the commit listed: the cache then records main -> commit, which is what
    # HF_HUB_OFFLINE lookups (ours and every other tool's) resolve through.
    paths = [Path(_download(hf_hub_download, repo, part, offline)) for part in parts]
    if len({p.parent for p in paths}) != 1:  # split parts are found beside the first: one snapshot folder
        raise HubFetchError(f"hf:{spec}: the parts landed in different snapshot folders: {paths}")
    name = f"{repo}/{first}" if file_name else f"{repo}:{tag or split_name(first).tag or first}"
    return HFModel(name, paths[0], sum(p.stat().st_size for p in paths))


def _repo_files(repo: str, log: Callable[[str], None]) -> list[str]:
    """The repository's file names from the hub, or from the cache's snapshot when the hub is unreachable."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

    endpoint = _endpoint()
    try:
        info = HfApi(endpoint=endpoint).model_info(repo)
        return [s.rfilename for s in info.siblings or ()]
    except GatedRepoError as exc:
        raise HubFetchError(f"{repo} is gated: accept its terms on the hub and set HF_TOKEN ({exc})") from exc
    except RepositoryNotFoundError as exc:
        raise HubFetchError(f"no repository {repo} at {endpoint} (or it is private: set HF_TOKEN)") from exc
    except (OfflineModeIsEnabled, HfHubHTTPError, httpx.TransportError, OSError) as exc:
        if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code < 500:
            raise HubFetchError(f"the hub refused to list {repo}: {exc}") from exc
        log(f"strata: {endpoint} is not reachable ({type(exc).__name__}: {exc}); looking in the local cache")
    return _cached_files(repo)


def _endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _cached_files(repo: str) -> list[str]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo, local_files_only=True))
    except (LocalEntryNotFoundError, OSError) as exc:
        raise HubFetchError(f"{repo} is not in the Hugging Face cache and the hub cannot be asked "
                            f"(HF_HUB_OFFLINE set, or no network): {exc}") from exc
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _download(hf_hub_download, repo: str, file_name: str, offline: bool) -> str:
    import httpx
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return hf_hub_download(repo, file_name, endpoint=_endpoint(), local_files_only=offline)
    except (HfHubHTTPError, LocalEntryNotFoundError, httpx.TransportError, OSError) as exc:
        raise HubFetchError(f"fetching {repo}/{file_name} failed: {exc}") from exc
