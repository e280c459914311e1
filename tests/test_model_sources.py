"""Model sources: the quant-tag and split rules, Ollama's store, LM Studio's folder, and Hugging Face through
huggingface_hub against a local server speaking the hub's file API; tiny random GGUFs throughout."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.gguf_file import GGUFFile
from engine.gguf_names import pick_model_file, split_parts
from engine.model_store import ModelFetchError, resolve_model, resolve_model_source
from tests.support.local_model_stores import FakeHub, add_ollama_model
from tests.support.tiny_gguf import write_tiny_gguf

REPO_FILES = ["README.md", "Tiny-Q2_K.gguf", "Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf", "mmproj-Tiny-f16.gguf",
              "Tiny-Q6_K-00001-of-00002.gguf", "Tiny-Q6_K-00002-of-00002.gguf"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny llama GGUF whole ("whole") and the same model split in three parts ("parts": first part)."""
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_gguf(folder / "tiny.gguf", "llama", quant="Q8_0", embd_quant="Q8_0")
    write_tiny_gguf(folder / "split.gguf", "llama", quant="Q8_0", embd_quant="Q8_0", split_max_tensors=7)
    return {"whole": folder / "tiny.gguf", "parts": folder / "split-00001-of-00003.gguf"}


def _quiet(msg: str) -> None:
    pass


def test_quant_tag_picks_like_llama_server():
    assert pick_model_file(REPO_FILES) == "Tiny-Q4_K_M.gguf"  # no tag: Q4_K_M first
    assert pick_model_file([f for f in REPO_FILES if "Q4_K_M" not in f]) == "Tiny-Q8_0.gguf"  # then Q8_0
    assert pick_model_file(["mmproj-x-f16.gguf", "x-F16.gguf"]) == "x-F16.gguf"  # then the first model file
    assert pick_model_file(REPO_FILES, "q8_0") == "Tiny-Q8_0.gguf"  # any case
    assert pick_model_file(REPO_FILES, "Q6_K") == "Tiny-Q6_K-00001-of-00002.gguf"  # a split: its first part
    assert pick_model_file(REPO_FILES, "IQ4_XS") is None
    assert split_parts(REPO_FILES, "Tiny-Q6_K-00001-of-00002.gguf") == ["Tiny-Q6_K-00001-of-00002.gguf",
                                                                        "Tiny-Q6_K-00002-of-00002.gguf"]
    with pytest.raises(ValueError, match="00002-of-00002.gguf is missing"):
        split_parts(REPO_FILES[:-1], "Tiny-Q6_K-00001-of-00002.gguf")


def test_split_model_opens_by_its_first_part_with_every_tensor(tiny):
    whole, split = GGUFFile(tiny["whole"]), GGUFFile(tiny["parts"])
    assert sorted(split.tensor_names()) == sorted(whole.tensor_names())
    for name in whole.tensor_names():
        assert np.array_equal(split.tensor(name), whole.tensor(name)), name
    with pytest.raises(ValueError, match="give the first part"):
        GGUFFile(tiny["parts"].with_name("split-00002-of-00003.gguf"))


def test_split_model_with_a_part_missing_names_it(tiny, tmp_path):
    for i in (1, 2):
        name = f"split-0000{i}-of-00003.gguf"
        (tmp_path / name).write_bytes(tiny["parts"].with_name(name).read_bytes())
    with pytest.raises(ValueError, match=r"part 3 of 3 \(split-00003-of-00003.gguf\) is missing"):
        GGUFFile(tmp_path / "split-00001-of-00003.gguf")


