"""Which event loop uvicorn runs strata on: uvloop on Linux and macOS, winloop (uvloop's Windows port, a
platform-marked dependency in pyproject.toml) on Windows; the standard asyncio loop where neither imports."""
from __future__ import annotations

import importlib.util
import sys

WINLOOP_FACTORY = "winloop:new_event_loop"  # uvicorn (>= 0.36) takes a loop factory as "module:callable"


def uvicorn_loop(platform: str | None = None) -> str:
    """uvicorn's `loop` setting for this platform (``sys.platform`` unless given)."""
    if (platform or sys.platform) == "win32":
        return WINLOOP_FACTORY if importlib.util.find_spec("winloop") is not None else "asyncio"
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
