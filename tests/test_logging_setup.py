"""Structured log lines: key=value and JSON carry the message verbatim, the fields and the request id."""
import io
import json
import logging
import re

import pytest

from api.logging_setup import (OWNED_LOGGERS, configure_logging, new_request_id, request_id_var,
                               use_request_id)

SUMMARY = "prompt 120 tokens = 0 reused (device 0, host 0, disk 0) + 120 read in 350 ms (343 tok/s), 40 generated, 0 tools"


@pytest.fixture
def capture():
    """Configures logging into a buffer and restores the loggers' previous state afterwards."""
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).level,
                    logging.getLogger(name).propagate) for name in OWNED_LOGGERS}
    stream = io.StringIO()

    def configure(log_format: str, level: str = "info") -> io.StringIO:
        configure_logging(log_format, level, stream=stream)
        return stream

    yield configure
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_kv_line_carries_message_fields_and_request_id(capture):
    stream = capture("kv")
    with use_request_id("req-abc"):
        logging.getLogger("strata.api").info(SUMMARY, extra={"fields": {"prompt_tokens": 120, "note": "two words"}})
    (line,) = lines(stream)
    assert re.match(r"ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z level=info logger=strata\.api ", line)
    assert f'msg="{SUMMARY}"' in line
    assert line.endswith('request_id=req-abc prompt_tokens=120 note="two words"')


def test_kv_values_with_quotes_and_newlines_stay_on_one_line(capture):
    stream = capture("kv")
    logging.getLogger("strata").warning('say "hi"\nthen go', extra={"fields": {"path": "a=b"}})
    (line,) = lines(stream)
    assert r'msg="say \"hi\"\nthen go"' in line and 'path="a=b"' in line


def test_json_line_carries_message_fields_and_request_id(capture):
    stream = capture("json")
    token = request_id_var.set("req-def")
    try:
        logging.getLogger("strata.scheduler").info(SUMMARY, extra={"fields": {"prompt_tokens": 120, "reused": 0}})
    finally:
        request_id_var.reset(token)
    (line,) = lines(stream)
    record = json.loads(line)
    assert record["msg"] == SUMMARY and SUMMARY in line
    assert (record["level"], record["logger"], record["request_id"]) == ("info", "strata.scheduler", "req-def")
    assert (record["prompt_tokens"], record["reused"]) == (120, 0)
    assert list(record)[:4] == ["ts", "level", "logger", "msg"]


def test_request_id_in_fields_wins_over_the_context(capture):
    stream = capture("json")
    with use_request_id("req-context"):
        logging.getLogger("strata").info("done", extra={"fields": {"request_id": "req-field"}})
    assert json.loads(lines(stream)[0])["request_id"] == "req-field"


def test_no_request_id_outside_a_request(capture):
    stream = capture("json")
    logging.getLogger("strata").info("starting")
    assert "request_id" not in json.loads(lines(stream)[0])


def test_fields_cannot_overwrite_core_keys(capture):
    stream = capture("json")
    logging.getLogger("strata").info("real", extra={"fields": {"msg": "fake", "level": "debug"}})
    record = json.loads(lines(stream)[0])
    assert (record["msg"], record["level"], record["msg_"], record["level_"]) == ("real", "info", "fake", "debug")


def test_exception_is_one_escaped_field(capture):
    stream = capture("kv")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("strata").exception("failed")
    (line,) = lines(stream)
    assert "level=error" in line and "RuntimeError: boom" in line


def test_level_filters_and_reconfiguring_does_not_duplicate(capture):
    stream = capture("kv", "warning")
    capture("kv", "warning")
    logging.getLogger("strata.x").info("hidden")
    logging.getLogger("strata.x").warning("shown")
    assert len(lines(stream)) == 1 and 'msg="shown"' in lines(stream)[0]


def test_uvicorn_lines_share_the_format(capture):
    stream = capture("json")
    logging.getLogger("uvicorn.error").info("Started server process")
    assert json.loads(lines(stream)[0])["logger"] == "uvicorn.error"


def test_unknown_format_or_level_is_a_value_error():
    with pytest.raises(ValueError, match="--log-format"):
        configure_logging("xml", "info")
    with pytest.raises(ValueError, match="--log-level"):
        configure_logging("kv", "loud")


def test_new_request_id_is_req_and_24_hex():
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"req-[0-9a-f]{24}", rid) for rid in ids)
