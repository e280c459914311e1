"""`strata serve`: listen at once, load the model and warm its kernels, then serve; stop gracefully.

While the model loads and its kernels compile (engine/warmup.py) the port already answers: /health 503
{"status": "loading"}, every other route 503 (api/server.py LoadingState). Once ready the engine loop runs
beside uvicorn on one event loop. On SIGTERM / Ctrl+C the server stops admitting (503 and /health says
so), lets in-flight requests finish for up to --shutdown-timeout-s, then cancels what is left and exits.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import uvicorn

from api.checkpoint_hints import find_line_end_ids, find_message_start_id
from api.chat_protocol import create_chat_protocol
from api.config import ServerConfig
from api.config_checks import AUTO_CTX_CAP, resolve_ctx_size
from api.event_loop import uvicorn_loop
from api.reply_journal import ReplyJournal, journal_path
from api.reply_memory import ReplyMemory
from api.sampling_defaults import load_sampling_defaults
from api.server import LoadingState, ServerState, create_app
from engine.backends.cuda.device import leave_outside_arena
from engine.loader import LoadedModel, open_model
from engine.units import MIB
from engine.warmup import warm_model
from scheduler.cache.disk_tier import cache_key, model_file_identity
from scheduler.engine_build import create_engine
from scheduler.engine_loop import EngineLoop

log = logging.getLogger("strata.serve")
STEP_GRACE_S = 30.0  # after --shutdown-timeout-s, time for the engine step in flight to end its streams


def build_state(config: ServerConfig, loaded: LoadedModel | None = None) -> ServerState:
    """Load the model (unless given), build its engine (scheduler/engine_build.py) and the API's state."""
    elastic_max_mib = (config.kv_cache_range_mib or (0, 0))[1]
    if loaded is None and elastic_max_mib:  # cuda: the elastic pool's chunks come from outside the arena
        leave_outside_arena(int(elastic_max_mib * MIB))
    loaded = loaded or open_model(config.model, chat_template_path=config.chat_template,
                                  max_positions=config.ctx_size or AUTO_CTX_CAP, backend_name=config.backend,
                                  cpu_weights=config.cpu_weights, expert_cache_mib=config.expert_cache_mib)
    loaded.model.backend.prepare_decode(loaded.model)  # numpy: the fused decoder's repacking
    ctx_size = resolve_ctx_size(config.ctx_size, loaded.model.config.context_length)
    if ctx_size > loaded.model.config.context_length:
        log.warning("--ctx-size %d exceeds the model's trained context of %d tokens",
                    ctx_size, loaded.model.config.context_length)
    protocol = create_chat_protocol(loaded.chat_template, loaded.tokenizer, config.tool_call_format,
                                    config.reasoning_format, config.tool_call_recovery)
    engine, metrics = create_engine(config, loaded, ctx_size, hidden_token_ids=protocol.hidden_token_ids)
    served = config.served_model_name or loaded.served_name
    aliases = {served, config.model, loaded.served_name, loaded.path.name, loaded.path.stem}
    message_start = find_message_start_id(loaded.chat_template, loaded.tokenizer) \
        if loaded.model.config.is_hybrid else None
    line_ends = find_line_end_ids(loaded.tokenizer) if loaded.model.config.is_hybrid else frozenset()
    return ServerState(config, loaded, engine, metrics, ctx_size, served, aliases, protocol=protocol,
                       message_start_id=message_start, line_end_ids=line_ends,
                       sampling_defaults=load_sampling_defaults(loaded.path, config.default_temperature),
                       replies=create_reply_memory(config, loaded))


def create_reply_memory(config: ServerConfig, loaded: LoadedModel) -> ReplyMemory | None:
    """--keep-reply-tokens on: the memory of the replies generated, with a disk tier also in a file there
    (api/reply_journal.py), keyed by the model file as the tier's directory is."""
    if config.keep_reply_tokens != "on":
        return None
    memory = ReplyMemory()
    if config.conversation_cache_dir:
        path = journal_path(config.conversation_cache_dir, cache_key(model_file_identity(loaded.path), ("replies", 1)))
        journal = ReplyJournal(path)
        memory.attach_journal(journal)
        log.info("reply memory: %d replies (%d tokens) loaded from %s%s", memory.stats["replies_loaded"],
                 memory.num_tokens, path, f", {journal.skipped} unreadable lines skipped" if journal.skipped else "")
    return memory


def load_state(config: ServerConfig, loaded: LoadedModel | None = None) -> ServerState:
    """build_state, then the warm-up of the model's kernels for its K/V type and layer split (on a runner
    of its own: the server's pool and cache stay untouched): all `strata serve` does before it is ready."""
    state = build_state(config, loaded)
    warm_model(state.loaded.model, state.engine.runner.layout.kv_type, config.layer_cuts)
    return state


@contextlib.asynccontextmanager
async def _lifespan(app):
    if isinstance(app.state.strata, ServerState):  # built before serving; a loading one starts when loaded
        _start_engine(app.state.strata)
    yield
    state = app.state.strata  # the ready state, when loading ended meanwhile
    state.is_shutting_down = True
    if isinstance(state, ServerState):
        await state.engine.shutdown(timeout_s=1.0)  # uvicorn already waited --shutdown-timeout-s for requests
        if state.replies is not None:
            state.replies.close()  # the replies' file gets what is queued (api/reply_journal.py)


def _start_engine(state: ServerState) -> None:
    state.engine.start()
    _install_pool_signals(state.engine)
    log.info("serving %s on http://%s:%d", state.served_name, state.config.host, state.config.port)


