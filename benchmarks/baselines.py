"""Baselines that ``dflop.schedule()`` is compared against in ``bench_schedule.py``.

Every baseline takes ``costs`` ((N, D) float array) and ``num_bins`` and returns an
assignment: an (N,) int64 array of bin ids in ``[0, num_bins)`` with every bin non-empty
(or ``None`` when CP-SAT found no solution in its time limit). The makespan is computed
from the assignment by one shared function in the benchmark, the same for every method.

- :func:`data_blind_split`: what a data-blind framework does: samples in dataset order,
  cut into consecutive chunks of (almost) equal count.
- :func:`greedy_lpt`: greedy longest-processing-time-first in numpy: samples sorted by
  their largest per-dimension cost, descending; each goes into the bin whose resulting
  largest per-dimension load is smallest.
- :func:`cpsat_reference`: the published reference's CP-SAT model (booleans ``x[i, j]``,
  each sample in exactly one bin, each bin non-empty, per-bin per-dimension loads
  ``<= C``, minimise ``C``) solved with OR-Tools under a time limit. OR-Tools is an
  optional dependency: :func:`cpsat_available` says whether it can be imported.
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np

__all__ = [
    "CPSAT_RESOLUTION",
    "write_section",
    "cpsat_available",
    "cpsat_reference",
    "data_blind_split",
    "greedy_lpt",
    "lower_bound",
]

CPSAT_RESOLUTION = 1_000_000
"""Integer units per lower bound: CP-SAT costs are ``round(cost * 1e6 / lower_bound)``."""


def lower_bound(costs: np.ndarray, num_bins: int) -> float:
    """max over dimensions of (total / num_bins, largest single cost)."""
    costs = np.asarray(costs, dtype=np.float64)
    return float(max(costs.sum(axis=0).max() / num_bins, costs.max()))


def data_blind_split(costs: np.ndarray, num_bins: int) -> np.ndarray:
    """Consecutive equal-count chunks in dataset order (sizes differ by at most one)."""
    n = len(costs)
    # Chunk b holds samples [b * n // B, (b + 1) * n // B): floor(i * B / n) is its id.
    return (np.arange(n, dtype=np.int64) * num_bins) // n


def greedy_lpt(costs: np.ndarray, num_bins: int) -> np.ndarray:
    """Greedy LPT on the largest per-dimension load, vectorised over bins per item."""
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    order = np.argsort(-costs.max(axis=1), kind="stable")
    loads = np.zeros((num_bins, costs.shape[1]))
    assignment = np.empty(n, dtype=np.int64)
    # The num_bins largest samples open one bin each (what LPT does up to ties), so that
    # every bin is non-empty even when some samples cost nothing.
    first = order[:num_bins]
    assignment[first] = np.arange(num_bins)
    loads[:] = costs[first]
    for i in order[num_bins:]:
        row = costs[i]
        best = int(np.argmin((loads + row).max(axis=1)))
        loads[best] += row
        assignment[i] = best
    return assignment


def cpsat_available() -> bool:
    """Whether OR-Tools (``pip install ortools``) can be imported."""
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def cpsat_reference(
    costs: np.ndarray,
    num_bins: int,
    *,
    time_limit_s: float,
    num_workers: int = 2,
    seed: int = 0,
) -> tuple[np.ndarray | None, dict]:
    """Solve the reference CP-SAT model; returns ``(assignment or None, info)``.

    Costs are scaled to integers with ``CPSAT_RESOLUTION`` units per lower bound, so the
    largest possible load (the total, at most ``num_bins`` lower bounds) stays far below
    2**62. ``info`` holds ``build_s`` (model construction), ``solve_s`` (solver wall
    time), ``status`` and ``objective`` (in scaled units).
    """
    from ortools.sat.python import cp_model

    costs = np.asarray(costs, dtype=np.float64)
    n, dims = costs.shape
    start = time.perf_counter()
    scale = CPSAT_RESOLUTION / lower_bound(costs, num_bins)
    weights = np.rint(costs * scale).astype(np.int64)
    model = cp_model.CpModel()
    x = [[model.new_bool_var(f"x{i}_{j}") for j in range(num_bins)] for i in range(n)]
    for i in range(n):
        model.add_exactly_one(x[i])
    horizon = int(weights.sum(axis=0).max())
    makespan = model.new_int_var(0, horizon, "C")
    for j in range(num_bins):
        column = [x[i][j] for i in range(n)]
        model.add_bool_or(column)
        for d in range(dims):
            w = weights[:, d].tolist()
            model.add(cp_model.LinearExpr.weighted_sum(column, w) <= makespan)
    model.minimize(makespan)
    build_s = time.perf_counter() - start

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(num_workers)
    solver.parameters.random_seed = int(seed)
    start = time.perf_counter()
    status = solver.solve(model)
    solve_s = time.perf_counter() - start
    info = {
        "build_s": build_s,
        "solve_s": solve_s,
        "status": solver.status_name(status),
        "objective": None,
    }
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, info
    info["objective"] = solver.objective_value
    assignment = np.empty(n, dtype=np.int64)
    for i in range(n):
        for j in range(num_bins):
            if solver.boolean_value(x[i][j]):
                assignment[i] = j
                break
    return assignment, info


def machine_info() -> str:
    """CPU model, core count and OS of this machine, for result tables."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical cores, {platform.system()} {platform.release()}"


def write_section(path: str, name: str, body: str, heading: str) -> None:
    """Replace the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in the
    markdown file ``path`` by ``body``; append ``heading`` and a new section if absent."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = "# Benchmarks\n"
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    section = f"{start}\n{body.rstrip(chr(10))}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n" + section + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
