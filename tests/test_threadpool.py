"""ThreadPool::run_shares (csrc/threadpool.cpp), which splits every matmul's rows among the
threads: each unit runs exactly once whatever the thread count, and a slow thread's share is
taken over by the others instead of being waited for."""
from __future__ import annotations

import pytest

from zen5._native import testing as T


def covered(ranges) -> list[int]:
    units = []
    for u0, u1, _ in ranges:
        assert u0 < u1
        units.extend(range(u0, u1))
    return sorted(units)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("n_units", [1, 2, 7, 100, 1000])
@pytest.mark.parametrize("min_chunk", [1, 3])
def test_every_unit_runs_exactly_once(threads, n_units, min_chunk):
    assert covered(T.pool_shares(threads, n_units, min_chunk)) == list(range(n_units))


def test_a_share_is_taken_front_to_back_in_shrinking_chunks():
    assert [(u0, u1) for u0, u1, _ in T.pool_shares(1, 100, 2)] == [(0, 100)]  # one thread: one call
    ranges = sorted((u0, u1) for u0, u1, _ in T.pool_shares(2, 200, 2))
    # the first share's front: at most a quarter of its 100 units (less if the other thread
    # had already taken the back half), then chunks that follow on
    assert ranges[0][0] == 0 and 2 <= ranges[0][1] <= 25
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_a_slow_thread_hands_its_share_over():
    # The calling thread takes 2 ms per unit, the worker nothing: with fixed halves each would
    # run 20 of the 40 units; here the worker takes what the caller has not started.
    ranges = T.pool_shares(2, 40, 1, caller_us=2000)
    assert covered(ranges) == list(range(40))
    on_caller = sum(u1 - u0 for u0, u1, c in ranges if c)
    assert on_caller < 20
