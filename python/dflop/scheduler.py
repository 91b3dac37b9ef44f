"""Per-step batch balancing: ``dflop.schedule()``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from dflop import _core

__all__ = ["Schedule", "schedule", "InfeasibleError"]

InfeasibleError = _core.InfeasibleError


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@dataclass(frozen=True)
class Schedule:
    """The assignment of a global batch's samples to microbatches and DP ranks.

    There are ``num_bins = num_microbatches * dp_size`` bins; bin ``b`` is microbatch
    ``b // dp_size`` on data-parallel rank ``b % dp_size``. Arrays are read-only.
    """

    assignment: np.ndarray
    """(N,) int64: the bin of each sample."""
    loads: np.ndarray
    """(num_bins, D) float64: each bin's summed cost per dimension."""
    microbatch_loads: np.ndarray
    """(num_microbatches, D) float64: each microbatch's summed cost (all its DP bins)."""
    makespan: float
    """Largest load: over bins for ordinary dims, over microbatches for ``microbatch_dims``."""
    lower_bound: float
    """max over dims of (total / count, largest single cost): no schedule can beat it."""
    num_microbatches: int
    dp_size: int
    microbatch_dims: tuple[int, ...]
    seed: int
    solve_time_s: float
    """Wall time spent inside the native solver."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Search statistics: initial_makespan, work_used, work_budget, improving_moves, ..."""

    @property
    def num_bins(self) -> int:
        return self.num_microbatches * self.dp_size

    @property
    def num_samples(self) -> int:
        return int(self.assignment.shape[0])

    @property
    def ratio(self) -> float:
        """makespan / lower_bound (1.0 is provably optimal)."""
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0

    def bin(self, bin_id: int) -> np.ndarray:
        """Sample indices in bin ``bin_id``, ascending."""
        if not 0 <= bin_id < self.num_bins:
            raise ValueError(f"bin_id={bin_id} is out of range [0, {self.num_bins})")
        return self._bins()[bin_id]

    def microbatches(self, dp_rank: int) -> list[np.ndarray]:
        """Sample indices of each of ``dp_rank``'s microbatches, in microbatch order."""
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={dp_rank} is out of range [0, {self.dp_size})")
        bins = self._bins()
        return [bins[mb * self.dp_size + dp_rank] for mb in range(self.num_microbatches)]

    def microbatch(self, microbatch_id: int) -> np.ndarray:
        """Sample indices of a whole microbatch (all DP ranks), ascending."""
        if not 0 <= microbatch_id < self.num_microbatches:
            raise ValueError(
                f"microbatch_id={microbatch_id} is out of range [0, {self.num_microbatches})"
            )
        return np.flatnonzero(self.assignment // self.dp_size == microbatch_id)

    def _bins(self) -> list[np.ndarray]:
        cached = self.__dict__.get("_bins_cache")
        if cached is None:
            order = np.argsort(self.assignment, kind="stable")
            bounds = np.searchsorted(self.assignment[order], np.arange(self.num_bins + 1))
            cached = [_frozen(order[bounds[b] : bounds[b + 1]]) for b in range(self.num_bins)]
            object.__setattr__(self, "_bins_cache", cached)
        return cached


def _as_costs(costs: Any) -> np.ndarray:
    array = np.asarray(costs)
    if array.dtype == object or array.dtype.kind not in "iuf":
        raise TypeError(
            f"costs must be a numeric (integer or float) array, got dtype {array.dtype}"
        )
    if array.ndim == 1:
        array = array.reshape(-1, 1)
    if array.ndim != 2:
        raise ValueError(f"costs must be 1-D (N,) or 2-D (N, D), got shape {array.shape}")
    return np.ascontiguousarray(array, dtype=np.float64)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def schedule(
    costs: Any,
    num_microbatches: int,
    dp_size: int = 1,
    *,
    microbatch_dims: Sequence[int] = (),
    capacity: Optional[Sequence[float]] = None,
    seed: int = 0,
    time_budget_ms: Optional[float] = None,
) -> Schedule:
    """Balance one global batch across ``num_microbatches x dp_size`` bins.

    Args:
        costs: (N, D) non-negative per-sample costs in one unit (e.g. seconds of stage
            time); a 1-D array means D = 1. In dflop's own use column 0 is the encoder's
            cost and column 1 the LLM's.
        num_microbatches: microbatches per DP rank in the step.
        dp_size: data-parallel ranks; bin ``b`` is microbatch ``b // dp_size`` on rank
            ``b % dp_size``.
        microbatch_dims: dimensions whose load is summed over the whole microbatch (all
            its DP bins), e.g. an encoder whose replicas share each microbatch (pass its
            costs already divided by the encoder's DP size).
        capacity: optional length-D upper bounds on each bin's (microbatch's, for
            microbatch_dims) load; ``inf`` means unbounded.
        seed: seed of the randomised search; equal inputs and seed give equal schedules.
        time_budget_ms: search effort. It is converted to a deterministic amount of work
            (calibrated on one x86 core), so a given budget gives the same schedule on
            every machine and a larger budget is never worse. Default: chosen by size.

    Returns:
        A :class:`Schedule`.

    Raises:
        TypeError: non-numeric costs or non-integer counts.
        ValueError: malformed arguments (naming the argument and first offending index).
        InfeasibleError: (a ValueError) the capacities cannot be met.
    """
    cost_array = _as_costs(costs)
    num_microbatches = _as_int("num_microbatches", num_microbatches)
    dp_size = _as_int("dp_size", dp_size)
    seed = _as_int("seed", seed)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    dims = tuple(_as_int(f"microbatch_dims[{k}]", v) for k, v in enumerate(microbatch_dims))
    cap_list = None
    if capacity is not None:
        cap_array = np.asarray(capacity)
        if cap_array.dtype == object or cap_array.dtype.kind not in "iuf" or cap_array.ndim != 1:
            raise TypeError(
                f"capacity must be a 1-D sequence of numbers, got {capacity!r}"
            )
        cap_list = [float(v) for v in cap_array]
    budget = None
    if time_budget_ms is not None:
        if isinstance(time_budget_ms, bool) or not isinstance(
            time_budget_ms, (int, float, np.integer, np.floating)
        ):
            raise TypeError(f"time_budget_ms must be a number, got {time_budget_ms!r}")
        budget = float(time_budget_ms)
    start_s = _perf_counter()
    raw = _core.balance(cost_array, num_microbatches, dp_size, list(dims), cap_list, seed, budget)
    solve_time_s = _perf_counter() - start_s
    return Schedule(
        assignment=_frozen(raw["assignment"]),
        loads=_frozen(raw["bin_loads"]),
        microbatch_loads=_frozen(raw["microbatch_loads"]),
        makespan=float(raw["makespan"]),
        lower_bound=float(raw["lower_bound"]),
        num_microbatches=num_microbatches,
        dp_size=dp_size,
        microbatch_dims=dims,
        seed=seed,
        solve_time_s=solve_time_s,
        stats=dict(raw["stats"]),
    )


def _perf_counter() -> float:
    import time

    return time.perf_counter()
