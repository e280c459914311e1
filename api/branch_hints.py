"""Where a hybrid model's prompt most likely branches from a later one, beyond the message starts: a request's
checkpoint hints (scheduler/cache/checkpoints.py takes a state checkpoint at each).

A hybrid model resumes a cached prefix only where the cache holds its recurrent state, and the first prompt
that leaves a cached one at a new place recomputes from the checkpoint before it (the place itself gets one
then, scheduler/cache/hybrid_steps.py). Measured on the cache benchmark's workloads (docs/BENCHMARKS.md,
issue 28), first branches fall at four kinds of place:

    <|im_start|>user\\n Tell me about the history ...      <|im_start|>  the message start (api/checkpoint_hints.py)
    ^message start    ^content start                      content start: a new conversation, a trimmed history's
                                                          next message, a fan-out's next question (same role,
                                                          other text: the role header is shared, 3-5 tokens)
    ...- tool_2: ...\\n\\n To call ...                      paragraph start: a list or section that grows or
                       ^                                  shrinks (a toggled tool list) ends at its blank line

    <|im_start|>user\\n Tell me about the history ...      8 and 16 tokens into the content: messages written
                      ^       ^       ^                   from one pattern (a question, "part 3", a file name)
                                                          differ in their first words; a branch in the first 24
                                                          tokens of a content recomputes fewer than 8

A message has one content start and paragraphs are few, so a message of 17 tokens or more has four states
where it had one: on the tiny qwen3next (a state = 5 K/V block slots) they took a new conversation's, a trimmed
history's, a fan-out's and a toggled tool list's first branch from 4-31 recomputed tokens to under 8. They are
taken only where the device has room for them, and under pressure given up, parked and dropped by the rules
every checkpoint follows (scheduler/cache/checkpoints.py): the closest to the state before them go first, and
the two into the content (guesses, not branch points) before the others.
"""
from __future__ import annotations

from bisect import bisect_right

import numpy as np

from api.checkpoint_hints import message_starts

INTO_CONTENT = (8, 16)  # tokens into a message's content: a branch in its first 24 recomputes < 8


def content_starts(prompt_ids: list[int], message_start_id: int | None, line_end_ids: frozenset[int]) -> tuple[int, ...]:
    """Positions where a message's content begins: after the first line end that follows its start token
    (ChatML's `<|im_start|>user\\n`, Llama 3's `...<|end_header_id|>\\n\\n`, Gemma's `<start_of_turn>user\\n`
    all end the role header with a line), when that comes before the next message starts."""
    if message_start_id is None or not line_end_ids or not prompt_ids:
        return ()
    ids = np.asarray(prompt_ids)
    starts = np.flatnonzero(ids == message_start_id)
    ends = np.flatnonzero(np.isin(ids, np.fromiter(line_end_ids, np.int64, len(line_end_ids))))
    if not len(starts) or not len(ends):
        return ()
    first_end = np.searchsorted(ends, starts, side="right")  # the first line end after each start
    out = []
    for i, (start, j) in enumerate(zip(starts, first_end)):
        following = starts[i + 1] if i + 1 < len(starts) else len(ids)
        if j < len(ends) and ends[j] < following:
            out.append(int(ends[j]) + 1)
    return tuple(p for p in out if p < len(ids))


def paragraph_starts(prompt_ids: list[int], line_end_ids: frozenset[int]) -> tuple[int, ...]:
    """Positions p where a blank line begins (token p - 1 ends a line and token p is a line end too): where a
    shorter list or text has its blank line and a longer one goes on (the same place line_starts picks in a
    run of line ends, api/checkpoint_hints.py). A vocabulary that merges the blank line into one token has
    none of these."""
    if not line_end_ids or len(prompt_ids) < 2:
        return ()
    ends = np.isin(np.asarray(prompt_ids), np.fromiter(line_end_ids, np.int64, len(line_end_ids)))
    first = ends[1:] & ends[:-1]
    first[1:] &= ~ends[:-2]  # the first blank line of a run
    return tuple(int(p) + 1 for p in np.flatnonzero(first))


def into_content(content: tuple[int, ...], message_start_id: int | None, prompt_ids: list[int]) -> tuple[int, ...]:
    """Positions INTO_CONTENT tokens into each message's content (before the next message starts)."""
    if not content:
        return ()
    ends = [*message_starts(prompt_ids, message_start_id), len(prompt_ids)]
    return tuple(c + d for c in content for d in INTO_CONTENT if c + d < ends[bisect_right(ends, c)])


def branch_hints(prompt_ids: list[int], message_start_id: int | None,
                 line_end_ids: frozenset[int]) -> tuple[int, ...]:
    """A request's checkpoint hints (`Request.checkpoint_positions`, branch points), ascending: where its
    messages start, their contents start and its paragraphs start."""
    found = {*message_starts(prompt_ids, message_start_id), *content_starts(prompt_ids, message_start_id, line_end_ids),
             *paragraph_starts(prompt_ids, line_end_ids)}
    return tuple(sorted(p for p in found if p > 0))


def content_guesses(prompt_ids: list[int], message_start_id: int | None,
                    line_end_ids: frozenset[int]) -> tuple[int, ...]:
    """A request's checkpoint guesses (`Request.checkpoint_guesses`), ascending: 8 and 16 tokens into each
    message's content. Short of room they go before the hints, as periodic states do: a prompt that has
    just left a cached one there (a branch point, scheduler/cache/hybrid_steps.py) keeps that state first."""
    content = content_starts(prompt_ids, message_start_id, line_end_ids)
    return tuple(sorted(set(into_content(content, message_start_id, prompt_ids))))
