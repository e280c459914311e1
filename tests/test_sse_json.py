"""SSE data lines survive clients that split decoded text on Unicode line breaks (api/sse.py)."""
import orjson
import pytest

from api.sse import sse_frame

TEXT = "a\u2028b\u2029c\u0085d\r\ne\x1cf"  # the three raw in orjson's output, and escaped control characters


@pytest.mark.parametrize("encode", [lambda obj: sse_frame(obj), lambda obj: sse_frame(obj, "x"),
                                    lambda obj: sse_frame({"type": "x", **obj}, "x")])
def test_every_dialect_writes_one_data_line_that_parses_back_to_the_same_text(encode):
    chunk = encode({"text": TEXT}).decode()
    lines = [line for line in chunk.splitlines() if line.startswith("data: ")]  # str.splitlines: the strictest
    assert len(lines) == 1 and chunk.count("\n") == len(chunk.splitlines())  # only the frame's own breaks
    assert orjson.loads(lines[0].removeprefix("data: "))["text"] == TEXT


def test_done_marker_is_unchanged():
    assert sse_frame("[DONE]") == b"data: [DONE]\n\n"
