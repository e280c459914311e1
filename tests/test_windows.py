"""The Windows-only code paths, run here by simulating the platform where that is honest: every strata module
imported with ``sys.platform == "win32"`` and the POSIX-only modules unavailable, the event loop uvicorn gets
(winloop), the device-pool signals skipped where SIGUSR1/2 do not exist, machine memory without /proc or
cgroup files. What cannot be simulated (cmd.exe running scripts/strata-console.cmd, Windows paths) is not."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import types
from pathlib import Path

import uvicorn

from api import event_loop
from api.config import ServerConfig
from api.serve import _install_pool_signals, create_server
from api.server import LoadingState

REPO = Path(__file__).resolve().parent.parent

# Third-party packages and the standard library are imported first, as on Linux: they ship their own Windows
# builds, and the standard library's POSIX halves (subprocess, os) cannot run under a pretended platform.
# Then the platform reads "win32", the modules Windows lacks raise ImportError, and every strata module is
# imported. engine/backends/cpu/step_sync.py takes SwitchToThread's address from ctypes.windll at import; the
# stand-in is a real C function of the same shape (no arguments, int result): libc's sched_yield.
_IMPORT_ALL_AS_WINDOWS = r"""
import ctypes, importlib, importlib.abc, pkgutil, sys, sysconfig, types
sysconfig.get_config_vars()  # cached now: read again under "win32" it would look for Windows' build data
import numpy, numba, starlette, uvicorn, httpx, jinja2, tokenizers, llguidance, pydantic, psutil, gguf
import huggingface_hub, prometheus_client, jsonschema, orjson, subprocess, multiprocessing, concurrent.futures
POSIX_ONLY = {"resource", "fcntl", "termios", "pwd", "grp", "uvloop", "posix_ipc"}
for name in POSIX_ONLY:
    sys.modules.pop(name, None)

class Windows(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in POSIX_ONLY:
            raise ModuleNotFoundError(f"No module named {name!r} (simulated Windows)")
        return None

sys.meta_path.insert(0, Windows())
sys.platform = "win32"
ctypes.windll = types.SimpleNamespace(kernel32=types.SimpleNamespace(SwitchToThread=ctypes.CDLL(None).sched_yield))
failed = []
for package in ("engine", "scheduler", "api", "cuda_kernels"):
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
print("\n".join(failed) or "all imported")
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_under_a_simulated_windows():
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL_AS_WINDOWS], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.strip() == "all imported"


def test_windows_serves_on_winloop_through_uvicorns_loop_factory(monkeypatch):
    fake_winloop = types.ModuleType("winloop")
    fake_winloop.new_event_loop = asyncio.new_event_loop  # the stand-in: what uvicorn must call for a loop
    monkeypatch.setitem(sys.modules, "winloop", fake_winloop)
    monkeypatch.setattr(event_loop.importlib.util, "find_spec",
                        lambda name: object() if name == "winloop" else None)
    monkeypatch.setattr(sys, "platform", "win32")
    server = create_server(LoadingState(ServerConfig(port=0)), load=lambda: None)
    assert server.config.loop == event_loop.WINLOOP_FACTORY
    assert server.config.get_loop_factory() is fake_winloop.new_event_loop


def test_windows_without_winloop_falls_back_to_asyncio_and_linux_keeps_uvloop(monkeypatch):
    monkeypatch.setattr(event_loop.importlib.util, "find_spec", lambda name: None)
    assert event_loop.uvicorn_loop("win32") == "asyncio"
    monkeypatch.undo()
    assert event_loop.uvicorn_loop("linux") == "uvloop"  # installed here, as pyproject's marker says
    assert uvicorn.Config(app=None, loop="uvloop").get_loop_factory() is not None


def test_device_pool_signals_are_left_alone_where_there_is_no_sigusr1(monkeypatch):
    """On Windows signal.SIGUSR1/2 do not exist: installing the pool's handlers must not touch them."""
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.delattr(signal, "SIGUSR1")
    monkeypatch.delattr(signal, "SIGUSR2")
    engine = types.SimpleNamespace(cache=types.SimpleNamespace(admission=types.SimpleNamespace(
        device_reserved_blocks=64, device_min_blocks=8)))

    async def install():
        _install_pool_signals(engine)

    asyncio.run(install())  # raises AttributeError if it reached for signal.SIGUSR1
