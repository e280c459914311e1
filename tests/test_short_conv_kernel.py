"""short_conv_f32 (cuda_kernels/short_conv.cu) against the numpy op (engine/short_conv.numpy_short_conv), run
on the CPU under the kernel emulator and, where there is one, on a GPU: a batch of a prefill chunk, decode
rows and a fresh sequence (start_pos 0: zeros whatever its slot holds), odd widths, every L up to 8."""
import numpy as np
import pytest

from engine.batch import build_batch
from engine.short_conv import ConvStatePool, numpy_short_conv


@pytest.mark.parametrize("L", [2, 3, 4, 8])
def test_short_conv_matches_numpy(kernel_runner, L):
    rng = np.random.default_rng(L)
    d = 37
    lengths, starts, slots = (9, 1, 5, 1), (6, 30, 0, 2), (2, 0, 3, 1)
    batch = build_batch([(list(range(n)), p, np.arange(16)) for n, p in zip(lengths, starts)], 4, state_slots=slots)
    u = rng.standard_normal((batch.num_tokens, d)).astype(np.float32)
    w = rng.standard_normal((d, L)).astype(np.float32)
    pool = ConvStatePool((0,), L, d, num_slots=4)
    pool.conv[0][:] = rng.standard_normal(pool.conv[0].shape).astype(np.float32)
    states = pool.conv[0].copy()
    expected = numpy_short_conv(u, w, pool, 0, batch)
    out = np.zeros_like(u)
    seq_start = np.array([s.query_start for s in batch.seqs], np.int32)
    kernel_runner("short_conv").launch(
        "short_conv_f32", out=out, states=states, u=u, w=w, seq_start=seq_start,
        seq_len=np.array(lengths, np.int32), start_pos=np.array(starts, np.int32),
        state_slot=np.array(slots, np.int32), n_seqs=len(lengths), d=d, L=L)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(states, pool.conv[0])  # the new states are inputs, copied
