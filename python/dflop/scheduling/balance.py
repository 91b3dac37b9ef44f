"""Per-step batch balancing: ``dflop.schedule()``."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from dflop import _core
from dflop.errors import InputTypeError

__all__ = [
    "InfeasibleError",
    "Schedule",
    "data_blind_schedule",
    "schedule",
    "schedule_from_assignment",
]

InfeasibleError = _core.InfeasibleError


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
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
    stats: Mapping[str, Any] = field(default_factory=dict)
    """Search statistics: initial_makespan, work_used, work_budget, improving_moves, ..."""
    resource_loads: np.ndarray | None = None
    """(num_bins, K) float64: each bin's summed ``resources`` (None without limits)."""

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
    try:
        array = np.asarray(costs)
    except (ValueError, TypeError) as error:  # ragged nested lists and the like
        raise ValueError(f"costs must be a rectangular (N, D) array: {error}") from None
    if array.dtype == object or array.dtype.kind not in "iuf":
        raise InputTypeError(
            f"costs must be a numeric (integer or float) array, got dtype {array.dtype}"
        )
    if array.ndim == 1:
        array = array.reshape(-1, 1)
    if array.ndim != 2:
        raise ValueError(f"costs must be 1-D (N,) or 2-D (N, D), got shape {array.shape}")
    # A copy of our own, always: the core validates it, then searches it with the GIL
    # released, and the loads are recomputed from it after: another thread writing into
    # the caller's array meanwhile changes none of them.
    return np.array(array, dtype=np.float64, order="C", copy=True)


MAX_TIME_BUDGET_MS = 3_600_000.0
"""The largest search effort accepted (one hour's worth): a larger one would not return
in a useful time."""


