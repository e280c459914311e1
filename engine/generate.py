"""Generating a completion for one prompt without the server: used by `strata generate` and the tests.

The prompt is computed in chunks (chunked prefill is both what the server does and faster on numpy for
long prompts), then one token per step until the reply ends by the server's rules (engine/reply_text.py:
an end-of-generation token, a stop string, max_tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from engine.reply_text import ReplyText
from engine.sampling import Sampler, SamplingParams
from engine.sequence import ModelRunner, Sequence
from engine.tokenizer import Tokenizer

# Most prompt tokens computed in one step: the server's --prefill-chunk default (api/config.py reads it here).
PREFILL_CHUNK = 512


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
    prefill_chunk: int = PREFILL_CHUNK,
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
    sampler, reply = Sampler(params), ReplyText(tokenizer, params)
    try:
        logits = prefill(runner, seq, prefill_chunk)
        while True:
            token = sampler.sample(logits[-1])
            if reply.ends_on(token):
                completion.finish_reason = "stop"
                break
            completion.token_ids.append(token)
            delta = reply.push(token)
            completion.text += delta
            if delta:
                yield delta
            reason = reply.finish_reason(len(completion.token_ids))
            if reason is not None:
                completion.finish_reason = reason
                break
            seq.token_ids.append(token)
            runner.ensure_blocks(seq, len(seq.token_ids))
            logits = runner.step([(seq, 1)])
        tail = reply.flush()
        if tail:
            completion.text += tail
            yield tail
    finally:
        runner.release(seq)


def generate(runner, tokenizer, prompt_ids, params, prefill_chunk: int = PREFILL_CHUNK) -> Completion:
    """Non-streaming form of generate_stream."""
    completion = Completion(list(prompt_ids))
    for _ in generate_stream(runner, tokenizer, prompt_ids, params, prefill_chunk, completion):
        pass
    return completion
