"""dflop.schedule's limits (resources that bound a microbatch without being balanced),
first-fit-decreasing seeding, and the chosen microbatch count."""

from __future__ import annotations

import math

import dflop
import numpy as np
import pytest


def first_fit_decreasing(used: np.ndarray, limits: list[float]) -> int:
    """Reference FFD, written from its textbook description: bins first-fit decreasing
    (by the largest share of a limit) opens."""
    used = np.atleast_2d(used.T).T
    share = (used / np.asarray(limits)).max(axis=1)
    bins: list[np.ndarray] = []
    for i in sorted(range(len(used)), key=lambda i: -share[i]):
        for load in bins:
            if np.all(load + used[i] <= np.asarray(limits) * (1 + 1e-9)):
                load += used[i]
                break
        else:
            bins.append(used[i].astype(float).copy())
    return len(bins)


def _tokens(seed: int, n: int = 256, cap: float = 4000.0) -> np.ndarray:
    return np.minimum(np.random.default_rng(seed).lognormal(6.0, 1.2, n), cap)


def test_limits_bound_the_bins_but_only_the_costs_are_balanced():
    tokens = _tokens(0)
    costs = tokens + tokens**2 / 4000  # attention makes long samples dearer per token
    free = dflop.schedule(costs, 16)
    limited = dflop.schedule(costs, 16, resources=tokens, limits=[2.5 * tokens.sum() / 16])
    assert limited.loads.shape == (16, 1) and limited.resource_loads.shape == (16, 1)
    assert limited.lower_bound == free.lower_bound  # the tokens are not in the bound
    assert limited.makespan <= free.makespan * 1.001  # a loose limit costs nothing
    np.testing.assert_allclose(
        limited.resource_loads[:, 0], np.bincount(limited.assignment, tokens, minlength=16)
    )
    # Passed as a capacity column instead, the tokens are balanced too: worse for the costs.
    both = np.c_[costs, tokens]
    as_capacity = dflop.schedule(both, 16, capacity=[np.inf, 2.5 * tokens.sum() / 16])
    assert limited.makespan <= as_capacity.loads[:, 0].max()


@pytest.mark.parametrize("seed", range(12))
def test_every_count_first_fit_decreasing_fills_is_met(seed):
    """A count FFD fills is never reported infeasible, in one and two resource columns,
    with dp ranks; every bin within its limits."""
    rng = np.random.default_rng(seed)
    tokens = _tokens(seed, n=int(rng.integers(64, 512)))
    units = rng.integers(0, 10, tokens.size).astype(float)
    costs = tokens + tokens**2 / 4000 + 300 * units
    for used, limits in ((tokens, [4096.0]), (np.c_[tokens, units], [8192.0, 24.0])):
        bins = first_fit_decreasing(used, limits)
        for dp in (1, 2):
            count = math.ceil(bins / dp)
            s = dflop.schedule(costs, count, dp, resources=used, limits=limits, seed=seed)
            assert np.all(s.resource_loads <= np.asarray(limits) * (1 + 1e-9))
            assert np.bincount(s.assignment, minlength=count * dp).min() >= 1


def test_the_fewest_microbatches_that_meet_the_limits():
    tokens = _tokens(3, n=512)
    costs = tokens + tokens**2 / 4000
    for limit in (4096.0, 8192.0, 16384.0):
        s = dflop.schedule(costs, None, resources=tokens, limits=[limit])
        bins = first_fit_decreasing(tokens, [limit])
        assert math.ceil(tokens.sum() / limit) <= s.num_microbatches <= bins
        assert s.stats["first_fit_bins"] == bins
        assert s.resource_loads.max() <= limit * (1 + 1e-9)
        if s.num_microbatches > math.ceil(tokens.sum() / limit):
            with pytest.raises(dflop.InfeasibleError):  # one fewer was tried and failed
                dflop.schedule(costs, s.num_microbatches - 1, resources=tokens, limits=[limit])
    two_ranks = dflop.schedule(costs, None, 2, resources=tokens, limits=[8192.0])
    assert two_ranks.num_bins == 2 * two_ranks.num_microbatches  # the same count per rank
    assert two_ranks.num_microbatches <= math.ceil(first_fit_decreasing(tokens, [8192.0]) / 2)


