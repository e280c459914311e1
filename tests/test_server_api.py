"""The HTTP server driven by the real `openai` client (and httpx for raw bodies), on the default model."""
import threading
import time

import httpx
import openai
import pytest

from engine.generate import generate
from engine.loader import encode_chat_prompt
from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from tests.support.server_harness import SHARED_SERVER_FIELDS, running_server

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def _engine_greedy(smollm2, prompt_ids, max_tokens):
    runner = ModelRunner(smollm2.model, 64, 16)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return generate(runner, smollm2.tokenizer, prompt_ids, params).text


def test_chat_greedy_equals_strata_generate_and_usage_is_exact(client, smollm2):
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=40)
    prompt_ids = encode_chat_prompt(smollm2.tokenizer, smollm2.chat_template.render(QUESTION))
    assert reply.choices[0].message.content == _engine_greedy(smollm2, prompt_ids, 40)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 7)
    assert usage.total_tokens == len(prompt_ids) + 7


def test_a_servers_first_request_reports_no_cached_tokens_and_its_repeat_all_but_the_last(smollm2):
    # its own server: on the shared one, other tests' requests may already hold this prompt's prefix
    with running_server(smollm2, ctx_size=256, batch=1) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = dict(model="smollm2", messages=QUESTION, temperature=0, max_tokens=1)
        first = client.chat.completions.create(**ask).usage
        again = client.chat.completions.create(**ask).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens - 1


def test_streaming_chat_equals_whole_reply_and_reports_usage(client):
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "Name three colors."}], temperature=0,
                  max_tokens=12)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    # the same prompt again: everything but its last token comes from the cache
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_completions_whole_and_streamed(client):
    whole = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=8, temperature=0)
    streamed = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=8, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.usage.completion_tokens == 8 and whole.object == "text_completion"


def test_logprobs_are_returned_for_chat(client):
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=3,
                                           logprobs=True, top_logprobs=2)
    entries = reply.choices[0].logprobs.content
    assert [e.token for e in entries] == ["The", " capital", " of"]
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-9 for e in entries)


def test_four_concurrent_streams_match_their_solo_outputs(client):
    prompts = ["Tell me about cats.", "What is 2+2?", "Write a haiku about rain.", "List some fruits."]

    def run(prompt, out, i):
        stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                                temperature=0, max_tokens=16, stream=True)
        out[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    solo = [None] * 4
    for i, p in enumerate(prompts):
        run(p, solo, i)
    together = [None] * 4
    threads = [threading.Thread(target=run, args=(p, together, i)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == solo


def test_disconnect_frees_the_slot(server):
    url, state = server
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()  # kept alive: a discarded iterator closes the connection
        next(lines)
        _wait_until(lambda: any(s["state"] != "idle" for s in httpx.get(url + "/slots").json()))
    deadline = time.monotonic() + 5
    while any(s["state"] != "idle" for s in httpx.get(url + "/slots").json()):
        assert time.monotonic() < deadline, "slot still busy after the client disconnected"
        time.sleep(0.02)
    cache = state.engine.cache
    _wait_until(lambda: cache.num_free == cache.num_blocks, timeout_s=5)  # every block unpinned again
    cache.check_integrity()


def test_health_answers_quickly_during_a_long_prefill(server):
    url, _ = server
    done = threading.Event()

    def long_prompt():
        httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": list(range(100, 2100)),
                                                  "max_tokens": 1}, timeout=300)
        done.set()

    threading.Thread(target=long_prompt).start()
    latencies = []
    with httpx.Client() as c:
        time.sleep(0.2)
        while not done.is_set():
            t0 = time.perf_counter()
            assert c.get(url + "/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
    assert len(latencies) >= 5
    assert sorted(latencies)[len(latencies) // 2] < 0.1  # median under 100 ms while a 2,000-token prefill runs


def test_queue_overflow_answers_503_with_retry_after(smollm2):
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with running_server(smollm2, batch=1, max_queue=1, ctx_size=1024) as (url, state):
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30):
            _wait_until(lambda: state.engine.slots_snapshot()[0]["state"] != "idle")  # holds the only slot
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30):
                _wait_until(lambda: state.engine.queue_depth == 1)  # waits in the queue
                third = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert third.status_code == 503
    assert int(third.headers["retry-after"]) >= 1
    assert third.json()["error"]["type"] == "service_unavailable"


def _wait_until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_utility_routes(server):
    url, _ = server
    models = httpx.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
    vllm = httpx.post(url + "/tokenize", json={"model": "smollm2", "prompt": "Hello world"}).json()
    assert vllm == {"tokens": [19556, 905], "count": 2, "max_model_len": SHARED_SERVER_FIELDS["ctx_size"]}
    assert httpx.post(url + "/tokenize", json={"content": "Hello world"}).json() == {"tokens": [19556, 905]}
    assert httpx.post(url + "/detokenize", json={"tokens": [19556, 905]}).json()["content"] == "Hello world"
    prompt = httpx.post(url + "/apply-template", json={"messages": QUESTION}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n")
    chat_form = httpx.post(url + "/tokenize", json={"messages": QUESTION}).json()
    assert chat_form["count"] == len(chat_form["tokens"]) > 20
    # a generation of its own: the two families have samples only once a step ran, and on the shared server
    # this test may be the first to ask anything
    assert httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 1},
                      timeout=60).status_code == 200
    metrics = httpx.get(url + "/metrics").text
    assert "strata_generated_tokens_total" in metrics and "strata_step_seconds_bucket" in metrics
