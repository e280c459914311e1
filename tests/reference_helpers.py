"""Shared by the reference tests: greedy decoding through the paged runner, and top-5 comparison."""
import numpy as np

from engine.sequence import ModelRunner, Sequence


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
