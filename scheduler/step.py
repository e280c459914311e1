"""The end of one engine step, on the last pipeline stage's worker: sampling from the step's logits.

Sampling runs there (not on the event loop) because sorting a 50K-entry distribution for top-p is
milliseconds of numpy that would otherwise stall HTTP handling. A request with a grammar waits here for the
token mask its constraint began computing when the step was scheduled (engine/grammar.py), normally done by
now: it ran beside the forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.request import Request, TokenLogprob


@dataclass
class StepResult:
    request: Request
    token: int | None  # None: the request is still reading its prompt
    logprob: TokenLogprob | None = None


def sample_step(work: list[tuple[Request, int]], logits: np.ndarray) -> list[StepResult]:
    """Sample a token for every request of the computed work [(request, new tokens)] whose prompt is done
    (logits: one row per request)."""
    results = []
    for row, (request, _) in zip(logits, work):
        if request.seq.num_pending:  # prompt chunk that did not reach the end of the prompt
            results.append(StepResult(request, None))
            continue
        mask = request.constraint.mask() if request.constraint is not None else None
        token = request.sampler.sample(row, mask)
        logprob = _logprob(row, token, request.top_logprobs) if request.top_logprobs is not None else None
        results.append(StepResult(request, token, logprob))
    return results


def _logprob(row: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    """Log-probabilities under the model's raw distribution (before penalties and temperature)."""
    shifted = row.astype(np.float64) - float(row.max())
    logprobs = shifted - np.log(np.exp(shifted).sum())
    top: list[tuple[int, float]] = []
    if top_n > 0:
        best = np.argpartition(-logprobs, top_n - 1)[:top_n]
        best = best[np.argsort(-logprobs[best], kind="stable")]
        top = [(int(i), float(logprobs[i])) for i in best]
    return TokenLogprob(token, float(logprobs[token]), top)
