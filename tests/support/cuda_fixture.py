"""The CudaBackend the CUDA test fixtures yield (conftest's `cuda`, test_cuda_moe's `emu`), on one driver."""
from __future__ import annotations

import pytest


def cuda_backend(kind: str, monkeypatch, request):
    """Yields a fresh CudaBackend (graphs off; the graph tests turn them on), poisoning every new activation,
    then closes it. kind "gpu": device 0 (skips without one); "fake": numpy twins of the kernels; "emulated":
    the real kernel sources under g++ (fake_cuda_emulated, built in the `emulator_dir` fixture's folder)."""
    driver = None
    if kind == "gpu":
        from engine.backends.cuda.device import probe

        available, reason = probe()
        if not available:
            pytest.skip(f"no CUDA device: {reason}")
    elif kind == "fake":
        from tests.support import fake_cuda

        driver = fake_cuda.install(monkeypatch)
    else:
        from tests.support import fake_cuda_emulated

        driver = fake_cuda_emulated.install(monkeypatch, request.getfixturevalue("emulator_dir"))
    from engine.backends.cuda.backend import CudaBackend

    backend = CudaBackend(graphs=False)
    backend.poison = True
    backend.test_driver = driver
    yield backend
    backend.close()
