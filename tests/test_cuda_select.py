"""Backend selection without a GPU: probe() never raises, auto falls back to numpy and says why."""
import logging

import pytest

from engine.backends.cuda import device as cuda_device
from engine.backends.reference.backend import NumpyBackend
from engine.loader import choose_backend, create_backend


def test_probe_answers_without_raising_on_this_machine():
    available, reason = cuda_device.probe()
    assert isinstance(available, bool) and reason


def test_probe_names_the_missing_cuda_python(monkeypatch):
    monkeypatch.setattr(cuda_device, "driver", None)
    assert cuda_device.probe() == (False, "cuda-python not installed (pip install -e '.[cuda]')")


def test_probe_reports_a_failing_cuinit(monkeypatch):
    class NoDevice:
        CUresult = None

        @staticmethod
        def cuInit(flags):
            return (100,)

        @staticmethod
        def cuGetErrorName(err):
            return (0, b"CUDA_ERROR_NO_DEVICE")

    monkeypatch.setattr(cuda_device, "driver", NoDevice)
    assert cuda_device.probe() == (False, "no CUDA driver (cuInit: CUDA_ERROR_NO_DEVICE)")


def test_probe_reports_a_missing_driver_library(monkeypatch):
    class NoLibrary:
        @staticmethod
        def cuInit(flags):
            raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(cuda_device, "driver", NoLibrary)
    available, reason = cuda_device.probe()
    assert not available and reason.startswith("no CUDA driver (libcuda not loadable")


def test_auto_picks_numpy_without_cuda_python_and_logs_why(monkeypatch, caplog):
    monkeypatch.setattr(cuda_device, "driver", None)
    with caplog.at_level(logging.INFO, logger="strata.loader"):
        backend = create_backend("auto")
    assert isinstance(backend, NumpyBackend)
    assert "backend numpy: cuda-python not installed (pip install -e '.[cuda]')" in caplog.text


def test_auto_without_a_driver_is_numpy_on_this_machine(caplog):
    if cuda_device.probe()[0]:
        pytest.skip("this machine has a GPU")
    with caplog.at_level(logging.INFO, logger="strata.loader"):
        assert isinstance(create_backend("auto"), NumpyBackend)
    assert "backend numpy: " in caplog.text


def test_cuda_without_a_device_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cuda_device, "probe", lambda ordinal=0: (False, "no CUDA driver (cuInit: X)"))
    with pytest.raises(ValueError, match=r"--backend cuda: no CUDA driver \(cuInit: X\); use --backend auto"):
        create_backend("cuda")


def test_numpy_is_never_probed(monkeypatch):
    monkeypatch.setattr(cuda_device, "probe", lambda ordinal=0: pytest.fail("probed"))
    assert choose_backend("numpy") == ("numpy", "asked for (--backend numpy)")


def test_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        create_backend("tpu")


def test_auto_falls_back_when_the_cuda_backend_cannot_start(monkeypatch, caplog):
    from engine.backends.cuda import backend as cuda_backend

    monkeypatch.setattr(cuda_device, "probe", lambda ordinal=0: (True, "Fake GPU (sm_90)"))

    def broken(*args, **kwargs):
        raise ImportError("No module named 'cuda_kernels.registry'")

    monkeypatch.setattr(cuda_backend, "CudaBackend", broken)
    with caplog.at_level(logging.INFO, logger="strata.loader"):
        assert isinstance(create_backend("auto"), NumpyBackend)
    assert "CUDA backend could not start (ImportError" in caplog.text
    with pytest.raises(ValueError, match="the CUDA backend could not start"):
        create_backend("cuda")
