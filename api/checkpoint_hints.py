"""Where a hybrid model's prompt is worth a state checkpoint: just before each message of the conversation,
and, for the periodic ones, at the start of a line.

Agents' conversations diverge at message boundaries (a trimmed history, a toggled tool list, a fan-out of
questions over one context), and a hybrid model can only reuse a cached prefix up to a checkpoint
(scheduler/cache/checkpoints.py). The chat template opens every message with the same special token (ChatML's
`<|im_start|>`, Llama 3's `<|start_header_id|>`, Gemma's `<start_of_turn>`): it is the first token of what
`add_generation_prompt` appends. The positions of that token in a prompt are the request's checkpoint hints.
"""
from __future__ import annotations

import numpy as np


def find_message_start_id(chat_template, tokenizer) -> int | None:
    """The special token that opens each message of this template, or None when there is none."""
    messages = [{"role": "user", "content": "x"}]
    try:
        bare = chat_template.render(messages, add_generation_prompt=False)
        prompted = chat_template.render(messages, add_generation_prompt=True)
    except ValueError:
        return None
    if len(prompted) <= len(bare) or not prompted.startswith(bare):
        return None
    ids = tokenizer.encode(prompted[len(bare):], add_special=False)
    is_special = bool(ids) and tokenizer.decode(ids[:1], skip_special=True) == ""
    return ids[0] if is_special and ids[0] in tokenizer.encode(bare, add_special=False) else None


def message_starts(prompt_ids: list[int], token_id: int | None) -> tuple[int, ...]:
    """Positions p of the prompt where a message begins (the state after p tokens is worth keeping)."""
    if token_id is None:
        return ()
    return tuple(int(p) for p in np.flatnonzero(np.asarray(prompt_ids) == token_id) if p > 0)


def find_line_end_ids(tokenizer) -> frozenset[int]:
    """Tokens after which a line begins: a newline followed by nothing but spaces or tabs (BPE vocabularies
    merge a newline with the next line's indentation). Special tokens are never line ends."""
    special = tokenizer.special_ids
    out = []
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.token_piece(token_id)
        if b"\n" in piece and token_id not in special and not piece[piece.rindex(b"\n") + 1 :].strip(b" \t"):
            out.append(token_id)
    return frozenset(out)


def line_starts(prompt_ids: list[int], line_end_ids: frozenset[int]) -> tuple[int, ...]:
    """Positions p of the prompt where a line begins (token p - 1 ends a line), ascending; of a run of line
    ends (blank lines) only the first counts: a list that grows by a line branches there, where the shorter
    text has its blank line. Texts change a line at a time (a tool added to a list, a file edited), so a
    periodic checkpoint there is more often where a later prompt leaves this one than one a few tokens
    into a line (scheduler/cache/checkpoints.py)."""
    if not line_end_ids or not prompt_ids:
        return ()
    ends = np.isin(np.asarray(prompt_ids), np.fromiter(line_end_ids, np.int64, len(line_end_ids)))
    first = ends.copy()
    first[1:] &= ~ends[:-1]  # [t] ends a line and [t - 1] does not
    return tuple(int(p) + 1 for p in np.flatnonzero(first[:-1]))
