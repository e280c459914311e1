"""`strata generate` ends a reply where the server would: both follow engine/reply_text.py's rules."""
import asyncio

from engine.generate import generate
from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.output import OutputProcessor
from scheduler.request import Request
from scheduler.step import StepResult


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _served(tokenizer, prompt: list[int], params: SamplingParams, token_ids: list[int]) -> tuple[str, str | None]:
    """(text, finish reason) the server's OutputProcessor makes of the same sampled tokens."""
    server, request = OutputProcessor(tokenizer), Request("r", prompt, params)
    reasons = [server.accept_token(request, StepResult(request, token)) for token in token_ids]
    assert all(reason is None for reason in reasons[:-1])
    server.finish(request, reasons[-1])
    return "".join(delta.text for delta in _drain(request.outbox)), reasons[-1]


def test_generate_stops_on_a_stop_string_and_the_token_budget_as_the_server_does(load_tiny):
    model, tokenizer = load_tiny("llama", seed=3, n_ctx=64)
    prompt = [1, 2, 3]
    greedy = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    free = generate(ModelRunner(model, 16, 4), tokenizer, prompt, SamplingParams(**greedy))
    assert free.finish_reason == "length" and len(free.token_ids) == 16
    assert (free.text, "length") == _served(tokenizer, prompt, SamplingParams(**greedy), free.token_ids)

    middle = len(free.text) // 2
    stop = free.text[middle:middle + 2]
    params = SamplingParams(**greedy, stop=(stop,))
    stopped = generate(ModelRunner(model, 16, 4), tokenizer, prompt, params)
    assert stopped.finish_reason == "stop" and stopped.text == free.text[:free.text.index(stop)]
    assert (stopped.text, "stop") == _served(tokenizer, prompt, params, stopped.token_ids)
