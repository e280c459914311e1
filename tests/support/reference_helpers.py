"""Shared by the reference tests: greedy decoding through the paged runner, the logits of every position of a
prompt and its reference continuation, and the comparisons against a reference (top-5, relative error)."""
import os

import numpy as np

from engine.sequence import ModelRunner, Sequence

# The real-model comparisons of one CPU path against another on the reference prompts (tests/data/*_reference.json;
# test_cpu_weights_reference.py, test_cpu_fused_reference.py): N_TOKENS greedy tokens per prompt; CI compares two
# prompts per model (the suite must stay under 15 minutes on 2 cores), every prompt with STRATA_FULL_REFERENCE=1.
N_TOKENS = 48
PROMPTS_IN_CI = None if os.environ.get("STRATA_FULL_REFERENCE") == "1" else 2


def greedy_with_logits(model, prompt_ids, n_new, chunk=64, block_size=16, **runner_args):
    """Greedy decode through the paged runner: chunked prefill, then one token per step.

    Returns (new ids, the logits row that chose each of them); runner_args go to ModelRunner (layer_split)."""
    runner = ModelRunner(model, num_blocks=-(-(len(prompt_ids) + n_new) // block_size) + 1, block_size=block_size,
                         **runner_args)
    seq = Sequence(list(prompt_ids))
    assert runner.ensure_blocks(seq, len(prompt_ids) + n_new)
    logits = None
    while seq.num_pending:
        logits = runner.step([(seq, min(chunk, seq.num_pending))])
    steps, out = [], []
    for _ in range(n_new):
        steps.append(logits[-1])
        out.append(int(np.argmax(logits[-1])))
        seq.token_ids.append(out[-1])
        logits = runner.step([(seq, 1)])
    return out, steps


def chunked_step_logits(runner, prompts, chunks=(5, 8, 1, 1)):
    """Logits of steps that batch every prompt's next `chunk` tokens (chunked prefill, then decode-sized
    steps; a finished prompt gets token 7 appended so the decode steps have work)."""
    seqs, out = [Sequence(list(p)) for p in prompts], []
    for chunk in chunks:
        work = [(s, min(chunk, s.num_pending)) for s in seqs if s.num_pending]
        for s, k in work:
            assert runner.ensure_blocks(s, s.num_computed + k)
        out.append(runner.step(work))
        for s in seqs:
            s.token_ids.append(7)
    return out


def assert_top5(logits_row, top5, message=""):
    """The reference's top-5 (id, logit) pairs, within 1e-3 relative."""
    ids = [i for i, _ in top5]
    np.testing.assert_allclose(logits_row[ids], np.array([v for _, v in top5]), rtol=1e-3, atol=1e-3,
                               err_msg=message)


def forced_logits(model, prompt_ids, continuation, chunk=64, block_size=16, **runner_args):
    """Teacher-forced logits through the paged runner: row i [vocab] is the next-token logits after
    prompt + continuation[:i], for i in 0 .. len(continuation) - 1 (chunked prefill, then decode steps).

    Two runs fed the same continuation see the same contexts, so their rows compare step by step, and
    the first row whose argmax differs is where free-running greedy decoding would first diverge."""
    n_new = len(continuation)
    runner = ModelRunner(model, num_blocks=-(-(len(prompt_ids) + n_new) // block_size) + 1, block_size=block_size,
                         **runner_args)
    seq = Sequence(list(prompt_ids))
    assert runner.ensure_blocks(seq, len(prompt_ids) + n_new)
    logits = None
    while seq.num_pending:
        logits = runner.step([(seq, min(chunk, seq.num_pending))])
    rows = [logits[-1]]
    for token in continuation[:-1]:
        seq.token_ids.append(int(token))
        rows.append(runner.step([(seq, 1)])[-1])
    return np.array(rows)  # [n_new, vocab]


def compare_to_reference(rows, reference_rows, k=5):
    """(first step whose argmax differs or None, largest |logit error| on the reference's top-k ids, the
    reference's gap between its best and second-best logit at that first differing step or None)."""
    differs = np.argmax(rows, axis=-1) != np.argmax(reference_rows, axis=-1)
    first = int(np.argmax(differs)) if differs.any() else None
    top = np.argsort(-reference_rows, axis=-1)[:, :k]  # [steps, k]
    error = np.abs(np.take_along_axis(rows, top, -1) - np.take_along_axis(reference_rows, top, -1))
    gap = None if first is None else float(reference_rows[first, top[first, 0]] - reference_rows[first, top[first, 1]])
    return first, float(error.max()), gap


def prefill_and_decode(model, ids, greedy, chunk, layer_split=(), block_size=4):
    """Logits of every position of ids + greedy: prompt in chunks, then one token per step."""
    runner = ModelRunner(model, num_blocks=64, block_size=block_size, layer_split=layer_split)
    seq = Sequence(list(ids))
    runner.ensure_blocks(seq, len(ids) + len(greedy))
    rows = []
    while seq.num_pending:
        rows.append(runner.step([(seq, min(chunk, seq.num_pending))], all_logits=True))
    out_ids = []
    for token in greedy:
        out_ids.append(int(np.argmax(rows[-1][-1])))
        seq.token_ids.append(token)  # follow the reference's ids so every row is comparable
        rows.append(runner.step([(seq, 1)], all_logits=True))
    return np.concatenate(rows), out_ids


def assert_close_relative(actual, expected, what):
    """Largest |actual - expected| within 1e-3 of expected's largest magnitude (the logit scale)."""
    scale = np.abs(expected).max()
    err = np.abs(actual - expected).max() / scale
    assert err <= 1e-3, f"{what}: max error {err:.2e} of the logit scale"
