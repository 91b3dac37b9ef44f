"""Property tests of ``dflop.schedule()``: every schedule is valid, and deterministic."""

from __future__ import annotations

import dflop
import numpy as np
from conftest import assert_valid_schedule, schedule_lower_bound
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

PROFILE = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def instances(draw, with_capacity: bool = False, tight: bool = False):
    num_microbatches = draw(st.integers(1, 6))
    dp_size = draw(st.integers(1, 4))
    num_bins = num_microbatches * dp_size
    n = draw(st.integers(num_bins, num_bins + 80))
    d = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["uniform", "lognormal", "pareto", "integers", "spiky"]))
    if kind == "uniform":
        costs = rng.random((n, d))
    elif kind == "lognormal":
        costs = rng.lognormal(0.0, 2.0, (n, d))
    elif kind == "pareto":  # heavy tail: a few samples dominate
        costs = rng.pareto(1.1, (n, d))
    elif kind == "integers":  # many exact ties
        costs = rng.integers(0, 4, (n, d)).astype(float)
    else:  # one giant, the rest tiny
        costs = rng.random((n, d)) * 1e-3
        costs[rng.integers(0, n), rng.integers(0, d)] = 1e3
    zero_fraction = draw(st.sampled_from([0.0, 0.0, 0.3, 0.9, 1.0]))
    costs[rng.random((n, d)) < zero_fraction] = 0.0
    if draw(st.booleans()):
        costs *= draw(st.sampled_from([1e-3, 1e6, 1e12]))
    dims = tuple(k for k in range(d) if draw(st.booleans()))
    if draw(st.booleans()):
        dims = tuple(reversed(dims))  # order of microbatch_dims does not matter
    capacity = None
    if with_capacity:
        capacity = draw(feasible_capacity(costs, num_microbatches, dp_size, dims, rng, tight))
    seed = draw(st.integers(0, 2**31))
    return costs, num_microbatches, dp_size, dims, capacity, seed


@st.composite
def feasible_capacity(draw, costs, num_microbatches, dp_size, dims, rng, tight=False):
    """Capacities some known assignment meets, so the instance is feasible.

    tight=True uses that assignment's loads exactly; otherwise they get some slack (the
    search is a heuristic: exactly tight capacities may be reported infeasible, see
    test_tight_capacity_valid_or_reported_infeasible).
    """
    n, d = costs.shape
    num_bins = num_microbatches * dp_size
    # A known feasible assignment: a random one with every bin non-empty.
    assignment = np.concatenate([np.arange(num_bins), rng.integers(0, num_bins, n - num_bins)])
    rng.shuffle(assignment)
    loads = np.zeros((num_bins, d))
    np.add.at(loads, assignment, costs)
    mb_loads = np.zeros((num_microbatches, d))
    np.add.at(mb_loads, assignment // dp_size, costs)
    known = np.array([mb_loads[:, k].max() if k in dims else loads[:, k].max() for k in range(d)])
    if tight:
        return [float(v) for v in known]
    how = draw(st.sampled_from(["known", "generous", "partial"]))
    if how == "known":
        cap = known * draw(st.sampled_from([1.1, 1.5, 2.0]))
    elif how == "generous":
        cap = np.maximum(known, 3.0 * schedule_lower_bound(costs, num_microbatches, dp_size, dims))
    else:
        cap = known * 1.1
        cap[draw(st.integers(0, d - 1))] = np.inf
    return [float(v) for v in cap]


def check_valid(costs, num_microbatches, dp_size, dims, capacity, s: dflop.Schedule) -> None:
    assert (s.num_microbatches, s.dp_size) == (num_microbatches, dp_size)
    assert set(s.microbatch_dims) == set(dims)
    assert_valid_schedule(costs, s, capacity)


@PROFILE
@given(instances())
def test_every_schedule_is_valid(instance):
    costs, m, p, dims, _, seed = instance
    s = dflop.schedule(costs, m, p, microbatch_dims=dims, seed=seed)
    check_valid(costs, m, p, dims, None, s)


@PROFILE
@given(instances(with_capacity=True))
def test_every_schedule_within_feasible_capacity_is_valid(instance):
    costs, m, p, dims, capacity, seed = instance
    s = dflop.schedule(costs, m, p, microbatch_dims=dims, capacity=capacity, seed=seed)
    check_valid(costs, m, p, dims, capacity, s)


@PROFILE
@given(instances(with_capacity=True, tight=True))
def test_tight_capacity_valid_or_reported_infeasible(instance):
    costs, m, p, dims, capacity, seed = instance
    try:
        s = dflop.schedule(costs, m, p, microbatch_dims=dims, capacity=capacity, seed=seed)
    except dflop.InfeasibleError as e:
        # Allowed for now (heuristic search; see the xfail in test_schedule.py), but it must
        # name the bound.
        assert "capacity[" in str(e)
        return
    check_valid(costs, m, p, dims, capacity, s)


@settings(PROFILE, max_examples=150)
@given(instances(), st.sampled_from([None, 0.0, 0.05, 1.0]))
def test_deterministic(instance, budget):
    costs, m, p, dims, _, seed = instance
    a = dflop.schedule(costs, m, p, microbatch_dims=dims, seed=seed, time_budget_ms=budget)
    b = dflop.schedule(costs.copy(), m, p, microbatch_dims=dims, seed=seed, time_budget_ms=budget)
    np.testing.assert_array_equal(a.assignment, b.assignment)
    np.testing.assert_array_equal(a.loads, b.loads)
    assert a.makespan == b.makespan


@settings(PROFILE, max_examples=80)
@given(instances(), st.integers(0, 2**31))
def test_any_seed_and_budget_is_valid(instance, seed):
    costs, m, p, dims, _, _ = instance
    for budget in (0.0, 0.3):
        s = dflop.schedule(costs, m, p, microbatch_dims=dims, seed=seed, time_budget_ms=budget)
        check_valid(costs, m, p, dims, None, s)


@settings(PROFILE, max_examples=80)
@given(instances())
def test_larger_budget_never_worse(instance):
    costs, m, p, dims, _, seed = instance
    assume(m * p > 1)
    previous = np.inf
    for budget in (0.0, 0.02, 0.2, 1.0):
        s = dflop.schedule(costs, m, p, microbatch_dims=dims, seed=seed, time_budget_ms=budget)
        # 1e-12: schedules with equal loads may round differently (1 ulp seen).
        assert s.makespan <= previous * (1 + 1e-12)
        previous = s.makespan


@settings(PROFILE, max_examples=150)
@given(instances())
def test_n_equals_bins_puts_one_sample_per_bin(instance):
    costs, m, p, dims, _, seed = instance
    costs = costs[: m * p]
    s = dflop.schedule(costs, m, p, microbatch_dims=dims, seed=seed)
    assert np.all(np.bincount(s.assignment, minlength=m * p) == 1)
    check_valid(costs, m, p, dims, None, s)
