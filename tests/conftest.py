"""Shared test helpers and the test tiers.

The tests mirror the package: ``tests/unit/<package>/`` tests ``dflop.<package>``
(``unit/package/`` the modules directly in ``dflop``: the simulator, safe file reading,
the import layers); ``tests/integration/`` starts real processes (the CLI,
torch.distributed ranks on gloo, Hugging Face model equivalence runs, the C++ build) and
its tests are marked ``integration`` by their folder:

    python3 -m pytest -m "not integration"   # fast tier (tests/unit)
    python3 -m pytest -m integration         # multi-process integration tier
    python3 -m pytest                        # everything (what .ci/run runs)
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
DATA_DIR = TESTS_DIR / "data"
"""The test data (``tests/data``: a LLaVA-format mini dataset, released models' configs)."""

INTEGRATION_DIR = TESTS_DIR / "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    integration = False
    for item in items:
        if INTEGRATION_DIR in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.integration)
            integration = True
    if integration:
        _start_fork_server()


# ------------------------------------------------------------------ the suite's time

SUITE_BUDGET_ENV = "DFLOP_SUITE_BUDGET_S"
"""Seconds the whole run may take (set by .ci/run): a longer run fails, naming the budget,
so that the suite's growth is noticed when it happens (docs/development.md)."""

_FILE_SECONDS: dict[str, float] = defaultdict(float)
_FILE_TESTS: dict[str, int] = defaultdict(int)
_SESSION_START_S = time.monotonic()


