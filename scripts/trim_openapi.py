"""Write ``tests/data/openai_openapi_subset.json``: OpenAI's OpenAPI document cut down to the routes strata serves.

CI has no network beyond the package registries, so tests/test_openapi_fuzz.py fuzzes strata against a
committed subset of the published document (repository openai/openai-openapi, file ``openapi.json``):
the operations below, the ``components`` entries they reference (followed transitively through every
``$ref``), and the bearer security scheme. ``servers`` becomes ``/v1`` so a test's base URL is the server's
root plus ``/v1``; everything else (tags, webhooks, code samples in ``x-oaiMeta``) is dropped. The upstream
commit is recorded in ``info.x-strata-upstream``.

Usage::

    python scripts/trim_openapi.py /path/to/openapi.json --commit <40-hex upstream commit> [--out PATH]

To get the full document: ``git clone https://github.com/openai/openai-openapi`` (or any snapshot of it),
then ``git -C openai-openapi show <commit>:openapi.json > /tmp/openapi.json``.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

# (path in the document, method): the operations of api/server.py's routes that OpenAI's document describes.
# Not in it: /v1/messages and /v1/messages/count_tokens (Anthropic's dialect), and strata's utility routes
# (/health, /metrics, /slots, /cache, /cache/device-pool, /pipeline, /tokenize, /detokenize,
# /apply-template, /server_info, /model_info, /get_load).
SERVED_OPERATIONS = (
    ("/chat/completions", "post"),
    ("/completions", "post"),
    ("/models", "get"),
    ("/responses", "post"),
    ("/responses/{response_id}", "get"),
)
UPSTREAM_REPOSITORY = "openai/openai-openapi"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "openai_openapi_subset.json"
MAX_OUT_BYTES = 2 * 2**20


def _refs(node: Any) -> set[str]:
    """Every ``$ref`` string anywhere under ``node``."""
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                found.add(ref)
            stack.extend(value for key, value in item.items() if key != "$ref")
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _component_key(ref: str) -> tuple[str, str]:
    """``#/components/schemas/Foo`` -> ("schemas", "Foo"); only local component references are expected."""
    match = re.fullmatch(r"#/components/([^/]+)/([^/]+)", ref)
    assert match, f"unexpected $ref {ref!r}: only #/components/<kind>/<name> references are handled"
    return match.group(1), match.group(2)


def referenced_components(document: dict, roots: list[Any]) -> dict[str, dict[str, Any]]:
    """The components reachable from ``roots`` through ``$ref``, as {kind: {name: definition}}."""
    components = document["components"]
    picked: dict[str, dict[str, Any]] = {}
    todo = set().union(*(_refs(root) for root in roots))
    while todo:
        kind, name = _component_key(todo.pop())
        if name in picked.get(kind, {}):
            continue
        definition = components[kind][name]
        picked.setdefault(kind, {})[name] = definition
        todo |= _refs(definition)
    return {kind: dict(sorted(entries.items())) for kind, entries in sorted(picked.items())}


def _operation(document: dict, path: str, method: str) -> dict:
    operation = dict(document["paths"][path][method])
    operation.pop("x-oaiMeta", None)  # code samples for the docs site: large and not part of the contract
    return operation


def trim(document: dict, commit: str) -> dict:
    """The subset document: the served operations, what they reference, and where it came from."""
    paths: dict[str, dict] = {}
    for path, method in SERVED_OPERATIONS:
        paths.setdefault(path, {})[method] = _operation(document, path, method)
    components = referenced_components(document, list(paths.values()))
    components["securitySchemes"] = {"ApiKeyAuth": document["components"]["securitySchemes"]["ApiKeyAuth"]}
    info = dict(document["info"])
    info["x-strata-upstream"] = {"repository": UPSTREAM_REPOSITORY, "commit": commit, "path": "openapi.json",
                                 "operations": [f"{method.upper()} {path}" for path, method in SERVED_OPERATIONS]}
    return {"openapi": document["openapi"], "info": info, "servers": [{"url": "/v1"}],
            "security": [{"ApiKeyAuth": []}], "paths": paths, "components": components}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("document", type=Path, help="the full openapi.json of openai/openai-openapi")
    parser.add_argument("--commit", required=True, help="the upstream commit the document was taken from")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[0-9a-f]{40}", args.commit):
        parser.error(f"--commit must be a full 40-hex commit id, got {args.commit!r}")
    subset = trim(json.loads(args.document.read_text(encoding="utf-8")), args.commit)
    text = json.dumps(subset, indent=1, ensure_ascii=False) + "\n"
    size_bytes = len(text.encode("utf-8"))
    if size_bytes > MAX_OUT_BYTES:
        raise SystemExit(f"the subset is {size_bytes} bytes, over the {MAX_OUT_BYTES}-byte limit for test data")
    args.out.write_text(text, encoding="utf-8")
    schemas = len(subset["components"].get("schemas", {}))
    print(f"wrote {args.out}: {len(SERVED_OPERATIONS)} operations, {schemas} schemas, {size_bytes} bytes")


if __name__ == "__main__":
    main()
