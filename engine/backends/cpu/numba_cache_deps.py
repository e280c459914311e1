"""numba's on-disk cache checks only the file a jitted function is defined in; this adds the files it calls into.

A jitted function that calls jitted code (or reads a global constant) from another module carries that code
compiled into its own cache entry, and numba invalidates the entry only when the defining file's modification
time or size changes. After an edit or a `git pull` that touched only the callee's file, the caller would load
its stale entry: old kernels, wrong numbers (a stale fused decode layer once gave gemma3 garbage logits).

`key_on_sources(globals(), ["engine.backends.module", ...])`, called at the end of a kernel module, extends the stamp that each of
its cached dispatchers' index is checked against with a digest of the named modules' sources, so an edit to
any of them recompiles the dependents at their next first call. It touches numba's cache-file object
(`_cache._cache_file._source_stamp`, stable across numba 0.5x-0.6x); where that is missing it warns once and
the cache behaves as numba's own.
"""
from __future__ import annotations

import hashlib
import importlib
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("strata.numba")
_warned = False


def sources_digest(module_names: Iterable[str]) -> str:
    """sha256 over the named modules' source files (in the given order), hex, 16 characters."""
    digest = hashlib.sha256()
    for name in module_names:
        digest.update(Path(importlib.import_module(name).__file__).read_bytes())
    return digest.hexdigest()[:16]


def key_on_sources(namespace: dict[str, Any], dependencies: Iterable[str]) -> int:
    """Key every cached dispatcher defined in `namespace` (a module's globals()) on `dependencies`' sources
    too. Call once per module, after its functions are defined and before any is called. Returns how many
    dispatchers were keyed (tests)."""
    global _warned
    digest = sources_digest(dependencies)
    keyed = 0
    for value in list(namespace.values()):
        py_func = getattr(value, "py_func", None)
        cache = getattr(value, "_cache", None)
        if py_func is None or cache is None or py_func.__module__ != namespace["__name__"]:
            continue  # not a dispatcher, or one imported from elsewhere (its own module keys it)
        cache_file = getattr(cache, "_cache_file", None)
        if cache_file is None or not hasattr(cache_file, "_source_stamp"):
            if not _warned and type(cache).__name__ != "NullCache":
                log.warning("numba's cache layout changed: kernels are not re-keyed on the files they call; "
                            "after editing a kernel file, clear __pycache__/*.nbi by hand")
                _warned = True
            continue
        # numba's own cache-file object: it has no public hook for extra dependencies (module docstring)
        cache_file._source_stamp = (cache_file._source_stamp, digest)
        keyed += 1
    return keyed