async def _in_daemon_thread(fn: Callable[[], ServerState]) -> ServerState:
    """fn() on a daemon thread of its own: a stop during a minute of kernel compilation then exits at once,
    where the event loop's default executor would hold the process until fn returned."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            settle, value = future.set_result, fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            settle, value = future.set_exception, exc

        def done() -> None:
            if not future.done():  # cancelled: the server stopped while this ran
                settle(value)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(done)

    threading.Thread(target=run, name="strata-load", daemon=True).start()
    return await future


def _install_pool_signals(engine: EngineLoop) -> None:
    """SIGUSR1 shrinks an elastic device pool to its minimum (parking, never dropping), SIGUSR2 gives it its
    whole range back; the operator's endpoint without the HTTP. Each is a queued memory-admission request."""
    if not engine.cache.admission.device_reserved_blocks or sys.platform == "win32" \
            or threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return
    loop = asyncio.get_running_loop()

    def resize(to_min: bool) -> None:
        admission = engine.cache.admission
        target = admission.device_min_blocks if to_min else admission.device_reserved_blocks
        name = "SIGUSR1" if to_min else "SIGUSR2"

        def done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is None:
                log.info("device pool on %s: %s", name, task.result(), extra={"fields": task.result()})
        loop.create_task(engine.resize_device_pool(target)).add_done_callback(done)

    loop.add_signal_handler(signal.SIGUSR1, resize, True)
    loop.add_signal_handler(signal.SIGUSR2, resize, False)


class _GracefulServer(uvicorn.Server):
    """uvicorn server that flips /health to 503 and refuses new work as soon as a stop is asked for.

    Given `load`, it listens as soon as uvicorn has started (the app holding a LoadingState), runs `load` on
    a thread of its own, then puts the ServerState it returned in the app and starts its engine; a load
    that raised stops the server and is kept in `load_error`."""

    def __init__(self, config: uvicorn.Config, app, load: Callable[[], ServerState] | None = None):
        super().__init__(config)
        self.strata_app = app
        self.load = load
        self.load_error: BaseException | None = None
        self._load_task: asyncio.Task | None = None

    @property
    def strata_state(self) -> ServerState | LoadingState:
        return self.strata_app.state.strata

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.load is not None and self.started:
            config = self.strata_state.config
            log.info("listening on http://%s:%d; /health answers 503 \"loading\" until the model is loaded and "
                     "its kernels are warm", config.host, config.port)
            self._load_task = asyncio.get_running_loop().create_task(self._load_then_serve())

    async def _load_then_serve(self) -> None:
        started = time.perf_counter()
        try:
            state = await _in_daemon_thread(self.load)
        except Exception as exc:  # noqa: BLE001 - run_server raises it once uvicorn has stopped
            self.load_error, self.should_exit = exc, True
            return
        if self.strata_state.is_shutting_down:  # stopped while loading: nothing to start
            return
        self.strata_app.state.strata = state
        _start_engine(state)
        log.info("ready after %.1f s of loading and warm-up", time.perf_counter() - started)

    async def shutdown(self, sockets=None) -> None:
        if self._load_task is not None:
            self._load_task.cancel()
        await super().shutdown(sockets)

    def handle_exit(self, sig, frame) -> None:
        state = self.strata_state
        if not state.is_shutting_down and not isinstance(state, ServerState):
            log.info("stopping while the model loads")  # the load's thread is a daemon: nothing waits for it
            state.is_shutting_down = True
        elif not state.is_shutting_down:
            log.info("stopping: finishing in-flight requests for up to %.0f s", state.config.shutdown_timeout_s)
            state.is_shutting_down = True
            state.engine.stop_admitting()
            # At the deadline, cancel what is still running through the engine, so every stream gets its
            # final chunk and [DONE] once the step in flight ends; uvicorn's own hard deadline comes
            # STEP_GRACE_S later (create_server), room for that step even on a slow CPU.
            loop = state.engine.event_loop
            if loop is not None:
                loop.call_soon_threadsafe(loop.call_later, state.config.shutdown_timeout_s, state.engine.cancel_all)
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal after shutting down, which ends the process "killed by
        # SIGTERM"; a stop that completed gracefully is a success, so exit with status 0 instead.
        self._captured_signals.clear()


def create_server(state: ServerState | LoadingState, port: int | None = None,
                  load: Callable[[], ServerState] | None = None) -> _GracefulServer:
    """The uvicorn server of a ready `state`; or, given `load` (and a LoadingState), one that listens at once
    and serves the ServerState `load` returns from when it returns (_GracefulServer)."""
    config = state.config
    loop = uvicorn_loop()
    log.debug("event loop: %s", loop)
    app = create_app(state, lifespan=_lifespan)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port if port is None else port,
        loop=loop, log_config=None, access_log=False,
        timeout_graceful_shutdown=config.shutdown_timeout_s + STEP_GRACE_S,
    )
    return _GracefulServer(uv_config, app, load)


def blas_threads(num_stages: int) -> int:
    """BLAS and kernel threads per stage worker when not set: the cores shared out among the stages computing
    at once (OpenBLAS's thread count is process-wide, and two stages each asking for every core oversubscribe)."""
    return max(1, (os.cpu_count() or 1) // num_stages)


def run_server(config: ServerConfig) -> int:
    """Blocking entry point of `strata serve`."""
    from engine.cpu_threads import limit_threads

    limit_threads(config.threads or blas_threads(len(config.layer_cuts) + 1))
    log.info("effective configuration", extra={"fields": config.as_log_dict()})
    server = create_server(LoadingState(config), load=lambda: load_state(config))
    server.run()
    if server.load_error is not None:  # e.g. a model that does not exist: the CLI says why, exit status 2
        raise server.load_error
    return 0
