"""The server's life around requests: graceful stop on SIGTERM, prompt-progress and summary log lines, and
`strata serve --log-format json` run end to end as a real process."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request
from tests.support.server_harness import running_server

CHAT = "/v1/chat/completions"
PROGRESS = re.compile(r"reading the prompt: (\d+) of (\d+) tokens, (\d+) s so far")
# The per-request summary line; the "(device D, host H, disk K)" breakdown of the reused tokens is optional.
SUMMARY = re.compile(r"prompt (?P<N>\d+) tokens = (?P<R>\d+) reused(?: \(device \d+, host \d+, disk \d+\))? "
                     r"\+ (?P<M>\d+) read in \d+ ms \(\d+ tok/s\), (?P<G>\d+) generated, (?P<U>\d+) tools")


# -- graceful stop -------------------------------------------------------------------------------------------

def _post_after_stop(url: str, body: dict) -> str:
    """What a new request gets after SIGTERM: 'refused' (nothing listens), 'dropped' (the connection was
    accepted, then closed by uvicorn's shutdown before its request was read: no response at all), or '503'
    (asserting the exact shutting-down error object)."""
    try:
        response = httpx.post(url + CHAT, json=body, timeout=5)
    except httpx.ConnectError:
        return "refused"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "dropped"
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "server_is_overloaded")
    assert "shutting down" in error["message"] and int(response.headers["retry-after"]) >= 1
    return "503"


def _rest_of_stream(lines, signalled: float) -> list[str]:
    try:
        return list(lines)
    except httpx.RemoteProtocolError as exc:  # uvicorn's graceful-shutdown deadline cancelled the response
        pytest.fail(f"the stream was cut {time.monotonic() - signalled:.2f} s after SIGTERM, without a final "
                    f"chunk or [DONE] ({exc})")


@pytest.mark.slow
def test_sigterm_ends_a_running_stream_cleanly_refuses_new_work_and_exits(smollm2):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 2000, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with running_server(smollm2, with_server=True, shutdown_timeout_s=2, ctx_size=4096,
                        batch=2) as (url, state, server, thread):
        with httpx.stream("POST", url + CHAT, json=body, timeout=30) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            before = [next(lines) for _ in range(6)]  # the role chunk and a couple of tokens
            assert all(line == "" or line.startswith("data: {") for line in before)

            signalled = time.monotonic()
            server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler does on SIGTERM
            assert state.is_shutting_down

            # uvicorn closes its listening socket on its next tick (every 0.1 s). Until then a request that
            # reaches the app gets 503 (the engine no longer admits) and one caught between accept and the
            # close of idle connections is dropped without a response; afterwards connections are refused.
            # Nothing new is ever admitted.
            new = {**body, "stream": False, "max_tokens": 2}
            outcomes = [_post_after_stop(url, new)]
            while outcomes[-1] != "refused":
                assert time.monotonic() - signalled < 1.0, f"listening socket still open: {outcomes}"
                outcomes.append(_post_after_stop(url, new))
                time.sleep(0.01)
            assert set(outcomes[:-1]) <= {"503", "dropped"}, outcomes
            assert [_post_after_stop(url, new) for _ in range(3)] == ["refused"] * 3  # and it stays closed

            # The running stream goes on, then is cancelled through the engine (shutdown_timeout_s - 1 s)
            # and ends the way clients expect: a finish_reason chunk, the usage chunk, then [DONE].
            after = _rest_of_stream(lines, signalled)
            ended = time.monotonic() - signalled
        assert ended < 5.0, f"stream took {ended:.1f} s to end after SIGTERM"
        events = [line[len("data: "):] for line in after if line]
        assert events[-1] == "[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks), \
            "no tokens were streamed after the signal: in-flight requests should run on"
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] is not None and all(f is None for f in finishes[:-1])
        assert chunks[-1]["choices"] == [] and 0 < chunks[-1]["usage"]["completion_tokens"] < 2000

        thread.join(timeout=10)
        assert not thread.is_alive(), "server thread still running 10 s after SIGTERM"
        assert all(slot["state"] == "idle" for slot in state.engine.slots_snapshot())


@pytest.mark.slow
def test_sigterm_during_a_step_longer_than_a_second_still_ends_the_stream_with_done(smollm2, monkeypatch):
    """A step in flight when the engine cancels (a long prefill chunk on a CPU takes seconds) must not make
    the stream miss uvicorn's graceful-shutdown deadline: the client still gets its final chunk and [DONE]."""
    import scheduler.engine_loop as engine_loop_module

    real_step = engine_loop_module.sample_step

    def slow_prefill_step(work, logits):  # on the pipeline's last stage, inside the step
        if any(n > 1 for _, n in work):
            time.sleep(2.5)  # what a 512-token chunk of a long prompt costs on a small CPU
        return real_step(work, logits)

    monkeypatch.setattr(engine_loop_module, "sample_step", slow_prefill_step)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 100, "ignore_eos": True, "stream": True}
    with running_server(smollm2, with_server=True, shutdown_timeout_s=2, ctx_size=1024,
                        batch=1) as (url, state, server, thread):
        with httpx.stream("POST", url + CHAT, json=body, timeout=30) as response:
            assert response.status_code == 200
            deadline = time.monotonic() + 10
            while state.engine.slots_snapshot()[0]["state"] != "prefill":  # the slow step is running
                assert time.monotonic() < deadline
                time.sleep(0.005)
            signalled = time.monotonic()
            server.handle_exit(signal.SIGTERM, None)
            lines = _rest_of_stream(response.iter_lines(), signalled)
        events = [line[len("data: "):] for line in lines if line]
        assert events[-1] == "[DONE]"
        assert orjson.loads(events[-2])["choices"][0]["finish_reason"] is not None
        thread.join(timeout=10)
        assert not thread.is_alive()


