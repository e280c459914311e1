"""What one step of a batch group computes: every decode, then prompt chunks within the step's token budget.

    decodes      every running request past its prompt brings its next token, every step (they keep their
                 pace: a step never leaves one out for a prompt)
    prompts      the requests still reading their prompt, fewest pending tokens first (ties: the oldest):
                 each takes a chunk of at most --prefill-chunk tokens; the next one joins the step only when
                 every prompt before it ends within this step, and while the step's prompt tokens stay under
                 --prefill-step-tokens

    step:  [d d d | A: last 120 of its prompt | B: all 300 | C: first 92 ]   prefill_chunk 512, budget 512
    step:  [d d d | C: 512 of its 2000 ]                                     a prompt that goes on: alone

So prompts that arrive together and fit the budget are read in the same step (one bigger product instead of
several small steps, and their first tokens come together, as llama-server's batch reads them), while long
prompts are read one after another, shortest first: reading two long prompts side by side would delay both
first tokens to the end of both prompts, where one after the other the first is ready halfway. A short prompt
that arrives while a long one is read is read in the next step rather than waiting behind it. The chunk cap
bounds one step's cost (the running decodes wait that long for their next token) and its attention scratch.
"""
from __future__ import annotations

from typing import Iterable

from scheduler.request import Request


def compose_step(running: Iterable[Request], prefill_chunk: int, step_tokens: int) -> list[tuple[Request, int]]:
    """The step's work [(request, new tokens)]: decodes first (oldest first), then prompt chunks as the
    module docstring says. Pure: reads the requests, changes nothing. The first prompt always gets its
    chunk, so a --prefill-step-tokens below --prefill-chunk means one prompt per step, never none."""
    ordered = sorted(running, key=lambda r: r.admitted_s)
    work = [(r, 1) for r in ordered if not r.is_prefilling]
    prompts = sorted((r for r in ordered if r.is_prefilling), key=lambda r: (r.seq.num_pending, r.admitted_s))
    taken = 0
    for request in prompts:
        pending = request.seq.num_pending
        n = min(prefill_chunk, pending) if not taken else min(prefill_chunk, pending, step_tokens - taken)
        if n <= 0:
            break
        work.append((request, n))
        taken += n
        if n < pending:  # this prompt goes on next step: no younger one is read beside it
            break
    return work