def _real(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise InputTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def as_time_budget_ms(name: str, value: Any, limited: bool = False) -> float | None:
    """A search effort in ms: None, or a number in ``[0, MAX_TIME_BUDGET_MS]``; a larger
    one only with a wall-clock limit (``limited``) that bounds it."""
    if value is None:
        return None
    budget = _real(name, value)
    if math.isnan(budget) or budget < 0:
        raise ValueError(f"{name}={value!r} must be >= 0")
    if budget > MAX_TIME_BUDGET_MS and not limited:
        raise ValueError(
            f"{name}={value!r} must be in [0, {MAX_TIME_BUDGET_MS:g}] ms, or bounded by a "
            "time_limit_s"
        )
    return budget


def as_time_limit_s(name: str, value: Any) -> float | None:
    """A wall-clock limit in s: None, or a number >= 0 (inf: none)."""
    if value is None:
        return None
    limit = _real(name, value)
    if math.isnan(limit) or limit < 0:
        raise ValueError(f"{name}={value!r} must be >= 0")
    return limit


def _as_int(name: str, value: Any, upper: int = 2**31 - 1) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if int(value) > upper:
        raise ValueError(f"{name}={value} is too large (at most {upper})")
    return int(value)


def _as_dims(microbatch_dims: Any) -> tuple[int, ...]:
    if isinstance(microbatch_dims, (str, bytes)) or not hasattr(microbatch_dims, "__iter__"):
        raise InputTypeError(
            f"microbatch_dims must be a sequence of column indices, got {microbatch_dims!r}"
        )
    return tuple(_as_int(f"microbatch_dims[{k}]", v) for k, v in enumerate(microbatch_dims))


def schedule(
    costs: Any,
    num_microbatches: int | None,
    dp_size: int = 1,
    *,
    microbatch_dims: Sequence[int] = (),
    capacity: Sequence[float] | None = None,
    resources: Any = None,
    limits: Sequence[float] | None = None,
    seed: int = 0,
    time_budget_ms: float | None = None,
    time_limit_s: float | None = None,
) -> Schedule:
    """Balance one global batch across ``num_microbatches x dp_size`` bins.

    Args:
        costs: (N, D) non-negative per-sample costs in one unit (e.g. seconds of stage
            time); a 1-D array means D = 1. In dflop's own use column 0 is the encoder's
            cost and column 1 the LLM's.
        num_microbatches: microbatches per DP rank in the step; None (with ``limits``):
            the fewest that meet the limits, never more than first-fit decreasing needs
            (``stats["first_fit_bins"]``), balanced.
        dp_size: data-parallel ranks; bin ``b`` is microbatch ``b // dp_size`` on rank
            ``b % dp_size``.
        microbatch_dims: dimensions whose load is summed over the whole microbatch (all
            its DP bins), e.g. an encoder whose replicas share each microbatch (pass its
            costs already divided by the encoder's DP size).
        capacity: optional length-D upper bounds on each bin's (microbatch's, for
            microbatch_dims) load of the costs; ``inf`` means unbounded.
        resources, limits: what each sample occupies, ``(N, K)`` (tokens, visual units,
            bytes: 1-D means K = 1), and ``K`` upper bounds on a bin's sum of each
            column (a memory budget). Limits constrain the schedule but are not balanced:
            the makespan and lower bound are the costs' (``Schedule.resource_loads``
            holds the bins' sums). With any bound the search is also seeded with a
            first-fit-decreasing packing, so a bin count that first-fit decreasing fills
            is never reported infeasible.
        seed: seed of the randomised search; equal inputs and seed give equal schedules.
        time_budget_ms: search effort. It is converted to a deterministic amount of work
            (calibrated on one x86 core), so a given budget gives the same schedule on
            every machine and a larger budget is never worse. Default: chosen by size.
            With ``num_microbatches=None`` it is the whole call's: the counts it tries
            share it.
        time_limit_s: optional hard wall-clock limit: past it the search returns the best
            schedule found so far. The result then depends on machine speed and load (it
            is reported in ``stats["stopped_by_time_limit"]``): use it where an answer is
            needed by a deadline, and share that schedule between ranks rather than
            recomputing it on each.

    Returns:
        A :class:`Schedule`.

    Raises:
        TypeError: non-numeric costs or non-integer counts.
        ValueError: malformed arguments (naming the argument and first offending index).
        InfeasibleError: (a ValueError) the capacities or limits cannot be met: a sample
            alone over one, a total over the bins' bounds (proved), or no schedule found
            within the budget (said so, with the numbers).
    """
    cost_array = _as_costs(costs)
    num_costs = cost_array.shape[1]
    chosen = num_microbatches is None
    if not chosen:
        num_microbatches = _as_int("num_microbatches", num_microbatches)
    dp_size = _as_int("dp_size", dp_size)
    seed = _as_int("seed", seed, upper=2**64 - 1)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    dims = _as_dims(microbatch_dims)
    cap_list = None
    if capacity is not None:
        cap_array = np.asarray(capacity)
        if cap_array.dtype == object or cap_array.dtype.kind not in "iuf" or cap_array.ndim != 1:
            raise InputTypeError(f"capacity must be a 1-D sequence of numbers, got {capacity!r}")
        if cap_array.shape[0] != cost_array.shape[1]:
            raise ValueError(
                f"capacity has length {cap_array.shape[0]} but costs has "
                f"D={cost_array.shape[1]} columns"
            )
        cap_list = [float(v) for v in cap_array]
    num_limits = 0
    if resources is not None or limits is not None:
        used, bounds = resource_limits(resources, limits, cost_array.shape[0])
        num_limits = used.shape[1]
        cost_array = np.concatenate([cost_array, used], axis=1)
        cap_list = (cap_list or [math.inf] * num_costs) + bounds
    limit = as_time_limit_s("time_limit_s", time_limit_s)
    limited = limit is not None and math.isfinite(limit)
    budget = as_time_budget_ms("time_budget_ms", time_budget_ms, limited)

    def solve(count: int, work: int | None = None, limit_s: float | None = limit) -> Schedule:
        start_s = _perf_counter()
        raw = _core.balance(
            cost_array,
            num_microbatches=count,
            dp_size=dp_size,
            microbatch_dims=list(dims),
            capacity=cap_list,
            seed=seed,
            time_budget_ms=budget,
            time_limit_s=limit_s,
            num_limit_dims=num_limits,
            work_budget=work,
        )
        return Schedule(
            assignment=_frozen(raw["assignment"]),
            loads=_frozen(raw["bin_loads"][:, :num_costs]),
            microbatch_loads=_frozen(raw["microbatch_loads"][:, :num_costs]),
            resource_loads=_frozen(raw["bin_loads"][:, num_costs:]) if num_limits else None,
            makespan=float(raw["makespan"]),
            lower_bound=float(raw["lower_bound"]),
            num_microbatches=count,
            dp_size=dp_size,
            microbatch_dims=dims,
            seed=seed,
            solve_time_s=_perf_counter() - start_s,
            stats=MappingProxyType(dict(raw["stats"])),
        )

    if not chosen:
        return solve(num_microbatches)
    if not num_limits:
        raise ValueError(
            "num_microbatches=None chooses the fewest microbatches that meet limits: give "
            "resources and limits"
        )
    return _fewest_microbatches(solve, used, bounds, dp_size, budget, limit, cost_array.shape[1])


FEWEST_FIRST_WORK_FACTOR = 2
"""``num_microbatches=None`` without ``time_budget_ms``: first-fit decreasing's count, the
one most calls return, gets this many times a plain call's default budget (a tight limit
leaves the search less room, and this count's balance is what the caller gets); each lower
count, which first has to be met, its default."""

FEWEST_WORK_FACTOR = FEWEST_FIRST_WORK_FACTOR + 8
"""... and the whole call at most this many times the first count's default (up to 8
lower counts)."""


def _fewest_microbatches(
    solve: Any,
    used: np.ndarray,
    bounds: list[float],
    dp_size: int,
    budget_ms: float | None,
    limit_s: float | None,
    num_dims: int,
) -> Schedule:
    """The fewest microbatches per rank whose ``num_microbatches x dp_size`` bins meet the
    limits, balanced: first-fit decreasing's count (which the search, seeded with FFD,
    always meets), then one fewer at a time while a search still meets it, down to the
    totals' bound. The counts share one work budget and the wall-clock limit, so that the
    call, not each count, keeps to them: ``budget_ms``'s, each count taking half of what
    is left (all of it at the totals' bound, the last count to try); else first-fit
    decreasing's count :data:`FEWEST_FIRST_WORK_FACTOR` times its default budget and each
    lower count its default, up to :data:`FEWEST_WORK_FACTOR` times the first one's
    default in all."""
    num_samples = used.shape[0]
    start_s = _perf_counter()
    ffd_bins = int(_core.first_fit_decreasing_bins(used, bounds))  # names a sample too big
    totals = used.sum(axis=0)
    needed = [math.ceil(t / b * (1 - 1e-9)) for t, b in zip(totals, bounds) if 0 < b < math.inf]
    lowest = max(1, -(-max(needed, default=1) // dp_size))
    highest = max(lowest, -(-ffd_bins // dp_size))
    if highest * dp_size > num_samples:
        raise InfeasibleError(
            f"the limits need {highest} microbatches per rank x {dp_size} ranks (first-fit "
            f"decreasing packs the samples into {ffd_bins} bins), more than the "
            f"{num_samples} samples: every microbatch needs a sample"
        )

    def default(count: int) -> int:
        return int(_core.default_work_budget(num_samples, count * dp_size, num_dims))

    if budget_ms is not None:
        work_left = int(_core.work_budget_for_ms(budget_ms))
    else:
        work_left = FEWEST_WORK_FACTOR * default(highest)
    call_work, work_used = work_left, 0

    def attempt(count: int) -> Schedule:
        # A search runs to the end of its budget: the next count down must still get some.
        nonlocal work_left, work_used
        if budget_ms is None:
            factor = FEWEST_FIRST_WORK_FACTOR if count == highest else 1
            work = min(factor * default(count), work_left)
        else:
            work = work_left if count == lowest else work_left // 2
        left_s = None if limit_s is None else max(limit_s - (_perf_counter() - start_s), 0.0)
        found = solve(count, work, left_s)
        work_used += int(found.stats["work_used"])
        work_left -= int(found.stats["work_used"])
        return found

    best, tried = attempt(highest), 1  # seeded with FFD's packing: it meets this count
    for count in range(highest - 1, lowest - 1, -1):
        if work_left <= 0 or (limit_s is not None and _perf_counter() - start_s >= limit_s):
            break
        tried += 1
        try:
            best = attempt(count)
        except InfeasibleError:  # a count lower still would not be met either
            break
    stats = {
        **best.stats,
        "first_fit_bins": ffd_bins,
        "counts_tried": tried,
        # The counts that met the limits; a failed last one ran within what was left.
        "work_used": work_used,
        "work_budget": call_work,
    }
    return dataclasses.replace(
        best, solve_time_s=_perf_counter() - start_s, stats=MappingProxyType(stats)
    )


def resource_limits(
    resources: Any, limits: Any, num_samples: int
) -> tuple[np.ndarray, list[float]]:
    """``resources`` as an ``(N, K)`` float array and ``limits`` as ``K`` floats, checked
    (finite, non-negative; a limit may be ``inf``), naming the argument and the index."""
    if resources is None or limits is None:
        raise ValueError("resources and limits go together: give both or neither")
    try:
        used = np.asarray(resources, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputTypeError(
            f"resources must be an (N, K) array of numbers, got {type(resources).__name__}"
        ) from None
    if used.ndim == 1:
        used = used[:, None]
    if used.ndim != 2 or used.shape[0] != num_samples:
        raise ValueError(f"resources must have shape ({num_samples}, K), got {used.shape}")
    bad = np.argwhere(~np.isfinite(used) | (used < 0))
    if bad.size:
        i, k = (int(v) for v in bad[0])
        raise ValueError(f"resources[{i}, {k}]={used[i, k]} must be finite and >= 0")
    bounds = np.atleast_1d(np.asarray(limits, dtype=np.float64))
    if bounds.ndim != 1 or bounds.shape[0] != used.shape[1]:
        raise ValueError(
            f"limits has {bounds.size} values but resources has {used.shape[1]} columns"
        )
    for k, v in enumerate(bounds):
        if np.isnan(v) or v < 0:
            raise ValueError(f"limits[{k}]={v} must be a number >= 0 (inf: no bound)")
    return np.ascontiguousarray(used), [float(v) for v in bounds]


def schedule_from_assignment(
    costs: Any,
    assignment: Any,
    num_microbatches: int,
    dp_size: int = 1,
    *,
    microbatch_dims: Sequence[int] = (),
) -> Schedule:
    """A :class:`Schedule` for a given assignment (e.g. a baseline's), with its loads,
    makespan and lower bound computed exactly as for :func:`schedule`."""
    cost_array = _as_costs(costs)
    num_microbatches = _as_int("num_microbatches", num_microbatches)
    dp_size = _as_int("dp_size", dp_size)
    num_bins = num_microbatches * dp_size
    bins = np.asarray(assignment)
    if bins.dtype.kind not in "iu" or bins.shape != (cost_array.shape[0],):
        raise ValueError(
            f"assignment must be an integer array of shape ({cost_array.shape[0]},), "
            f"got dtype {bins.dtype} shape {bins.shape}"
        )
    bad = np.flatnonzero((bins < 0) | (bins >= num_bins))
    if bad.size:
        raise ValueError(f"assignment[{bad[0]}]={bins[bad[0]]} is out of range [0, {num_bins})")
    num_dims = cost_array.shape[1]
    dims = _as_dims(microbatch_dims)
    for k, d in enumerate(dims):
        if not 0 <= d < num_dims:
            raise ValueError(f"microbatch_dims[{k}]={d} is out of range for D={num_dims}")
    bins = bins.astype(np.int64)
    loads = np.zeros((num_bins, num_dims))
    np.add.at(loads, bins, cost_array)
    mb_loads = loads.reshape(num_microbatches, dp_size, num_dims).sum(axis=1)
    is_mb = np.zeros(num_dims, dtype=bool)
    is_mb[list(dims)] = True
    per_dim_max = np.where(is_mb, mb_loads.max(axis=0), loads.max(axis=0))
    counts = np.where(is_mb, num_microbatches, num_bins)
    largest = cost_array.max(axis=0) if cost_array.shape[0] else np.zeros(num_dims)
    lower_bound = float(max(np.max(cost_array.sum(axis=0) / counts), np.max(largest)))
    return Schedule(
        assignment=_frozen(bins),
        loads=_frozen(loads),
        microbatch_loads=_frozen(mb_loads),
        makespan=float(per_dim_max.max()),
        lower_bound=lower_bound,
        num_microbatches=num_microbatches,
        dp_size=dp_size,
        microbatch_dims=dims,
        seed=0,
        solve_time_s=0.0,
    )


def data_blind_schedule(
    costs: Any,
    num_microbatches: int,
    dp_size: int = 1,
    *,
    microbatch_dims: Sequence[int] = (),
) -> Schedule:
    """What a data-blind framework does: samples in dataset order, split into
    ``num_microbatches`` equal-count microbatches, each split evenly over the DP ranks."""
    cost_array = _as_costs(costs)
    bad = np.argwhere(~np.isfinite(cost_array))
    if bad.size:
        i, d = (int(v) for v in bad[0])
        raise ValueError(f"costs[{i}, {d}]={cost_array[i, d]} is not finite")
    num_samples = cost_array.shape[0]
    num_bins = _as_int("num_microbatches", num_microbatches) * _as_int("dp_size", dp_size)
    if num_bins < 1 or num_samples < num_bins:
        raise ValueError(
            f"need num_microbatches x dp_size >= 1 bins and at least one sample per bin, "
            f"got {num_samples} samples for {num_bins} bins"
        )
    # Consecutive equal-count chunks per microbatch, then consecutive per rank.
    microbatch_of = np.arange(num_samples) * num_microbatches // num_samples
    assignment = np.empty(num_samples, dtype=np.int64)
    for mb in range(num_microbatches):
        members = np.flatnonzero(microbatch_of == mb)
        rank_of = np.arange(members.size) * dp_size // members.size
        assignment[members] = mb * dp_size + rank_of
    return schedule_from_assignment(
        cost_array, assignment, num_microbatches, dp_size, microbatch_dims=microbatch_dims
    )


def _perf_counter() -> float:
    return time.perf_counter()