# -- progress and summary lines ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(load_tiny):
    return load_tiny("llama", seed=3, n_ctx=512)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def request_log():
    """Records of the strata.requests logger, caught by a handler on that logger itself (configure_logging in
    other tests may have turned off propagation on the 'strata' loggers, so caplog cannot be relied on)."""
    logger = logging.getLogger("strata.requests")
    handler, old_level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _lines_of(records, request_id: str, pattern: re.Pattern) -> list[tuple[int, ...]]:
    out = []
    for record in records:
        if (getattr(record, "fields", None) or {}).get("request_id") != request_id:
            continue
        match = pattern.fullmatch(record.getMessage())
        if match:
            out.append(tuple(int(g) for g in match.groups() if g is not None))
    return out


def test_progress_lines_count_up_and_each_request_has_one_summary_line(tiny, request_log):
    model, tokenizer = tiny
    rng = np.random.default_rng(7)
    prompts = {"long": rng.integers(3, 250, size=61).tolist(), "other": rng.integers(3, 250, size=43).tolist()}
    generate = {"long": 5, "other": 3}

    async def main():
        loop = EngineLoop(ModelRunner(model, 256, 4), tokenizer, num_slots=2, prefill_chunk=8, max_queue=4,
                          progress_interval_s=0.0)
        loop.start()
        streams = [loop.submit(Request(rid, prompts[rid], SamplingParams(temperature=0, max_tokens=generate[rid],
                                                                         ignore_eos=True)))
                   for rid in prompts]
        finals = []
        for stream in streams:
            async for delta in stream:
                if delta.finish_reason is not None:
                    finals.append(delta.finish_reason)
        await loop.shutdown(1)
        return finals

    assert asyncio.run(main()) == ["length", "length"]
    for rid, prompt in prompts.items():
        n = len(prompt)
        progress = _lines_of(request_log, rid, PROGRESS)
        read = [x for x, _, _ in progress]
        # every chunk but the last, of at most 8 tokens (a prompt's first chunk may be what the step's budget left
        # after a shorter prompt finished: scheduler/step_plan.py)
        steps = [b - a for a, b in zip([0] + read, read)]
        assert read and all(0 < step <= 8 for step in steps), f"{rid}: progress lines read {read} of {n}"
        assert 0 < n - read[-1] <= 8, f"{rid}: progress lines read {read} of {n}"
        assert all(total == n and seconds >= 0 for _, total, seconds in progress)
        summaries = _lines_of(request_log, rid, SUMMARY)
        assert len(summaries) == 1, f"{rid}: {len(summaries)} summary lines"
        prompt_n, reused, computed, generated, tools = summaries[0]
        assert (prompt_n, reused, computed, generated, tools) == (n, 0, n, generate[rid], 0)
        fields = next(r.fields for r in request_log if r.getMessage().startswith("prompt ")
                      and r.fields["request_id"] == rid)
        assert (fields["prompt_tokens"], fields["generated_tokens"], fields["finish_reason"]) == (n, generate[rid],
                                                                                                 "length")


