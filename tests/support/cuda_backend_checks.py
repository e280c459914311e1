"""What the CUDA backend tests share (tests/test_cuda_*.py, tests/test_expert_budget*.py): tolerances, the
checked copy back to the host, the fake drivers' launch log, a K/V store-and-attend case and greedy runs of a
tiny model. The backends under test come from the `cuda` and `emulator_dir` fixtures of tests/conftest.py."""
from __future__ import annotations

import os

import numpy as np

from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from tests.support.reference_helpers import greedy_with_logits

BLOCK = 16
EXACT, REDUCE, GEMM = (1e-5, 1e-6), (1e-4, 1e-5), (3e-2, 3e-2)  # (rtol, atol): elementwise, reductions, fp16 mma
SEG = 4  # blocks per elastic pool segment in these tests (64 in the server): tiny pools still span several
PAGE = os.sysconf("SC_PAGE_SIZE")


def launch_log(backend) -> list[str] | None:
    """Kernels launched so far, as the fake drivers record them (None on a GPU, which keeps no log)."""
    driver = backend.test_driver
    return None if driver is None else driver.launches


def host_copy(backend, x):
    """x copied to the host; a NaN left by the poisoning means a kernel skipped an element."""
    out = backend.to_host(x)
    assert not np.isnan(out).any(), "an output element was never written"
    return out


def assert_close(actual, expected, tol):
    """Within tol = (rtol, atol): EXACT, REDUCE or GEMM."""
    np.testing.assert_allclose(actual, expected, rtol=tol[0], atol=tol[1])


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def kv_case(cuda, layout, seqs, window, rng):
    """Store every sequence's context, then attend its last `new` tokens; returns (cuda out, numpy out)."""
    ref = NumpyBackend()
    pools = (cuda.create_kv_pool(layout), ref.create_kv_pool(layout))
    items = [(list(range(n)), 0, table) for n, _, table in seqs]
    batch = build_batch(items, layout.block_size, all_logits=True)
    k = randn(rng, batch.num_tokens, layout.n_kv_heads, layout.head_dim)
    v = randn(rng, batch.num_tokens, layout.n_kv_heads, layout.head_dim)
    for backend, pool, kk, vv in ((cuda, pools[0], cuda.upload_activation(k), cuda.upload_activation(v)),
                                  (ref, pools[1], k, v)):
        backend.store_kv(pool, 1, kk, vv, batch)
    query = build_batch([(list(range(new)), n - new, table) for n, new, table in seqs], layout.block_size)
    q = randn(rng, query.num_tokens, 4, layout.head_dim)
    got = host_copy(cuda, cuda.attention(cuda.upload_activation(q), pools[0], 1, query, 0.25, window))
    return got, ref.attention(q, pools[1], 1, query, 0.25, window), pools


def greedy_tokens(model, prompt, steps=16, **runner_args):
    """Greedy tokens after a one-step prefill of `prompt` (the gemm when it has more than 8 rows)."""
    return greedy_with_logits(model, list(prompt), steps, chunk=len(prompt), block_size=BLOCK, **runner_args)[0]


def greedy_and_logits(model, prompt, steps=8):
    """Greedy tokens after a one-step prefill of `prompt` (a gemm step: more than 8 rows), then matvec decode
    steps; also the prefill's last logits."""
    tokens, rows = greedy_with_logits(model, list(prompt), steps, chunk=len(prompt), block_size=8)
    return tokens, rows[0]
