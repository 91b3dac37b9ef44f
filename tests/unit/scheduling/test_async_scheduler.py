"""The asynchronous scheduling front end: ordered, bounded, never stalls."""

from __future__ import annotations

import threading
import time

import dflop
import numpy as np
import pytest
from dflop.scheduling.async_scheduler import AsyncScheduler


def costs_for(step: int, n: int = 256) -> np.ndarray:
    return np.random.default_rng(step).lognormal(size=(n, 2))


def test_same_schedules_as_synchronous_calls_without_deadline():
    with AsyncScheduler(8, 4, seed=5) as scheduler:
        for step in range(3):
            scheduler.submit(step, costs_for(step))
            got = scheduler.get(step)
            want = dflop.schedule(costs_for(step), 8, 4, seed=5 + step)
            np.testing.assert_array_equal(got.assignment, want.assignment)


def test_lookahead_bounds_pending_steps():
    with AsyncScheduler(4, 1, lookahead=2) as scheduler:
        scheduler.submit(0, costs_for(0, 64))
        scheduler.submit(1, costs_for(1, 64))
        blocked = threading.Event()

        def third() -> None:
            scheduler.submit(2, costs_for(2, 64))
            blocked.set()

        thread = threading.Thread(target=third)
        thread.start()
        assert not blocked.wait(0.3)  # full: the producer waits
        scheduler.get(0)
        assert blocked.wait(10)
        thread.join(10)
        assert scheduler.get(1).num_bins == 4
        assert scheduler.get(2).num_bins == 4


def test_deadline_is_respected_and_schedule_valid():
    big = np.random.default_rng(0).lognormal(size=(65536, 2))
    with AsyncScheduler(1024, 1, time_budget_ms=1e7) as scheduler:
        scheduler.submit(0, big, deadline_s=0.3)
        start = time.monotonic()
        s = scheduler.get(0)
        assert time.monotonic() - start < 5.0
        assert np.bincount(s.assignment, minlength=1024).min() >= 1


def test_queued_step_past_its_deadline_falls_back_without_waiting():
    big = np.random.default_rng(0).lognormal(size=(65536, 2))
    with AsyncScheduler(1024, 1, time_budget_ms=1e7, lookahead=3) as scheduler:
        scheduler.submit(0, big, deadline_s=2.0)  # keeps the worker busy
        scheduler.submit(1, costs_for(1, 2048), deadline_s=0.0)
        s = scheduler.get(1)  # its turn has not come: constructive start, at once
        assert s.num_samples == 2048
        assert scheduler.num_fallbacks == 1
        scheduler.get(0)


def test_errors_reach_the_consumer():
    with AsyncScheduler(4, 1) as scheduler:
        scheduler.submit(0, np.full((8, 2), np.nan))
        with pytest.raises(ValueError, match="NaN"):
            scheduler.get(0)
        with pytest.raises(KeyError):
            scheduler.get(7)
        scheduler.submit(1, costs_for(1, 16))
        with pytest.raises(ValueError, match="already submitted"):
            scheduler.submit(1, costs_for(1, 16))
        scheduler.get(1)
