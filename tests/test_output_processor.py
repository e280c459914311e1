"""OutputProcessor: held-back text is released when a reply ends, whatever ends it."""
import asyncio

from engine.sampling import SamplingParams
from scheduler.output import OutputProcessor
from scheduler.request import Request
from scheduler.step import StepResult


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_text_held_back_as_a_stop_string_prefix_is_released_when_the_reply_ends_on_eos(load_tiny):
    _, tokenizer = load_tiny("llama", seed=3, n_ctx=64)
    token = next(t for t in range(3, tokenizer.vocab_size) if tokenizer.decode([t]).strip())
    text = tokenizer.decode([token])
    output = OutputProcessor(tokenizer)
    request = Request("r", [1, 2], SamplingParams(max_tokens=8, stop=(text + "\x00never",)))
    assert output.accept_token(request, StepResult(request, token)) is None
    assert "".join(d.text for d in _drain(request.outbox)) == ""  # held back: it may begin the stop string
    output.finish(request, "stop")  # the model then sampled EOS
    deltas = _drain(request.outbox)
    assert deltas[-1].finish_reason == "stop" and "".join(d.text for d in deltas) == text