def test_ollama_model_is_read_in_place_with_its_other_layers_noted(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    blob = add_ollama_model(tmp_path, "tiny", tiny["whole"].read_bytes(), tag="q8", extra_layers={
        "application/vnd.ollama.image.template": b"{{ .Prompt }}",
        "application/vnd.ollama.image.params": b'{"temperature": 0.2}'})
    logged = []
    resolved = resolve_model_source("ollama:tiny:q8", log=logged.append)
    assert resolved.path == blob and resolved.name == "tiny:q8"
    assert any("template layer" in line and "GGUF's own chat template" in line for line in logged)
    assert any("params layer" in line for line in logged)
    assert resolve_model("ollama:registry.ollama.ai/library/tiny:q8", log=_quiet) == blob  # the long form


def test_ollama_names_with_namespace_and_registry(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    data = tiny["whole"].read_bytes()
    add_ollama_model(tmp_path, "tiny", data, namespace="someone")
    add_ollama_model(tmp_path, "Tiny-GGUF", data, registry="hf.co", namespace="owner", tag="Q8_0")
    assert resolve_model_source("ollama:someone/tiny", log=_quiet).name == "someone/tiny:latest"
    assert resolve_model_source("ollama:hf.co/owner/Tiny-GGUF:Q8_0", log=_quiet).name == "hf.co/owner/Tiny-GGUF:Q8_0"


def test_ollama_missing_model_lists_the_store(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    add_ollama_model(tmp_path, "tiny", tiny["whole"].read_bytes(), tag="q8")
    with pytest.raises(FileNotFoundError, match=r"has: tiny:q8;"):
        resolve_model("ollama:qwen2.5:0.5b", log=_quiet)


def test_ollama_refuses_an_adapter_and_a_short_blob(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    data = tiny["whole"].read_bytes()
    add_ollama_model(tmp_path, "lora", data, extra_layers={"application/vnd.ollama.image.adapter": b"LORA"})
    with pytest.raises(ValueError, match="LoRA adapter"):
        resolve_model("ollama:lora", log=_quiet)
    blob = add_ollama_model(tmp_path, "short", data)
    blob.write_bytes(data[:100])  # a pull cut short
    with pytest.raises(ValueError, match="manifest says"):
        resolve_model("ollama:short", log=_quiet)


def _lmstudio_home(tmp_path: Path, monkeypatch) -> Path:
    """A home whose LM Studio settings put the models folder somewhere else (its downloadsFolder setting)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LMSTUDIO_MODELS", raising=False)
    models = tmp_path / "elsewhere" / "models"
    (tmp_path / "home" / ".lmstudio").mkdir(parents=True)
    (tmp_path / "home" / ".lmstudio" / "settings.json").write_text(f'{{"downloadsFolder": "{models}"}}')
    return models


def test_lmstudio_quant_tag_file_and_split(tiny, tmp_path, monkeypatch):
    models = _lmstudio_home(tmp_path, monkeypatch)
    repo = models / "pub" / "Tiny-GGUF"
    repo.mkdir(parents=True)
    for name in ("Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf"):
        (repo / name).write_bytes(tiny["whole"].read_bytes())
    for i in (1, 2, 3):
        part = tiny["parts"].with_name(f"split-0000{i}-of-00003.gguf")
        (repo / f"Tiny-F16-0000{i}-of-00003.gguf").write_bytes(part.read_bytes())
    assert resolve_model_source("lmstudio:pub/Tiny-GGUF", log=_quiet).path == repo / "Tiny-Q4_K_M.gguf"
    assert resolve_model("lmstudio:pub/Tiny-GGUF:q8_0", log=_quiet) == repo / "Tiny-Q8_0.gguf"
    first = resolve_model("lmstudio:pub/Tiny-GGUF:F16", log=_quiet)
    assert first == repo / "Tiny-F16-00001-of-00003.gguf" and len(GGUFFile(first).tensor_names()) == 21
    assert resolve_model_source("lmstudio:pub/Tiny-GGUF/Tiny-Q8_0.gguf", log=_quiet).name == \
        "pub/Tiny-GGUF/Tiny-Q8_0.gguf"
    with pytest.raises(FileNotFoundError, match=r"no folder .*has: pub/Tiny-GGUF;"):
        resolve_model("lmstudio:pub/Other", log=_quiet)
    with pytest.raises(FileNotFoundError, match="no model file for quant IQ2_M"):
        resolve_model("lmstudio:pub/Tiny-GGUF:IQ2_M", log=_quiet)


def _hub_repo(tiny) -> dict[str, bytes]:
    whole = tiny["whole"].read_bytes()
    files = {"README.md": b"# tiny", "Tiny-Q4_K_M.gguf": whole, "mmproj-Tiny-f16.gguf": b"GGUF-not-a-model"}
    for i in (1, 2, 3):
        files[f"Tiny-Q8_0-0000{i}-of-00003.gguf"] = tiny["parts"].with_name(f"split-0000{i}-of-00003.gguf").read_bytes()
    return files


@pytest.fixture
def hub(tiny, tmp_path, monkeypatch):
    """A local hub holding owner/Tiny-GGUF, named by HF_ENDPOINT, with an empty Hugging Face cache."""
    from huggingface_hub import constants

    fake = FakeHub({"owner/Tiny-GGUF": _hub_repo(tiny)})
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    with fake.running():
        yield fake


def test_hf_default_quant_is_fetched_into_the_hub_cache_once(hub, tmp_path):
    resolved = resolve_model_source("hf:owner/Tiny-GGUF", log=_quiet)
    assert resolved.name == "owner/Tiny-GGUF:Q4_K_M" and resolved.path.name == "Tiny-Q4_K_M.gguf"
    assert str(resolved.path).startswith(str(tmp_path / "hf-cache" / "models--owner--Tiny-GGUF" / "snapshots"))
    assert resolved.path.read_bytes() == hub.repos["owner/Tiny-GGUF"]["Tiny-Q4_K_M.gguf"]
    gets = [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]
    assert [r[1].rsplit("/", 1)[1] for r in gets] == ["Tiny-Q4_K_M.gguf"]  # the projector and README stay
    hub.requests.clear()
    assert resolve_model("hf.co/owner/Tiny-GGUF:Q4_K_M", log=_quiet) == resolved.path  # Ollama's spelling
    assert not [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]


def test_hf_download_resumes_after_a_dropped_connection(hub, monkeypatch):
    """The connection drops 1000 bytes into the file: huggingface_hub asks for the rest from where its written
    chunks end (an HTTP range) and the file comes out whole. Its chunks are 10 MB; 256 bytes here, so that some
    are written before the drop. (A pull that was stopped starts the file again: huggingface_hub 1.x+ writes
    each download to a file of its own process, so nothing is resumed across runs.)"""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 256)
    data = hub.repos["owner/Tiny-GGUF"]["Tiny-Q4_K_M.gguf"]
    hub.drop_after["Tiny-Q4_K_M.gguf"] = 1000
    path = resolve_model("hf:owner/Tiny-GGUF:Q4_K_M", log=_quiet)
    assert path.read_bytes() == data
    ranges = [r[2] for r in hub.requests if r[0] == "GET" and r[1].endswith("/Tiny-Q4_K_M.gguf")]
    assert len(ranges) == 2 and ranges[0] == ""
    assert 0 < int(ranges[1].removeprefix("bytes=").removesuffix("-")) <= 1000, ranges


def test_hf_split_quant_fetches_every_part_and_loads(hub, tiny):
    path = resolve_model("hf:owner/Tiny-GGUF:q8_0", log=_quiet)
    assert path.name == "Tiny-Q8_0-00001-of-00003.gguf"
    assert sorted(p.name for p in path.parent.glob("Tiny-Q8_0-*")) == [f"Tiny-Q8_0-0000{i}-of-00003.gguf"
                                                                       for i in (1, 2, 3)]
    split, whole = GGUFFile(path), GGUFFile(tiny["whole"])
    assert all(np.array_equal(split.tensor(n), whole.tensor(n)) for n in whole.tensor_names())


def test_hf_offline_resolves_from_the_cache_without_the_hub(hub):
    path = resolve_model("hf:owner/Tiny-GGUF", log=_quiet)
    hub.requests.clear()
    assert resolve_model("hf:owner/Tiny-GGUF", fetch=False, log=_quiet) == path
    assert hub.requests == []


def test_hf_token_is_sent(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    resolve_model("hf:owner/Tiny-GGUF", log=_quiet)
    assert hub.requests and all(r[3] == "Bearer hf_test_token" for r in hub.requests)


def test_hf_missing_quant_and_repository_say_what_there_is(hub):
    with pytest.raises(FileNotFoundError, match=r"no GGUF for quant IQ4_XS .*Tiny-Q4_K_M.gguf, "
                                                r"Tiny-Q8_0-00001-of-00003.gguf \(\+2 parts\)"):
        resolve_model("hf:owner/Tiny-GGUF:IQ4_XS", log=_quiet)
    with pytest.raises(ModelFetchError, match="no repository owner/Missing"):
        resolve_model("hf:owner/Missing", log=_quiet)


def test_cli_pull_hf_then_list_shows_every_store(tiny, tmp_path):
    """`strata pull -hf` (llama-server's spelling) through huggingface_hub from HF_ENDPOINT, then `pull --list`
    finds it in the hub cache beside an Ollama and an LM Studio model; a real process, its own environment."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "OLLAMA_MODELS": str(tmp_path / "ollama"),
           "LMSTUDIO_MODELS": str(tmp_path / "lms"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    add_ollama_model(tmp_path / "ollama", "tiny", tiny["whole"].read_bytes(), tag="q8")
    (tmp_path / "lms" / "pub" / "Tiny-GGUF").mkdir(parents=True)
    (tmp_path / "lms" / "pub" / "Tiny-GGUF" / "Tiny-Q8_0.gguf").write_bytes(tiny["whole"].read_bytes())
    strata = [sys.executable, "-m", "api.cli"]
    with FakeHub({"owner/Tiny-GGUF": _hub_repo(tiny)}).running() as fake:
        env["HF_ENDPOINT"] = fake.url
        pulled = subprocess.run([*strata, "pull", "-hf", "owner/Tiny-GGUF:Q8_0", "--no-warm"], env=env,
                                capture_output=True, text=True, timeout=120)
    assert pulled.returncode == 0, pulled.stderr
    path = Path(pulled.stdout.strip())
    assert path.name == "Tiny-Q8_0-00001-of-00003.gguf" and str(path).startswith(str(tmp_path / "hf"))
    listed = subprocess.run([*strata, "pull", "--list"], env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert any(line.startswith("ollama:tiny:q8 ") for line in lines)
    assert any(line.startswith("lmstudio:pub/Tiny-GGUF/Tiny-Q8_0.gguf ") for line in lines)
    assert any(line.startswith("hf:owner/Tiny-GGUF/Tiny-Q8_0-00001-of-00003.gguf ") for line in lines)


@pytest.mark.parametrize("store", ["ollama", "lmstudio"])
def test_serve_a_real_model_from_another_tools_store(store, smollm2_path, tmp_path, monkeypatch):
    """`strata serve --model ollama:smollm2:135m` (or lmstudio:...): SmolLM2's GGUF laid out as that tool keeps
    it, loaded from there in place, served under the store's name, and answering as SmolLM2 does."""
    import httpx

    from tests.support.server_harness import running_server

    data = smollm2_path.read_bytes()
    if store == "ollama":
        monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
        where = add_ollama_model(tmp_path, "smollm2", data, tag="135m")
        spec, served = "ollama:smollm2:135m", "smollm2:135m"
    else:
        monkeypatch.setenv("LMSTUDIO_MODELS", str(tmp_path))
        where = tmp_path / "bartowski" / "SmolLM2-135M-Instruct-GGUF" / "SmolLM2-135M-Instruct-Q4_1.gguf"
        where.parent.mkdir(parents=True)
        where.write_bytes(data)
        spec, served = "lmstudio:bartowski/SmolLM2-135M-Instruct-GGUF:Q4_1", \
            "bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf"
    with running_server(None, model=spec, batch=1, ctx_size=256) as (url, state):
        assert state.loaded.path == where
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [served]
        reply = httpx.post(f"{url}/v1/chat/completions", json={
            "model": served, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0}, timeout=600)
        assert reply.status_code == 200, reply.text
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
