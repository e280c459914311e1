"""Structured logging for `strata serve`: one line per record, key=value (logfmt) or JSON.

Callers keep the human message readable and put machine fields beside it:

    log.info("prompt 120 tokens = 0 reused (device 0, host 0, disk 0) + 120 read in 350 ms (343 tok/s), 40 generated",
             extra={"fields": {"prompt_tokens": 120, "cached_tokens": 0}})

kv:   ts=2025-01-01T12:00:00.123Z level=info logger=strata.requests msg="prompt 120 ..." request_id=req-... prompt_tokens=120
json: {"ts":"2025-01-01T12:00:00.123Z","level":"info","logger":"strata.requests","msg":"prompt 120 tokens = ...",...}

The request id comes from `request_id_var` (set it once per request; asyncio tasks inherit it), or from a
"request_id" entry in `fields`, which wins.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import secrets
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any, TextIO

import orjson

LOG_FORMATS = ("kv", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# uvicorn's own loggers get the same handler so its start-up and error lines share the format; the server
# runs uvicorn with log_config=None and access_log=False, since strata writes its own per-request line.
OWNED_LOGGERS = ("strata", "uvicorn")
_CORE_KEYS = ("ts", "level", "logger", "msg", "request_id", "exc")
_BARE_VALUE = re.compile(r"[^\s\"'=\\\x00-\x1f\x7f]+")

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("strata_request_id", default=None)


def new_request_id() -> str:
    """A fresh id for one request: "req-" + 24 hex characters (96 random bits)."""
    return "req-" + secrets.token_hex(12)


@contextlib.contextmanager
def use_request_id(request_id: str | None) -> Iterator[str | None]:
    """Sets `request_id_var` for the body of the with-block (and tasks created in it), then restores it."""
    token = request_id_var.set(request_id)
    try:
        yield request_id
    finally:
        request_id_var.reset(token)


def configure_logging(log_format: str, level: str, stream: TextIO | None = None) -> logging.Handler:
    """Routes the "strata" (and "uvicorn") loggers to one handler writing `log_format` lines at `level`.

    Mutates global logging state; calling it again replaces the handler it installed before instead of
    adding a second one. The loggers stop propagating to the root logger so no line is written twice
    (the CLI's basicConfig handler sits there). `stream` defaults to stderr (journald, the console).
    Returns the installed handler. Raises ValueError on an unknown format or level.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format {log_format!r} is not one of: {', '.join(LOG_FORMATS)}")
    level_no = logging.getLevelName(level.upper())
    if not isinstance(level_no, int):
        raise ValueError(f"--log-level {level!r} is not one of: {', '.join(LOG_LEVELS)}")
    handler = _StrataHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else KeyValueFormatter())
    for name in OWNED_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _StrataHandler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level_no)
        logger.propagate = False
    return handler


class _StrataHandler(logging.StreamHandler):
    """Its own class so that a second configure_logging call finds and replaces it."""


def record_items(record: logging.LogRecord) -> list[tuple[str, Any]]:
    """The (key, value) pairs of one record in output order: core keys, then the caller's fields."""
    fields = dict(getattr(record, "fields", None) or {})
    request_id = fields.pop("request_id", None) or request_id_var.get()
    items: list[tuple[str, Any]] = [
        ("ts", _timestamp(record.created)),
        ("level", record.levelname.lower()),
        ("logger", record.name),
        ("msg", record.getMessage()),
    ]
    if request_id:
        items.append(("request_id", request_id))
    for key, value in fields.items():
        key = str(key).replace(" ", "_").replace("=", "_")
        # A field may not overwrite a core key: the line would lie about its level or message.
        items.append((key + "_" if key in _CORE_KEYS else key, value))
    if record.exc_info:
        items.append(("exc", logging.Formatter().formatException(record.exc_info)))
    elif record.stack_info:
        items.append(("exc", record.stack_info))
    return items


class KeyValueFormatter(logging.Formatter):
    """`key=value` pairs on one line; msg is always quoted, other values only when they need it."""

    def format(self, record: logging.LogRecord) -> str:
        parts = []
        for key, value in record_items(record):
            text = _kv_text(value)
            quote = key == "msg" or not _BARE_VALUE.fullmatch(text)
            # json.dumps escapes quotes, backslashes and newlines, so a record never spans two lines.
            parts.append(f"{key}={json.dumps(text, ensure_ascii=False) if quote else text}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per line (orjson); values orjson cannot encode are written as str()."""

    def format(self, record: logging.LogRecord) -> str:
        payload = dict(record_items(record))
        return orjson.dumps(payload, default=str, option=orjson.OPT_SERIALIZE_NUMPY).decode()


def _kv_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, bool):
        return orjson.dumps(value).decode()  # null, true, false
    if isinstance(value, (list, tuple, dict)):
        return orjson.dumps(value, default=str, option=orjson.OPT_SERIALIZE_NUMPY).decode()
    return str(value)


def _timestamp(created: float) -> str:
    # UTC with milliseconds, so lines from several hosts sort and compare without a timezone lookup.
    return datetime.fromtimestamp(created, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
