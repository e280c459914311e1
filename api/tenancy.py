"""API keys as tenants: with several keys configured, each key's requests share cached KV only with each
other (the key becomes part of the cache salt), as a request's own `cache_salt` does."""
from __future__ import annotations

import hmac


def api_keys(config) -> list[str]:
    """The configured keys (--api-key KEY[,KEY...]); empty when authentication is off."""
    return [k.strip() for k in (config.api_key or "").split(",") if k.strip()]


def is_known_key(given: str, keys: list[str]) -> bool:
    """Whether ``given`` is one of ``keys``, compared in constant time (hmac.compare_digest: a timing
    difference must not tell a caller how much of a key it guessed right)."""
    given_bytes = given.encode()
    return any(hmac.compare_digest(given_bytes, key.encode()) for key in keys)


def cache_salt_for(config, authorization: str, request_salt: str | None) -> str:
    """The salt under which a request's KV is cached and matched ("" for the shared default)."""
    tenant = authorization.removeprefix("Bearer ") if len(api_keys(config)) > 1 else ""
    if not tenant and not request_salt:
        return ""
    return f"key:{tenant}|salt:{request_salt or ''}"
