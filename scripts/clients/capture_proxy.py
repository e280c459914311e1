"""A pass-through between an agent client and strata that writes down what went each way.

    .venv/bin/python scripts/clients/capture_proxy.py LISTEN_PORT UPSTREAM_PORT CAPTURE.jsonl

Every request is one JSON line (n, method, path, query, the body parsed as JSON where it is JSON) before it is
forwarded, and its response another (n, status, the body as it went, SSE events and all) once the body ended or
the client hung up. Bodies are relayed as they arrive, so streaming, keepalives and a client's abort behave as
without it. scripts/client_compat.sh puts one in front of the server: the model's replies are in the responses,
and each request shows how the client sent the previous reply back.
"""
from __future__ import annotations

import itertools
import json
import sys
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}
METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]


def create_app(upstream_url: str, capture_path: str) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream_url, timeout=None)
    numbers = itertools.count(1)
    capture = open(capture_path, "a", encoding="utf-8")

    def write(record: dict) -> None:
        capture.write(json.dumps(record, ensure_ascii=False) + "\n")
        capture.flush()

    async def forward(request: Request) -> StreamingResponse:
        n, body = next(numbers), await request.body()
        try:
            shown = json.loads(body) if body else None
        except ValueError:
            shown = body.decode(errors="replace")
        url = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        write({"n": n, "ts": round(time.time(), 3), "method": request.method, "url": url, "request": shown})
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        response = await client.send(client.build_request(request.method, url, headers=headers, content=body),
                                     stream=True)

        async def relay():
            parts: list[bytes] = []
            try:
                async for chunk in response.aiter_raw():
                    parts.append(chunk)
                    yield chunk
            finally:
                await response.aclose()
                write({"n": n, "ts": round(time.time(), 3), "status": response.status_code,
                       "response": b"".join(parts).decode(errors="replace")})

        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)

    return Starlette(routes=[Route("/{path:path}", forward, methods=METHODS)])


def main() -> None:
    listen_port, upstream_port, capture_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    app = create_app(f"http://127.0.0.1:{upstream_port}", capture_path)
    uvicorn.run(app, host="127.0.0.1", port=listen_port, log_level="warning", timeout_keep_alive=600)


if __name__ == "__main__":
    main()
