"""Generating a completion for one prompt without the server: used by `strata generate` and the tests.

The prompt is computed in chunks (chunked prefill is both what the server does and faster on numpy for
long prompts), then one token per step until max_tokens, an end-of-generation token or a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from engine.sampling import Sampler, SamplingParams
from engine.sequence import ModelRunner, Sequence
from engine.stop import StopStringMatcher
from engine.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # "stop" (EOS or stop string) or "length"


def prefill(runner: ModelRunner, seq: Sequence, chunk: int):
    """Compute every pending token of seq in chunks; returns the logits of its last token [1, vocab]."""
    if not runner.ensure_blocks(seq, len(seq.token_ids)):
        raise MemoryError(
            f"the KV pool ({runner.layout.num_blocks} blocks of {runner.block_size}) cannot hold "
            f"{len(seq.token_ids)} tokens"
        )
    logits = None
    while seq.num_pending:
        logits = runner.step([(seq, min(chunk, seq.num_pending))])
    return logits


def generate_stream(
    runner: ModelRunner,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    prefill_chunk: int = 256,
    completion: Completion | None = None,
) -> Iterator[str]:
    """Yield text deltas of the completion; fills `completion` (if given) as it goes.

    The sequence's blocks are released at the end, whatever happens.
    """
    completion = completion if completion is not None else Completion(list(prompt_ids))
    limit = runner.layout.num_slots
    if len(prompt_ids) + params.max_tokens > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"context of {limit} tokens"
        )
    seq = Sequence(list(prompt_ids))
    sampler, decoder = Sampler(params), IncrementalDecoder(tokenizer)
    stops = StopStringMatcher(params.stop)
    eos_ids = set() if params.ignore_eos else set(tokenizer.eos_ids)
    try:
        logits = prefill(runner, seq, prefill_chunk)
        while True:
            token = sampler.sample(logits[-1])
            if token in eos_ids:
                completion.finish_reason = "stop"
                break
            completion.token_ids.append(token)
            delta = stops.push(decoder.push(token))
            completion.text += delta
            if delta:
                yield delta
            if stops.stopped:
                completion.finish_reason = "stop"
                break
            if len(completion.token_ids) >= params.max_tokens:
                completion.finish_reason = "length"
                break
            seq.token_ids.append(token)
            runner.ensure_blocks(seq, len(seq.token_ids))
            logits = runner.step([(seq, 1)])
        tail = "" if stops.stopped else stops.push(decoder.flush()) + stops.flush()
        if tail:
            completion.text += tail
            yield tail
    finally:
        runner.release(seq)


def generate(runner, tokenizer, prompt_ids, params, prefill_chunk: int = 256) -> Completion:
    """Non-streaming form of generate_stream."""
    completion = Completion(list(prompt_ids))
    for _ in generate_stream(runner, tokenizer, prompt_ids, params, prefill_chunk, completion):
        pass
    return completion
