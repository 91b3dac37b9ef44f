"""Pipeline schedules as data: the order of actions each stage runs.

:func:`pipeline_actions` is the one definition of a pipeline schedule's order: the
simulator (:func:`dflop.simulator.simulate_pipeline`, whose native core uses the same
C++ function) and the runtime's pipeline engine (:mod:`dflop.runtime.pipeline`) both run
what it lists, so a simulated step and an executed one agree action by action.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dflop import _core
from dflop.errors import InputTypeError

__all__ = ["MAX_ACTIONS_MICROBATCHES", "SCHEDULES", "pipeline_actions"]

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")
"""The pipeline schedules (case-insensitive names)."""


def schedule_name(schedule: Any) -> str:
    if not isinstance(schedule, str):
        raise InputTypeError(f"schedule must be a str, got {type(schedule).__name__} {schedule!r}")
    name = schedule.lower()
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return name


def as_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def pipeline_actions(
    schedule: str, num_stages: int, num_microbatches: int, stage: int
) -> list[tuple[bool, int]]:
    """The exact order of (is_forward, microbatch) actions that ``stage`` (0-indexed) of a
    ``num_stages``-stage pipeline runs for ``num_microbatches`` microbatches.

    - "gpipe": F0, F1, ..., F(m-1), then B0, B1, ..., B(m-1).
    - "1f1b": ``w = min(num_stages - 1 - stage, m)`` warm-up forwards F0..F(w-1); then for
      i = 0 .. m-w-1 the pair F(w+i), B(i); then the cool-down backwards B(m-w)..B(m-1).
      Equivalently: run a forward while forwards remain and fewer than
      ``num_stages - stage`` microbatches are in flight, else the oldest backward.

    Raises:
        ValueError: an unknown schedule, counts < 1, or ``stage`` out of range.
    """
    count = as_int("num_microbatches", num_microbatches)
    if count > MAX_ACTIONS_MICROBATCHES:
        raise ValueError(
            f"num_microbatches={count} is more than {MAX_ACTIONS_MICROBATCHES:,} (the action "
            "list would not fit in memory)"
        )
    return [
        (bool(is_forward), int(microbatch))
        for is_forward, microbatch in _core.pipeline_actions(
            schedule_name(schedule),
            as_int("num_stages", num_stages),
            count,
            as_int("stage", stage),
        )
    ]


MAX_ACTIONS_MICROBATCHES = 10_000_000
"""The most microbatches :func:`pipeline_actions` lists (two actions each)."""
