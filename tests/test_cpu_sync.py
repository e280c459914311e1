"""Work claiming in one parallel region (engine/backends/cpu/step_sync.py): every unit once, phases in order, and
no deadlock when a region has more workers than threads (chunks then run one after the other)."""
import numba
import numpy as np
import pytest
from numba import njit, prange

from engine.backends.cpu.step_sync import STRIDE, claim, claim_end, unit_done, wait_phase

PHASES, UNITS = 40, 7


@njit(parallel=True, cache=False)
def _phased(n_workers, counters, runs, seen):
    """Phase p's unit u adds 1 to runs[p, u] and records the number of phase p - 1 units done before it."""
    for worker in prange(n_workers):
        for p in range(PHASES):
            u = claim(counters, p, UNITS)
            while u >= 0:
                runs[p, u] += 1
                if p > 0:
                    seen[p, u] = runs[p - 1].sum()
                unit_done(counters, p)
                u = claim(counters, p, UNITS)
            wait_phase(counters, p, UNITS)


@pytest.mark.parametrize("n_workers", [1, 2, 9])
def test_every_unit_runs_once_and_after_the_phase_before(n_workers):
    counters = np.zeros(PHASES * STRIDE, np.int64)
    runs, seen = np.zeros((PHASES, UNITS), np.int64), np.zeros((PHASES, UNITS), np.int64)
    _phased(n_workers, counters, runs, seen)  # 9 workers on at most numba's threads: returns all the same
    assert (runs == 1).all()
    assert (seen[1:] == UNITS).all()  # no unit started before the whole previous phase was done
    assert (counters[STRIDE // 2 :: STRIDE] == UNITS).all()  # the done counters


def test_claims_are_spread_over_the_region_threads():
    """With two threads, both take units (the claim counter is shared, not per thread)."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one numba thread")

    @njit(parallel=True, cache=False)
    def who(counters, owner, work):
        for worker in prange(2):
            u = claim(counters, 0, owner.size)
            while u >= 0:
                owner[u] = numba.get_thread_id()
                for i in range(2000):  # ~10 ms in all: long enough for a sleeping thread to wake up
                    work[u] += np.sin(work[u] + i)
                unit_done(counters, 0)
                u = claim(counters, 0, owner.size)
            wait_phase(counters, 0, owner.size)

    numba.set_num_threads(2)
    owner = np.full(4096, -1, np.int64)
    who(np.zeros(STRIDE, np.int64), owner, np.zeros(owner.size))
    assert (owner >= 0).all()
    assert len(set(owner.tolist())) == 2


@njit(parallel=True, cache=False)
def _from_both_ends(n_workers, counters, runs, n_units):
    for worker in prange(n_workers):
        for p in range(PHASES):
            u = claim_end(counters, p, n_units, worker % 2 == 1)
            while u >= 0:
                runs[p, u] += 1
                unit_done(counters, p)
                u = claim_end(counters, p, n_units, worker % 2 == 1)
            wait_phase(counters, p, n_units)


@pytest.mark.parametrize("n_workers", [1, 2, 7])
def test_claiming_from_both_ends_hands_out_every_unit_once(n_workers):
    for n_units in (1, 2, 5, 64):
        counters, runs = np.zeros(PHASES * STRIDE, np.int64), np.zeros((PHASES, n_units), np.int64)
        _from_both_ends(n_workers, counters, runs, n_units)
        assert (runs == 1).all(), (n_units, runs)
