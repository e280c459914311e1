"""`--expert-cache-mib N|auto`: parsing the flag and giving a backend its expert cache before the model loads."""
from __future__ import annotations

import logging

from engine.backends.cuda.expert_cache.cache import ExpertCache

log = logging.getLogger("strata.expert_cache")


def parse_expert_cache_mib(spec) -> int | str | None:
    """`--expert-cache-mib`: None (off: every expert resident), "auto", or a positive MiB count (a fraction
    allowed: tiny test models have experts of a few KiB)."""
    if spec is None or spec == "":
        return None
    if str(spec).strip().lower() == "auto":
        return "auto"
    try:
        mib = float(spec)
    except ValueError:
        raise ValueError(f"--expert-cache-mib takes a MiB count or auto, got {spec!r}") from None
    if mib <= 0:
        raise ValueError(f"--expert-cache-mib must be positive (or auto), got {mib}")
    return mib


def configure_expert_cache(backend, spec) -> ExpertCache | None:
    """Give a backend an expert cache before its model loads (`--expert-cache-mib`); None when off. On a
    backend other than cuda the flag changes nothing (numpy reads experts from host memory anyway), so it
    is logged and ignored."""
    budget = parse_expert_cache_mib(spec)
    if budget is None:
        return None
    if not backend.capabilities.expert_cache:
        log.info("--expert-cache-mib %s ignored: the %s backend keeps every expert in host memory", spec,
                 backend.name)
        return None
    cache = ExpertCache(backend.device, budget)
    backend.expert_cache = cache  # cuda.moe.upload_experts puts the experts of each MoE layer into it
    return cache
