"""The native searches read a snapshot of their inputs, not the caller's buffer.

``dflop.schedule`` and ``dflop.pipeline_schedule`` release the GIL while the C++ core
runs (so do ``split_units`` and the planner's and simulator's calls: every binding that
does hands the core a copy). Each test starts a call with a wall-clock limit in a worker thread,
then, while the search runs, another thread writes NaN, 1e308 and negative values into the
very array it was given, over and over. The result must be the one for the input the call
was given (valid, every sample assigned once, no makespan below that input's lower bound)
and the call must end near its limit.
"""

from __future__ import annotations

import threading
import time

import dflop
import numpy as np
import pytest
from conftest import assert_valid_schedule, schedule_lower_bound

LIMIT_S = 0.8
"""Each call's ``time_limit_s``: the search runs about this long (a huge budget)."""

START_S = 0.2
"""The writer starts this long after the call (it has taken its snapshot by then)."""


def _poison(array: np.ndarray, done: threading.Event) -> int:
    """Writes bad values into ``array`` until ``done``; returns how many writes."""
    writes = 0
    values = (np.nan, 1e308, -1.0, np.inf, 0.0)
    while not done.is_set():
        array[:] = values[writes % len(values)]
        writes += 1
        time.sleep(0.0005)
    return writes


def _run_while_poisoned(call, array: np.ndarray) -> tuple[object, float, int]:
    """``call()`` in a worker thread while this thread poisons ``array`` mid-call:
    (result, seconds the call took, writes)."""
    out: dict[str, object] = {}
    done = threading.Event()

    def worker() -> None:
        began = time.perf_counter()
        try:
            out["result"] = call()
        except BaseException as error:  # reported below, not lost in the thread
            out["error"] = error
        out["seconds"] = time.perf_counter() - began
        done.set()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    done.wait(START_S)
    writes = _poison(array, done) if not done.is_set() else 0
    thread.join(timeout=30 * LIMIT_S)
    assert not thread.is_alive(), "the call did not return within 30x its time limit"
    if "error" in out:
        raise AssertionError(f"the call raised {out['error']!r}") from out["error"]
    return out["result"], float(out["seconds"]), writes


def _costs(n: int, seed: int = 0) -> np.ndarray:
    """(n, 2) costs of few distinct values: the lower bound is out of reach, so the
    search runs until its time limit instead of stopping at a proven optimum."""
    steps = np.random.default_rng(seed).integers(1, 4, size=(n, 2)).astype(np.float64)
    return np.ascontiguousarray(steps * np.array([1.0, 1.37]))


def test_schedule_is_for_the_input_it_was_given() -> None:
    costs = _costs(2049)
    original = costs.copy()
    m = 16
    result, seconds, writes = _run_while_poisoned(
        lambda: dflop.schedule(costs, m, time_budget_ms=1e7, time_limit_s=LIMIT_S), costs
    )
    # Valid for the original costs: loads, makespan and lower bound recomputed from them.
    assert_valid_schedule(original, result)
    assert result.makespan >= schedule_lower_bound(original, m, 1) * (1 - 1e-12)
    assert seconds < LIMIT_S + 5.0
    assert writes > 10, "the call ended before the writes: nothing was tested"


def test_pipeline_schedule_is_for_the_input_it_was_given() -> None:
    costs = _costs(1025)
    original = costs.copy()
    m = 8
    pipeline = dflop.PipelineModel((1, 2), (1 / 3, 1 / 3), (0.0, 0.0))
    result, seconds, writes = _run_while_poisoned(
        lambda: dflop.pipeline_schedule(
            costs, m, pipeline=pipeline, time_budget_ms=1e7, time_limit_s=LIMIT_S
        ),
        costs,
    )
    assert_valid_schedule(original, result)
    assert result.makespan >= schedule_lower_bound(original, m, 1) * (1 - 1e-12)
    # Its simulated step time is the one of the original costs.
    step = pipeline.step_time_s(original, result)
    assert result.stats["step_time_s"] == pytest.approx(step, rel=1e-9)
    assert seconds < LIMIT_S + 5.0
    assert writes > 10, "the call ended before the writes: nothing was tested"


def test_native_balance_copies_the_callers_buffer() -> None:
    """The binding itself (``dflop._core.balance``, which the Python layer calls with its
    own copy) searches a copy taken with the GIL held, not the numpy buffer it was given."""
    from dflop import _core

    costs = _costs(2049, seed=2)
    original = costs.copy()
    m = 16

    def call():
        return _core.balance(
            costs,
            num_microbatches=m,
            dp_size=1,
            microbatch_dims=[],
            capacity=None,
            seed=0,
            time_budget_ms=1e7,
            time_limit_s=LIMIT_S,
        )

    raw, seconds, writes = _run_while_poisoned(call, costs)
    loads = np.zeros((m, 2))
    np.add.at(loads, raw["assignment"], original)
    np.testing.assert_allclose(raw["bin_loads"], loads, rtol=1e-9)
    assert raw["makespan"] == pytest.approx(loads.max(), rel=1e-12)
    assert raw["makespan"] >= schedule_lower_bound(original, m, 1) * (1 - 1e-12)
    assert seconds < LIMIT_S + 5.0
    assert writes > 10, "the call ended before the writes: nothing was tested"
