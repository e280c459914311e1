"""Run the real server (uvicorn + uvloop + engine loop) in-process on a free port, in a background thread."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx

from api.config import ServerConfig
from api.sampling_defaults import store_entry_for
from api.serve import build_state, create_server
from api.server import create_app

# The settings of the default-model server the API tests share (conftest's `server` fixture): context 2048 (a
# 2,000-token prefill fits, the 2,100- and 3,000-word prompts of the overflow tests do not), batch 4 (four
# concurrent streams).
SHARED_SERVER_FIELDS = {"ctx_size": 2048, "batch": 4}


def text_of_this_test(request, text: str) -> str:
    """`text` tagged with the running test's name, so no other test sends the same prompt. A test on a shared
    server that asserts an exact reuse (turn two reuses turn one and no more) needs one: the server's cache keeps
    what earlier tests asked, and a conversation another test already continued past turn one would match
    further. ``request`` is pytest's fixture of that name."""
    return f"{text} ({request.node.name})"


@contextlib.contextmanager
def running_server(loaded, with_server: bool = False, **config_fields):
    """Yield (base_url, state) of a server on 127.0.0.1:<free port>; stops it gracefully afterwards.

    With ``with_server=True`` yield (base_url, state, server, thread) instead: the uvicorn server object
    (to call ``server.handle_exit(signal.SIGTERM, None)`` as a signal would) and the thread running it.
    ``loaded=None`` loads ``model`` (a config field, then required) as `strata serve --model` does.
    """
    config_fields.setdefault("conversation_cache_mib", 64)  # tests: keep the committed host tier small
    if loaded is not None:
        entry = store_entry_for(loaded.path)  # --model as a user names it: requests for "smollm2" are served
        config_fields.setdefault("model", entry.name if entry is not None else str(loaded.path))
    config = ServerConfig(port=0).replace(**config_fields)
    state = build_state(config, loaded)
    server = create_server(state, port=0)
    thread = threading.Thread(target=server.run, name="strata-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        yield (url, state, server, thread) if with_server else (url, state)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def run_on_app(loaded, work, **config_fields):
    """Run `work(state, client)` on one event loop with the engine started and the app on an ASGI client
    (no socket, no thread: the engine's steps and the requests share the loop); returns what work returns."""
    fields = dict(batch=1, ctx_size=64, conversation_cache_mib=0, prefill_chunk=16) | config_fields
    config = ServerConfig(port=0).replace(**fields)
    state = build_state(config, loaded)

    async def main():
        state.engine.start()
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            try:
                return await work(state, client)
            finally:
                await state.engine.shutdown(timeout_s=5)

    return asyncio.run(main())
