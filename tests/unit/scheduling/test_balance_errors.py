"""Bad input to ``dflop.schedule()``: a clear ValueError / TypeError, never a crash."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import dflop
import numpy as np
import pytest


def good_costs(n: int = 12, d: int = 2) -> np.ndarray:
    return np.random.default_rng(0).random((n, d)) + 0.1


def raises(exc, *fragments: str, **kwargs):
    """Calls dflop.schedule(**kwargs) and checks the error type and message fragments."""
    with pytest.raises(exc) as info:
        dflop.schedule(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# ---- costs: values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,word", [(np.nan, "nan"), (np.inf, "inf"), (-np.inf, "inf"), (-1.5, "negative")]
)
def test_bad_cost_value_names_first_offending_index(value, word):
    costs = good_costs(8, 2)
    costs[3, 1] = value
    costs[5, 0] = value  # a later offender must not be the one reported
    message = raises(ValueError, "costs[3, 1]", costs=costs, num_microbatches=2)
    assert word in message.lower()
    assert "costs[5, 0]" not in message


def test_bad_cost_in_one_dimensional_costs():
    costs = np.ones(10)
    costs[7] = np.nan
    message = raises(ValueError, costs=costs, num_microbatches=2)
    assert re.search(r"costs\[7(, 0)?\]", message), message


def test_negative_zero_is_fine_but_tiny_negative_is_not():
    costs = np.ones(6)
    costs[2] = -0.0
    dflop.schedule(costs, 2)
    costs[2] = -1e-300
    raises(ValueError, "costs[2", costs=costs, num_microbatches=2)


def test_negative_integer_cost():
    costs = np.ones((6, 2), dtype=np.int64)
    costs[4, 0] = -3
    raises(ValueError, "costs[4, 0]", "-3", costs=costs, num_microbatches=2)


# ---- costs: shape and type ----------------------------------------------------------------


@pytest.mark.parametrize(
    "costs",
    [np.float64(3.0), 3.0, np.ones((4, 2, 2)), np.ones((4, 0)), np.ones((2, 3, 4, 5))],
    ids=["0-D numpy", "python scalar", "3-D", "D=0", "4-D"],
)
def test_wrong_ndim(costs):
    raises(ValueError, "costs", costs=costs, num_microbatches=1)


@pytest.mark.parametrize("n,m,p", [(3, 2, 2), (0, 1, 1), (7, 4, 2), (1, 2, 1)])
def test_fewer_samples_than_bins(n, m, p):
    message = raises(ValueError, costs=np.ones((n, 2)), num_microbatches=m, dp_size=p)
    assert str(n) in message and str(m * p) in message


@pytest.mark.parametrize(
    "costs",
    [
        [["a", "b"], ["c", "d"]],
        [1.0, 2.0, "x", 4.0],
        [1.0, None, 3.0],
        None,
        [object(), object()],
        np.array([1 + 2j, 3 + 0j]),
        np.array([True, False, True]),
        np.array(["1.0", "2.0"]),
        {"a": 1},
    ],
    ids=[
        "strings",
        "mixed str",
        "None inside",
        "None",
        "objects",
        "complex",
        "bool",
        "numeric strings",
        "dict",
    ],
)
def test_non_numeric_costs(costs):
    raises((TypeError, ValueError), "costs", costs=costs, num_microbatches=1)


def test_ragged_costs_name_the_argument():
    raises((TypeError, ValueError), "costs", costs=[[1.0, 2.0], [3.0]], num_microbatches=1)


# ---- counts -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["num_microbatches", "dp_size"])
@pytest.mark.parametrize("value", [0, -1, -(2**40)])
def test_counts_below_one(name, value):
    kwargs = {"num_microbatches": 2, "dp_size": 1, name: value}
    raises(ValueError, name, str(value), costs=good_costs(), **kwargs)


@pytest.mark.parametrize("name", ["num_microbatches", "dp_size"])
@pytest.mark.parametrize("value", [2.0, 2.5, True, "2", None, [2], np.float64(2.0)])
def test_counts_not_integers(name, value):
    kwargs = {"num_microbatches": 2, "dp_size": 1, name: value}
    if name == "num_microbatches" and value is None:  # the chosen count: needs limits
        raises(ValueError, "num_microbatches=None", costs=good_costs(), **kwargs)
        return
    raises(TypeError, name, costs=good_costs(), **kwargs)


def test_counts_too_large():
    raises(ValueError, "num_microbatches", costs=good_costs(), num_microbatches=2**40)
    raises(ValueError, costs=good_costs(), num_microbatches=2**20, dp_size=2**20)


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("num_microbatches", {"num_microbatches": 2**70}),
        ("dp_size", {"num_microbatches": 2, "dp_size": 2**64}),
        ("seed", {"num_microbatches": 2, "seed": 2**64}),
    ],
    ids=["num_microbatches", "dp_size", "seed"],
)
def test_huge_counts_name_the_argument(name, kwargs):
    message = raises((TypeError, ValueError), name, costs=good_costs(), **kwargs)
    assert "incompatible function arguments" not in message, message[:200]


@pytest.mark.parametrize(
    "seed,exc", [(-1, ValueError), (1.5, TypeError), ("0", TypeError), (True, TypeError)]
)
def test_bad_seed(seed, exc):
    raises(exc, "seed", costs=good_costs(), num_microbatches=2, seed=seed)


# ---- capacity -----------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [[1.0], [1.0, 2.0, 3.0], [[1.0, 2.0]]])
def test_capacity_wrong_length_or_shape(capacity):
    raises(
        (ValueError, TypeError),
        "capacity",
        costs=good_costs(),
        num_microbatches=2,
        capacity=capacity,
    )


def test_capacity_wrong_length_message():
    raises(ValueError, "capacity", "1", "2", costs=good_costs(), num_microbatches=2, capacity=[5.0])


def test_empty_capacity_is_wrong_length():
    raises(ValueError, "capacity", costs=good_costs(), num_microbatches=2, capacity=[])


@pytest.mark.parametrize(
    "capacity,fragment",
    [([-1.0, 5.0], "capacity[0]"), ([5.0, np.nan], "capacity[1]"), ([5.0, -np.inf], "capacity[1]")],
)
def test_capacity_bad_values(capacity, fragment):
    raises(ValueError, fragment, costs=good_costs(), num_microbatches=2, capacity=capacity)


@pytest.mark.parametrize(
    "capacity", [["a", 1.0], [None, 1.0], 5.0, "12", [1 + 1j, 2.0], [object(), 1.0]]
)
def test_capacity_non_numeric(capacity):
    raises(TypeError, "capacity", costs=good_costs(), num_microbatches=2, capacity=capacity)


# ---- microbatch_dims ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "dims,fragment",
    [([2], "microbatch_dims[0]"), ([-1], "microbatch_dims[0]"), ([0, 5], "microbatch_dims[1]")],
)
def test_microbatch_dims_out_of_range(dims, fragment):
    raises(ValueError, fragment, costs=good_costs(), num_microbatches=2, microbatch_dims=dims)


def test_microbatch_dims_repeated():
    raises(
        ValueError,
        "microbatch_dims[1]",
        costs=good_costs(),
        num_microbatches=2,
        microbatch_dims=[0, 0],
    )


@pytest.mark.parametrize("dims", [[0.0], [True], ["0"], [None], "0"])
def test_microbatch_dims_not_integers(dims):
    raises(
        TypeError,
        "microbatch_dims" if isinstance(dims, str) else "microbatch_dims[0]",
        costs=good_costs(),
        num_microbatches=2,
        microbatch_dims=dims,
    )


def test_microbatch_dims_not_a_sequence():
    raises(TypeError, "microbatch_dims", costs=good_costs(), num_microbatches=2, microbatch_dims=0)


# ---- time_budget_ms -----------------------------------------------------------------------


@pytest.mark.parametrize("budget", [-1.0, -1e-9, np.nan, -np.inf])
def test_time_budget_bad_values(budget):
    raises(
        ValueError, "time_budget_ms", costs=good_costs(), num_microbatches=2, time_budget_ms=budget
    )


@pytest.mark.parametrize("budget", ["10", True, [1.0], 1 + 1j])
def test_time_budget_not_a_number(budget):
    raises(
        TypeError, "time_budget_ms", costs=good_costs(), num_microbatches=2, time_budget_ms=budget
    )


def test_time_budget_infinite_is_rejected_or_accepted_cleanly():
    try:
        s = dflop.schedule(good_costs(), 2, time_budget_ms=np.inf)
    except ValueError as e:
        assert "time_budget_ms" in str(e)
    else:
        assert s.makespan >= s.lower_bound


def test_huge_time_budget():
    try:
        s = dflop.schedule(good_costs(), 2, time_budget_ms=1e300)
    except ValueError as e:
        assert "time_budget_ms" in str(e), str(e)
    else:
        assert s.makespan >= s.lower_bound


# ---- infeasible capacities ----------------------------------------------------------------


def test_infeasible_error_is_a_value_error():
    assert issubclass(dflop.InfeasibleError, ValueError)


def test_single_item_over_capacity_names_sample_and_dimension():
    costs = np.ones((6, 2))
    costs[4, 1] = 9.0
    message = raises(
        dflop.InfeasibleError, "capacity[1]", costs=costs, num_microbatches=3, capacity=[10.0, 5.0]
    )
    assert "sample 4" in message or "costs[4, 1]" in message


def test_total_over_count_times_capacity():
    # 12 units over 4 bins need 3 per bin; capacity 2.5 cannot hold that.
    message = raises(
        dflop.InfeasibleError,
        "capacity[0]",
        costs=np.ones((12, 2)),
        num_microbatches=2,
        dp_size=2,
        capacity=[2.5, 100.0],
    )
    assert "dimension 0" in message or "capacity[0]" in message


def test_total_over_microbatch_capacity():
    # As a microbatch dim, 12 units over 2 microbatches need 6 each.
    raises(
        dflop.InfeasibleError,
        "capacity[0]",
        "microbatch",
        costs=np.ones((12, 2)),
        num_microbatches=2,
        dp_size=2,
        microbatch_dims=[0],
        capacity=[5.0, 100.0],
    )
    # ... while 6 per microbatch is enough (3 per bin).
    s = dflop.schedule(np.ones((12, 2)), 2, 2, microbatch_dims=[0], capacity=[6.0, 100.0])
    assert s.microbatch_loads[:, 0].max() <= 6.0


def test_infeasible_found_by_search():
    # Each item fits and the total fits (6 <= 2 x 3.5), but any two items exceed 3.5 and
    # one of the two bins must take two of the three items.
    raises(
        dflop.InfeasibleError,
        "capacity[0]",
        costs=[2.0, 2.0, 2.0],
        num_microbatches=2,
        capacity=[3.5],
    )


def test_zero_capacity_with_zero_costs_is_feasible():
    s = dflop.schedule(np.zeros((5, 2)), 2, capacity=[0.0, 0.0])
    assert s.makespan == 0.0
    raises(
        dflop.InfeasibleError,
        "capacity[1]",
        costs=[[0.0, 0.0]] * 4 + [[0.0, 1e-6]],
        num_microbatches=2,
        capacity=[0.0, 0.0],
    )


# ---- nothing crashes the interpreter ------------------------------------------------------

NASTY = textwrap.dedent(
    """
    import numpy as np
    import dflop

    ok = np.ones((8, 2))
    cases = [
        dict(costs=np.full((8, 2), np.nan), num_microbatches=2),
        dict(costs=np.empty((0, 0)), num_microbatches=1),
        dict(costs=np.empty((0,)), num_microbatches=1),
        dict(costs=np.ones((3, 0)), num_microbatches=1),
        dict(costs=np.ones((1, 1, 1)), num_microbatches=1),
        dict(costs=ok, num_microbatches=0),
        dict(costs=ok, num_microbatches=-5, dp_size=-5),
        dict(costs=ok, num_microbatches=2**62),
        dict(costs=ok, num_microbatches=2**31, dp_size=2**31),
        dict(costs=ok, num_microbatches=2**70),
        dict(costs=ok, num_microbatches=2, seed=2**64),
        dict(costs=ok, num_microbatches=2, seed=-1),
        dict(costs=ok, num_microbatches=2, capacity=[1.0] * 1000),
        dict(costs=ok, num_microbatches=2, capacity=[]),
        dict(costs=ok, num_microbatches=2, capacity=[np.nan, -np.inf]),
        dict(costs=ok, num_microbatches=2, capacity=[0.0, 0.0]),
        dict(costs=ok, num_microbatches=2, microbatch_dims=[2**62]),
        dict(costs=ok, num_microbatches=2, microbatch_dims=[-(2**62)]),
        dict(costs=ok, num_microbatches=2, microbatch_dims=[2**70]),
        dict(costs=ok, num_microbatches=2, microbatch_dims=list(range(100))),
        dict(costs=ok, num_microbatches=2, time_budget_ms=-np.inf),
        dict(costs=ok, num_microbatches=2, time_budget_ms=1e-300),
        dict(costs=ok, num_microbatches=2, time_budget_ms=0),
        dict(costs=[[object()]], num_microbatches=1),
        dict(costs=np.array([b"ab", b"cd"]), num_microbatches=1),
        dict(costs=np.ones((8, 2), dtype=np.float16), num_microbatches=2),
        dict(costs=np.ones((8, 2), dtype=np.longdouble), num_microbatches=2),
        dict(costs=np.ones(8)[::-1], num_microbatches=2),
        dict(costs=np.full(9, 5e-324), num_microbatches=3),
        dict(costs=np.full(9, 1e300), num_microbatches=3, dp_size=3),
        dict(costs=np.ones((16, 2)), num_microbatches=16),
        dict(costs=np.ones((17, 2)), num_microbatches=4, dp_size=4, microbatch_dims=[0, 1],
             capacity=[5.0, 2.0]),
        dict(costs=np.arange(40.0).reshape(20, 2), num_microbatches=5, dp_size=2,
             capacity=[np.inf, 1e-300]),
    ]
    for kwargs in cases:
        try:
            dflop.schedule(**kwargs)
        except (ValueError, TypeError, OverflowError):
            pass
    s = dflop.schedule(ok, 2)
    for bad in (-1, 2, 2**70):
        for call in (s.bin, s.microbatch, s.microbatches):
            try:
                call(bad)
            except (ValueError, TypeError, OverflowError):
                pass
    print("SURVIVED")
    """
)


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_nasty_batch_does_not_crash_the_interpreter():
    result = run_python(NASTY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SURVIVED" in result.stdout


def test_overflowing_sums_do_not_crash():
    code = textwrap.dedent(
        """
        import dflop
        try:
            s = dflop.schedule([1e308, 1e308, 1e308], 2)
            assert s.makespan >= s.lower_bound, (s.makespan, s.lower_bound)
        except ValueError as e:
            assert "costs" in str(e), e
        print("SURVIVED")
        """
    )
    result = run_python(code)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert "SURVIVED" in result.stdout


def test_overflowing_total_keeps_a_valid_bound():
    try:
        s = dflop.schedule([1.7e308, 1.7e308, 1.0], 2)
    except ValueError as e:
        assert "costs" in str(e)
    else:
        assert s.makespan >= s.lower_bound


# ----------------------------------------------------------------------- API edges


def test_api_edges_fail_at_once_with_a_clear_error():
    """Values that would hang, overflow or exhaust memory are refused up front."""
    import time

    import dflop
    import numpy as np
    from dflop.scheduling.actions import pipeline_actions
    from dflop.scheduling.balance import data_blind_schedule
    from dflop.simulator import simulate_pipeline

    costs = np.random.default_rng(0).random((16, 2))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"time_budget_ms=1e\+300 must be in"):
        dflop.pipeline_schedule(costs, 4, 1, time_budget_ms=1e300)
    with pytest.raises(ValueError, match="balance_time_budget_ms"):
        dflop.pipeline_schedule(costs, 4, 1, balance_time_budget_ms=float("inf"))
    with pytest.raises(TypeError, match="time_budget_ms must be a number, got str"):
        dflop.pipeline_schedule(costs, 4, 1, time_budget_ms="5")
    with pytest.raises(ValueError, match="time_budget_ms"):
        dflop.schedule(costs, 4, 1, time_budget_ms=-1.0)
    with pytest.raises(ValueError, match="overflow"):
        simulate_pipeline(np.full((2, 4), 1e308), np.full((2, 4), 1e308))
    with pytest.raises(ValueError, match="num_microbatches=2147483647 is more than"):
        pipeline_actions("1f1b", 2, 2**31 - 1, 0)
    with pytest.raises(ValueError, match=r"costs\[1, 0\]=nan is not finite"):
        data_blind_schedule(np.array([[1.0], [np.nan], [1.0], [1.0]]), 2)
    assert time.perf_counter() - start < 5.0


def test_ctrl_c_stops_a_long_native_search():
    """The native searches run with the GIL released; they poll Python's signal handlers,
    so Ctrl-C raises KeyboardInterrupt within a fraction of a second instead of after the
    whole budget (here up to an hour)."""
    import signal
    import time

    code = textwrap.dedent(
        """
        import sys, time
        import numpy as np
        import dflop
        costs = np.random.default_rng(0).lognormal(0, 1, size=(400, 2))
        print("ready", flush=True)
        try:
            dflop.pipeline_schedule(costs, 16, 1, time_budget_ms=3.6e6)
        except KeyboardInterrupt:
            sys.exit(130)
        sys.exit(3)  # finished: the signal was not seen
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # SIGINT as a terminal user has it, even when the suite runs in a background job
        # (which starts children with SIGINT ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # inside the search
        sent = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        assert proc.returncode == 130
        assert time.perf_counter() - sent < 5.0
    finally:
        proc.kill()
