"""The JSON of a server-sent event's `data:` line, safe for clients that split text on Unicode line breaks.

SSE ends lines at CR, LF or CRLF only, and orjson escapes those; but it writes U+2028, U+2029 and U+0085 raw
(valid JSON), and a client that decodes the stream and splits it with str.splitlines / httpx's line
decoder or a JavaScript line regex cuts such an event in two (a fuzzed `instructions` echoed in a
Responses event did). Their escapes are the same JSON string, so every event is written with them."""
from __future__ import annotations

from typing import Any

import orjson

# UTF-8 is self-synchronising: these byte runs in valid UTF-8 are always these characters.
_UNICODE_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def sse_json(obj: Any) -> bytes:
    """orjson.dumps(obj) with the three Unicode line breaks escaped (the same value once parsed)."""
    data = orjson.dumps(obj)
    for raw, escaped in _UNICODE_LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data