def test_a_request_aborted_inside_its_prompt_reports_what_it_read_and_leaves_it_cached(tiny, request_log):
    model, tokenizer = tiny
    prompt = np.random.default_rng(8).integers(3, 250, size=60).tolist()

    async def main():
        loop = EngineLoop(ModelRunner(model, 256, 4), tokenizer, num_slots=1, prefill_chunk=8, max_queue=4,
                          progress_interval_s=0.0)
        loop.start()
        request = Request("cut", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        stream = loop.submit(request)
        while request.seq is None or request.seq.num_computed < 24:
            await asyncio.sleep(0.001)
        loop.abort("cut")
        async for _ in stream:
            pass
        again = loop.submit(Request("again", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
        cached = [d.usage.cached_tokens async for d in again if d.finish_reason is not None]
        await loop.shutdown(1)
        return cached[0]

    cached = asyncio.run(main())
    _, reused, computed, _, _ = _lines_of(request_log, "cut", SUMMARY)[0]
    assert reused == 0 and 24 <= computed < len(prompt)  # what it had read when it was cut, not 0
    assert cached >= computed // 4 * 4  # its full blocks were kept: the retry reuses them


# -- `strata serve --log-format json`, a real process -------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_strata_serve_json_logs_carry_the_configuration_and_the_request_id(smollm2_path, tmp_path):
    port, url = _free_port(), None
    strata = Path(sys.executable).with_name("strata")
    stderr_path = tmp_path / "stderr.log"
    command = [str(strata), "serve", "--model", str(smollm2_path), "--port", str(port), "--log-format", "json",
               "--batch", "1", "--ctx-size", "512"]
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"strata serve exited early:\n{stderr_path.read_text()}"
            assert time.monotonic() < deadline, f"no /health after 60 s:\n{stderr_path.read_text()}"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        body = {"model": smollm2_path.stem, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "temperature": 0}
        response = httpx.post(url + CHAT, json=body, timeout=60)
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    text = stderr_path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    records = []
    for line in lines:
        try:
            records.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            pytest.fail(f"a stderr line is not JSON with --log-format json: {line!r}")
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    configs = [r for r in records if r["msg"] == "effective configuration"]
    assert len(configs) == 1
    assert (configs[0]["log_format"], configs[0]["batch"], configs[0]["ctx_size"], configs[0]["port"]) == \
        ("json", 1, 512, port)
    summaries = [r for r in records if r["logger"] == "strata.requests" and SUMMARY.fullmatch(r["msg"])]
    assert [r["request_id"] for r in summaries] == [request_id]
    assert summaries[0]["generated_tokens"] == response.json()["usage"]["completion_tokens"]
    assert returncode == 0, f"strata serve exited with {returncode} after SIGTERM (docs promise status 0)"
