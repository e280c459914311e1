"""numba's disk cache re-keyed on the files a kernel calls into (engine/backends/cpu/numba_cache_deps.py).

Two tiny modules in a scratch folder: `caller.f` (cached) returns `callee.g()`. After `callee.py` alone is
edited, numba by itself still loads f's stale entry (the old g compiled into it); keyed on callee's source,
f recompiles. Each run is a fresh interpreter, as a server restart after a `git pull` is."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CALLER = """
from numba import njit
import callee
from engine.backends.cpu.numba_cache_deps import key_on_sources

@njit(cache=True)
def f():
    return callee.g()

KEYED = key_on_sources(globals(), ["callee"]) if {keyed} else 0
"""
CALLEE = "from numba import njit\n\n@njit(cache=True)\ndef g():\n    return {value}\n"


OVERLOADING_CALLER = """
from numba import njit
from numba.extending import overload
import callee
from engine.backends.cpu.numba_cache_deps import key_on_sources

def h():
    raise NotImplementedError

@overload(h{options})
def _h():
    return lambda: callee.g()

@njit(cache=True)
def f():
    return h()

KEYED = key_on_sources(globals(), ["callee"])
"""


def _run(folder: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
    env.pop("NUMBA_CACHE_DIR", None)  # the cache beside the sources, as a checkout has it
    done = subprocess.run([sys.executable, "-c", "import caller; print(caller.f(), caller.KEYED)"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize("keyed", [False, True])
def test_an_edit_to_the_callee_alone_recompiles_the_caller_only_when_keyed(tmp_path, keyed):
    (tmp_path / "caller.py").write_text(CALLER.format(keyed=keyed))
    (tmp_path / "callee.py").write_text(CALLEE.format(value=1))
    assert _run(tmp_path) == ["1", "1" if keyed else "0"]  # compiled and cached
    assert _run(tmp_path)[0] == "1"  # loaded from the cache
    (tmp_path / "callee.py").write_text(CALLEE.format(value=22))  # caller.py untouched
    got = _run(tmp_path)[0]
    assert got == ("22" if keyed else "1")  # numba alone: the stale entry, the old g inside it


@pytest.mark.parametrize("module, dependencies", [
    ("fused_layer", ["fused_matvec", "half", "repacked_rows", "int8_matvec", "int8_repack", "gguf_dequant",
                     "simd_dot", "llvm_ir"]),
    ("fused_step", ["fused_layer", "fused_matvec", "int8_matvec", "int8_repack", "gguf_dequant", "step_sync",
                    "half", "repacked_rows", "simd_dot", "llvm_ir"]),
    ("repacked_rows", ["half", "int8_repack"]),
    ("fused_matvec", ["gguf_dequant"]), ("gguf_row_kernels", ["gguf_dequant"]),
    ("int8_matvec", ["int8_repack", "simd_dot", "llvm_ir"]),
    ("int8_gemm", ["half", "int8_repack", "vnni_tile", "int8_matvec", "llvm_ir"])])
def test_the_kernel_modules_key_every_cached_dispatcher_on_what_they_call(module, dependencies):
    import importlib

    from engine.backends.cpu.numba_cache_deps import sources_digest

    namespace = vars(importlib.import_module(f"engine.backends.cpu.{module}"))
    digest = sources_digest(f"engine.backends.cpu.{name}" for name in dependencies)
    own = [v for v in namespace.values() if getattr(v, "py_func", None) is not None
           and v.py_func.__module__ == namespace["__name__"] and getattr(v, "_cache", None) is not None]
    assert own and all(v._cache._cache_file._source_stamp[1] == digest for v in own)  # (numba's, ours)


@pytest.mark.parametrize("cached_overload", [False, True])
def test_an_overload_is_fresh_only_when_it_is_not_cached_on_its_own(tmp_path, cached_overload):
    """numba caches an overload's implementation under its own file, where key_on_sources cannot reach:
    cached, it keeps the old callee inside the re-keyed caller (so the kernel modules do not cache theirs)."""
    options = ', jit_options={"cache": True}' if cached_overload else ""
    (tmp_path / "caller.py").write_text(OVERLOADING_CALLER.format(options=options))
    (tmp_path / "callee.py").write_text(CALLEE.format(value=1))
    assert _run(tmp_path)[0] == "1"
    (tmp_path / "callee.py").write_text(CALLEE.format(value=22))
    assert _run(tmp_path)[0] == ("1" if cached_overload else "22")


def test_kernel_modules_that_inline_other_modules_do_not_cache_their_overloads():
    import re

    for path in (ROOT / "engine" / "backends").rglob("*.py"):
        source = path.read_text()
        keyed = re.search(r"key_on_sources\(globals\(\), \[\s*\S", source)
        if keyed:
            assert 'jit_options={"cache": True}' not in source, path.name