def test_limit_errors_name_the_callers_numbers():
    tokens = np.array([100.0, 5000.0, 200.0, 300.0])
    with pytest.raises(
        dflop.InfeasibleError, match=r"sample 1 has resources\[1, 0\]=5000 above limits\[0\]=4096"
    ):
        dflop.schedule(tokens, 2, resources=tokens, limits=[4096])
    with pytest.raises(
        dflop.InfeasibleError, match=r"limits\[0\]=300 is too small: resources column 0 totals 700"
    ):
        dflop.schedule(tokens[[0, 2, 3, 0]], 2, resources=[100, 200, 300, 100], limits=[300])
    with pytest.raises(ValueError, match="resources and limits go together"):
        dflop.schedule(tokens, 2, limits=[4096])
    with pytest.raises(ValueError, match=r"resources\[2, 0\]=-1.0 must be finite and >= 0"):
        dflop.schedule(tokens, 2, resources=[1, 2, -1, 3], limits=[10])
    with pytest.raises(ValueError, match="limits has 2 values but resources has 1 columns"):
        dflop.schedule(tokens, 2, resources=tokens, limits=[1, 2])
    with pytest.raises(ValueError, match="num_microbatches=None chooses the fewest"):
        dflop.schedule(tokens, None)
    with pytest.raises(dflop.InfeasibleError, match="sample 1 has resources"):
        dflop.schedule(tokens, None, resources=tokens, limits=[4096])


def test_no_packing_found_is_said_in_the_callers_terms():
    """A count below what the search can pack (but not provably infeasible) ends with the
    budget and says so, naming the limit."""
    # Three bins of 4.5: the total (12 <= 13.5) and every sample (<= 4.5) pass the cheap
    # checks, but each 3 needs a bin of its own and the three 2s cannot share the third.
    tokens = np.array([3.0, 3.0, 2.0, 2.0, 2.0])
    with pytest.raises(dflop.InfeasibleError, match=r"no schedule within limits\[0\]=4.5 found"):
        dflop.schedule(tokens, 3, resources=tokens, limits=[4.5], time_budget_ms=1)


@pytest.mark.parametrize("budget_ms", [None, 10.0, 100.0])
def test_the_chosen_count_keeps_to_one_budget(budget_ms, monkeypatch):
    """num_microbatches=None tries counts from first-fit decreasing's down; they share the
    call's work budget (time_budget_ms's, else a default by size), so the work of all the
    core's searches it ran stays within it (each search checks its budget between moves;
    one whose start ends over a limit also pays first-fit decreasing's one pass, not at
    these budgets); the same inputs give the same schedule. Before, each count had the
    whole budget (20 ms took 86 ms at 1,024 samples, 7 counts)."""
    from dflop import _core

    searches = []  # each core search's work, failed ones included

    def counted(*args, **kwargs):
        try:
            raw = balance(*args, **kwargs)
        except dflop.InfeasibleError:
            searches.append(kwargs["work_budget"])  # at most what it was given
            raise
        searches.append(raw["stats"]["work_used"])
        return raw

    balance = _core.balance
    monkeypatch.setattr(_core, "balance", counted)
    # The embedded mix (bench_packing's 1,024 samples under a 16k cap): first-fit
    # decreasing is a few microbatches over the totals' bound, so several counts are tried.
    from dflop.data import AnalyticCostModel, synthetic_shapes

    shapes = synthetic_shapes(1024, seed=1024)
    tokens = shapes.seq_len.astype(np.float64)
    costs = AnalyticCostModel("siglip-400m", "llm-7b").costs(shapes)[:, 1]
    runs = [
        dflop.schedule(costs, None, resources=tokens, limits=[16384.0], time_budget_ms=budget_ms)
        for _ in range(2)
    ]
    s = runs[0]
    if budget_ms is not None:
        assert s.stats["work_budget"] == _core.work_budget_for_ms(budget_ms)
    assert 0 < sum(searches) / 2 <= s.stats["work_budget"] * 1.01
    assert s.stats["counts_tried"] == len(searches) / 2 >= 2
    assert s.num_microbatches < s.stats["first_fit_bins"]
    assert s.resource_loads.max() <= 16384.0 * (1 + 1e-9)
    np.testing.assert_array_equal(runs[1].assignment, s.assignment)