def pytest_sessionstart(session: pytest.Session) -> None:
    global _SESSION_START_S
    _SESSION_START_S = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] += report.duration  # setup, call and teardown
    if report.when == "call":
        _FILE_TESTS[path] += 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Seconds per test file (the whole run's, when it ran many files), slowest first; and
    the budget check of :data:`SUITE_BUDGET_ENV`."""
    elapsed_s = time.monotonic() - _SESSION_START_S
    if len(_FILE_SECONDS) >= 10:
        write = terminalreporter.write_line
        terminalreporter.section("seconds per test file")
        for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:30]:
            write(f"{seconds:8.1f} s {_FILE_TESTS[path]:5d} tests  {path}")
        write(f"{sum(_FILE_SECONDS.values()):8.1f} s in tests; {elapsed_s:.1f} s in all")
    budget = os.environ.get(SUITE_BUDGET_ENV)
    if budget and elapsed_s > float(budget):
        terminalreporter.write_line(
            f"FAILED: the suite took {elapsed_s:.0f} s, over its budget of {float(budget):.0f} s "
            f"({SUITE_BUDGET_ENV}); make the tests that grew cheaper (docs/development.md)",
            red=True,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    budget = os.environ.get(SUITE_BUDGET_ENV)
    if budget and time.monotonic() - _SESSION_START_S > float(budget) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ------------------------------------------------------------ the ranks' fork server

RANK_MODULES = (
    "pytest",
    "numpy.testing",
    "dflop.train.run",
    "dflop.train.trainer",
    "dflop.models.hf",
    "transformers",
    *(
        f"transformers.models.{family}.modeling_{family}"
        for family in ("llava_onevision", "qwen2_vl", "qwen2_5_vl", "internvl")
    ),
)
"""What the ranks of the integration tests import: the fork server that forks them
imports it once for the whole run (a Hugging Face family's model code took every rank of
every test a second or two)."""


def _start_fork_server() -> None:
    try:
        from dflop.runtime.launch import start_fork_server
    except ImportError:  # no torch: the tests that need it skip
        return
    start_fork_server(RANK_MODULES)


@pytest.fixture(scope="session")
def quick_perf(tmp_path_factory):
    """``quick_perf(model)``: the path of a quick performance model of ``model`` (a preset
    name or ``hf:DIR``), measured once per run, so that CLI runs whose subject is not
    profiling skip it (``--perf``); the profiling path itself is tested by the runs that
    give no ``--perf`` (the docs' commands, the real-size runs)."""
    from dflop.train.planning import quick_profile

    made: dict[str, str] = {}

    def perf(model: str) -> str:
        if model not in made:
            path = tmp_path_factory.mktemp("perf") / "perf.json"
            quick_profile(model, repeats=1, max_units=4, max_tokens=256).save(path)
            made[model] = str(path)
        return made[model]

    return perf


@pytest.fixture(scope="session")
def perf_json(quick_perf) -> str:
    """A quick performance model of the tiny preset (so CLI runs skip profiling)."""
    return quick_perf("tiny")


RTOL = 1e-9
"""Relative tolerance for float sums computed in a different order."""


# ---------------------------------------------------------------------- schedules


def schedule_loads(costs: np.ndarray, s) -> tuple[np.ndarray, np.ndarray]:
    """(per-bin loads, per-microbatch loads) recomputed from ``s.assignment``."""
    costs = np.asarray(costs, dtype=np.float64).reshape(len(s.assignment), -1)
    d = costs.shape[1]
    loads = np.zeros((s.num_bins, d))
    np.add.at(loads, s.assignment, costs)
    mb_loads = np.zeros((s.num_microbatches, d))
    np.add.at(mb_loads, s.assignment // s.dp_size, costs)
    return loads, mb_loads


def schedule_lower_bound(costs, num_microbatches: int, dp_size: int, dims=()) -> float:
    """max over dimensions of (total / bins sharing it, largest sample)."""
    costs = np.asarray(costs, dtype=np.float64)
    costs = costs.reshape(costs.shape[0], -1)
    bound = 0.0
    for k in range(costs.shape[1]):
        count = num_microbatches if k in dims else num_microbatches * dp_size
        bound = max(bound, costs[:, k].sum() / count, costs[:, k].max())
    return bound


def assert_valid_schedule(costs, s, capacity=None) -> None:
    """Every sample in exactly one real bin, every bin non-empty, each DP rank's
    microbatches a partition, loads / makespan / lower bound equal to their recomputation,
    capacities held."""
    costs = np.asarray(costs, dtype=np.float64)
    costs = costs.reshape(costs.shape[0], -1)
    n, d = costs.shape
    a = s.assignment
    assert a.shape == (n,) and a.dtype == np.int64
    assert a.min() >= 0 and a.max() < s.num_bins
    assert np.bincount(a, minlength=s.num_bins).min() >= 1, "an empty bin"
    gathered = np.sort(np.concatenate([s.bin(b) for b in range(s.num_bins)]))
    np.testing.assert_array_equal(gathered, np.arange(n))
    per_rank = [np.concatenate(s.microbatches(r)) for r in range(s.dp_size)]
    np.testing.assert_array_equal(np.sort(np.concatenate(per_rank)), np.arange(n))
    loads, mb_loads = schedule_loads(costs, s)
    assert s.loads.shape == (s.num_bins, d)
    assert s.microbatch_loads.shape == (s.num_microbatches, d)
    atol = RTOL * max(1e-300, float(costs.sum()))  # relative to the instance's scale
    np.testing.assert_allclose(s.loads, loads, rtol=RTOL, atol=atol)
    np.testing.assert_allclose(s.microbatch_loads, mb_loads, rtol=RTOL, atol=atol)
    used = [mb_loads[:, k] if k in s.microbatch_dims else loads[:, k] for k in range(d)]
    assert s.makespan == pytest.approx(max(float(u.max()) for u in used), rel=RTOL, abs=atol)
    expected_lb = schedule_lower_bound(costs, s.num_microbatches, s.dp_size, s.microbatch_dims)
    assert s.lower_bound == pytest.approx(expected_lb, rel=RTOL, abs=atol)
    assert s.makespan >= s.lower_bound * (1 - RTOL) - atol
    if capacity is not None:
        for k, cap in enumerate(capacity):
            assert used[k].max() <= cap * (1 + RTOL) + atol, f"capacity[{k}] exceeded"
