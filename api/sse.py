"""The one server-sent-events writer every dialect streams through: frames, headers, and the loop that
turns a reply's typed events (api/reply_stream.py) into a dialect's frames.

Frames are ``event: NAME`` (Anthropic's and the Responses API's framing; chat completions send none), then
one ``data:`` line of JSON. SSE ends lines at CR, LF or CRLF only, and orjson escapes those; but it writes
U+2028, U+2029 and U+0085 raw (valid JSON), and a client that decodes the stream and splits it with
str.splitlines / httpx's line decoder or a JavaScript line regex cuts such an event in two (a fuzzed
`instructions` echoed in a Responses event did). Their escapes are the same JSON string, so every frame is
written with them.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable, Iterable

import orjson
from starlette.responses import StreamingResponse

log = logging.getLogger("strata.api")
# no-cache: never stored; X-Accel-Buffering: nginx (and proxies that copy it) pass each frame on at once
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
COMMENT_KEEPALIVE = b": keepalive\n\n"  # a comment line: SSE parsers (OpenAI's SDKs, the AI SDK) skip it
# UTF-8 is self-synchronising: these byte runs in valid UTF-8 are always these characters.
_UNICODE_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def sse_json(obj: Any) -> bytes:
    """orjson.dumps(obj) with the three Unicode line breaks escaped (the same value once parsed)."""
    data = orjson.dumps(obj)
    for raw, escaped in _UNICODE_LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def sse_frame(data: Any, event: str | None = None) -> bytes:
    """One frame: an optional ``event:`` line, then ``data:`` with ``data`` as JSON (a str goes as it is:
    chat completions' ``[DONE]``)."""
    payload = data.encode() if isinstance(data, str) else sse_json(data)
    head = b"event: " + event.encode() + b"\n" if event is not None else b""
    return head + b"data: " + payload + b"\n\n"


def sse_response(frames: AsyncIterator[bytes] | Iterable[bytes]) -> StreamingResponse:
    """A streaming response of ``frames`` with the headers every dialect's stream carries."""
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)


async def encode_stream(events: AsyncIterator[Any], encode: Callable[[Any], list[bytes]],
                        on_bug: Callable[[], list[bytes]], opening: Iterable[bytes] = ()) -> AsyncIterator[bytes]:
    """``opening``, then each event's frames as ``encode`` writes them. An exception (a bug) is logged and
    ends the stream with ``on_bug()``'s frames, the way the dialect's clients expect a failure to end;
    closing the frames (a client that went away) closes ``events``, which aborts the request."""
    try:
        for frame in opening:
            yield frame
        async for event in events:
            for frame in encode(event):
                yield frame
    except Exception:
        log.exception("the reply stream failed")
        for frame in on_bug():
            yield frame
    finally:
        await events.aclose()
