"""Asynchronous scheduling: compute step k+1's schedule while step k trains.

A single background thread solves submitted steps in order. Schedules wait in memory,
keyed by step, with a bounded look-ahead (no files, no races). Each submission carries a
deadline; the solver returns the best schedule found by then, and :meth:`get` never waits
past it: if the step has not even started solving by then, it is solved at once with the
constructive start only (sub-millisecond). So scheduling never stalls training.

With a deadline the schedule depends on machine speed. In a distributed job, compute it on
one rank and broadcast the assignment (``Schedule.assignment``), or run every rank without
deadlines (``deadline_s=None``): the solver is then deterministic and all ranks agree.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop.errors import InputTypeError
from dflop.scheduling.balance import Schedule, schedule
from dflop.scheduling.pipeline_schedule import PipelineModel, pipeline_schedule

__all__ = ["AsyncScheduler"]


@dataclass
class _Job:
    step: int
    costs: np.ndarray
    deadline: float | None  # time.monotonic() by which the schedule must exist
    pipeline: PipelineModel | None
    units: np.ndarray | None = None
    result: Schedule | None = None
    error: BaseException | None = None
    started: bool = False
    done: threading.Event = None  # type: ignore[assignment]


class AsyncScheduler:
    """Background schedule computation with bounded look-ahead.

    Args:
        num_microbatches, dp_size, microbatch_dims, capacity, seed, time_budget_ms: as for
            :func:`dflop.schedule`, used for every step (the seed is offset by the step).
        pipeline: if given, every schedule is refined for this module pipeline by
            :func:`dflop.pipeline_schedule` (with ``max_growth`` and
            ``pipeline_time_budget_ms``) in the background thread; :meth:`submit` can
            override it per step (e.g. with re-calibrated constants).
        lookahead: at most this many submitted steps wait unconsumed; :meth:`submit`
            blocks (the data producer, not training, waits) beyond it.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        num_microbatches: int,
        dp_size: int = 1,
        *,
        microbatch_dims: Sequence[int] = (),
        capacity: Sequence[float] | None = None,
        seed: int = 0,
        time_budget_ms: float | None = None,
        lookahead: int = 2,
        pipeline: PipelineModel | None = None,
        max_growth: float = 1.05,
        pipeline_time_budget_ms: float | None = None,
    ) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        if pipeline is not None and not isinstance(pipeline, PipelineModel):
            raise InputTypeError(f"pipeline must be a dflop.PipelineModel, got {pipeline!r}")
        if isinstance(max_growth, bool) or not isinstance(max_growth, (int, float)):
            raise InputTypeError(f"max_growth must be a number, got {max_growth!r}")
        if not max_growth >= 1:
            raise ValueError(f"max_growth must be >= 1 (inf allowed), got {max_growth}")
        self._kwargs: dict[str, Any] = dict(
            num_microbatches=num_microbatches,
            dp_size=dp_size,
            microbatch_dims=tuple(microbatch_dims),
            capacity=capacity,
            time_budget_ms=time_budget_ms,
        )
        self._seed = seed
        self._pipeline = pipeline
        self._max_growth = max_growth
        self._pipeline_budget_ms = pipeline_time_budget_ms
        self._lookahead = lookahead
        self._jobs: dict[int, _Job] = {}
        self._order: list[int] = []
        self._cond = threading.Condition()
        self._closed = False
        self.num_fallbacks = 0  # steps that were solved in get() because their turn never came
        self._thread = threading.Thread(target=self._run, name="dflop-scheduler", daemon=True)
        self._thread.start()

    # ---- producer side -------------------------------------------------------------
    def submit(
        self,
        step: int,
        costs: Any,
        deadline_s: float | None = None,
        pipeline: PipelineModel | None = None,
        units: Any = None,
    ) -> None:
        """Queue ``step``'s costs; ``deadline_s`` seconds from now its schedule must exist.
        ``pipeline``: this step's pipeline model (default: the constructor's); ``units``:
        the samples' visual units, needed when the pipeline replicates a module."""
        if pipeline is not None and not isinstance(pipeline, PipelineModel):
            raise InputTypeError(f"pipeline must be a dflop.PipelineModel, got {pipeline!r}")
        # Copies: the schedule is solved later, on another thread, for the costs as
        # submitted (the caller may reuse or overwrite its arrays meanwhile).
        array = np.array(costs, dtype=np.float64, copy=True)
        deadline = None if deadline_s is None else time.monotonic() + float(deadline_s)
        with self._cond:
            if self._closed:
                raise RuntimeError("AsyncScheduler is closed")
            if step in self._jobs:
                raise ValueError(f"step {step} was already submitted")
            while len(self._jobs) >= self._lookahead and not self._closed:
                self._cond.wait()
            job = _Job(
                step=step,
                costs=array,
                deadline=deadline,
                pipeline=pipeline or self._pipeline,
                units=None if units is None else np.array(units, copy=True),
                done=threading.Event(),
            )
            self._jobs[step] = job
            self._order.append(step)
            self._cond.notify_all()

    # ---- consumer side -------------------------------------------------------------
    def get(self, step: int) -> Schedule:
        """The schedule of ``step`` (removing it); waits at most until its deadline."""
        with self._cond:
            job = self._jobs.get(step)
            if job is None:
                raise KeyError(f"step {step} was not submitted (or was already taken)")
        timeout = None if job.deadline is None else max(0.0, job.deadline - time.monotonic())
        if not job.done.wait(timeout):
            with self._cond:
                fallback = not job.started
                if fallback:  # its turn has not come: solve here, constructive start only
                    self._order.remove(step)
                    job.started = True
            if fallback:
                self.num_fallbacks += 1
                self._solve(job, fallback=True, time_limit_s=None)
            job.done.wait()  # started jobs stop at their own deadline
        with self._cond:
            del self._jobs[step]
            self._cond.notify_all()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def __enter__(self) -> AsyncScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- worker ----------------------------------------------------------------------
    def _solve(self, job: _Job, *, fallback: bool, time_limit_s: float | None):
        """Solve ``job``; a fallback (in ``get``, on the critical path) spends no search
        effort: constructive start, and for a pipeline the constructive orders only."""
        try:
            kwargs = dict(self._kwargs)
            if fallback:
                kwargs["time_budget_ms"] = 0.0
            seed = self._seed + job.step
            if job.pipeline is None:
                job.result = schedule(job.costs, seed=seed, time_limit_s=time_limit_s, **kwargs)
            else:
                kwargs["balance_time_budget_ms"] = kwargs.pop("time_budget_ms")
                job.result = pipeline_schedule(
                    job.costs,
                    pipeline=job.pipeline,
                    max_growth=self._max_growth,
                    seed=seed,
                    time_limit_s=time_limit_s,
                    time_budget_ms=0.0 if fallback else self._pipeline_budget_ms,
                    units=job.units,
                    **kwargs,
                )
        except BaseException as error:  # reported to the consumer in get()
            job.error = error
        finally:
            job.done.set()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._order and not self._closed:
                    self._cond.wait()
                if self._closed and not self._order:
                    return
                job = self._jobs[self._order.pop(0)]
                job.started = True
            limit = None
            if job.deadline is not None:
                limit = max(0.0, job.deadline - time.monotonic())
            self._solve(job, fallback=False, time_limit_s=limit)
