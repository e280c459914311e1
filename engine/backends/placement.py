"""Which architecture runs on which backend: decided here alone, from what an architecture needs and what
each backend declares (engine/backends/capabilities.py).

    arch --needs--> layer kinds, MoE ops, attention sinks --held against--> Backend.capabilities
    --backend auto: cuda where it can run the arch and has run it on a GPU, else numpy

The loader asks before it creates a backend (`backend_for_arch`, by name); load_model asks the backend it
was given (`require_runs`), so a backend built by hand (tests, scripts) is held to the same rule.
"""
from __future__ import annotations

import logging

from engine.backends.capabilities import ATTENTION, DELTA_NET, SHORT_CONV, Capabilities
from engine.moe_config import MOE_ARCHITECTURES

log = logging.getLogger("strata.loader")
# The layer kinds an arch needs; every other arch is attention layers only.
_LAYER_KINDS = {"lfm2": frozenset({ATTENTION, SHORT_CONV}), "qwen3next": frozenset({ATTENTION, DELTA_NET})}
_SINK_ARCHS = ("gpt-oss",)  # attention with a learned sink logit per head
# Archs cuda computes, but so far on the kernel emulator only, never on a GPU: --backend auto keeps them on
# numpy and logs why; --backend cuda runs them.
_EMULATED_ON_CUDA = ("lfm2",) + MOE_ARCHITECTURES


def capabilities_of(backend_name: str) -> Capabilities:
    """The capabilities backend `backend_name` (numpy or cuda) declares, without creating one."""
    if backend_name == "cuda":
        from engine.backends.cuda.backend import CudaBackend

        return CudaBackend.capabilities
    from engine.backends.reference.backend import NumpyBackend

    return NumpyBackend.capabilities  # the quantised numpy backend computes the same layers


def refusal(arch: str, backend_name: str, caps: Capabilities) -> str | None:
    """Why `arch` cannot run on backend `backend_name` declaring `caps` (a sentence naming the fix), or None."""
    missing = _LAYER_KINDS.get(arch, frozenset({ATTENTION})) - caps.layer_kinds
    if missing:
        return (f"{arch} is a hybrid model whose {'/'.join(sorted(missing))} layers have no kernels on the "
                f"{backend_name} backend yet; run it with --backend numpy")
    if arch in MOE_ARCHITECTURES and not caps.moe:
        return (f"{arch} is a mixture-of-experts model and the {backend_name} backend has no "
                "route_experts/expert_ffn yet; run it with --backend numpy")
    if arch in _SINK_ARCHS and not caps.attention_sinks:
        return (f"{arch} needs attention sinks, which the {backend_name} backend does not compute yet; "
                "run it with --backend numpy")
    return None


def require_runs(backend, arch: str) -> None:
    """ValueError (the refusal) unless `backend` can run `arch`."""
    reason = refusal(arch, backend.name, backend.capabilities)
    if reason is not None:
        raise ValueError(reason)


def backend_for_arch(arch: str, requested: str, file_name: str) -> str:
    """The backend to create for a model of `arch` when --backend is `requested` (auto, numpy, cuda): auto
    becomes numpy (logged) where cuda cannot run the arch or has run it on the emulator only; a backend
    that cannot run it is a ValueError naming the file and the fix."""
    if requested == "auto":
        why = refusal(arch, "cuda", capabilities_of("cuda"))
        if why is None and arch in _EMULATED_ON_CUDA:
            why = f"{arch}'s cuda path has run on the kernel emulator but not on a GPU yet (--backend cuda to try it)"
        if why is not None:
            log.info("backend auto -> numpy: %s", why)
            return "numpy"
        return requested
    reason = refusal(arch, requested, capabilities_of(requested))
    if reason is not None:
        raise ValueError(f"--backend {requested}: {file_name}: {reason}")
    return requested
