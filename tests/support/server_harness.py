"""Run the real server (uvicorn + uvloop + engine loop) in-process on a free port, in a background thread."""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace

from api.config import ServerConfig
from api.sampling_defaults import store_entry_for
from api.serve import build_state, create_server


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
    config = replace(ServerConfig(port=0), **config_fields)
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
