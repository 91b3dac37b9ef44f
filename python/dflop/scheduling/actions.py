"""Pipeline schedules as data: the actions each physical stage runs, in order.

A pipeline is a sequence of segments (modules: the vision encoder, then the LLM); segment
g has ``stages[g]`` physical stages (ranks of one replica) holding ``chunks[g]`` model
chunks each. Its layers are cut into ``stages[g] * chunks[g]`` *virtual stages*: virtual
stage ``c * stages[g] + p`` runs on the segment's physical stage p (Megatron-LM's
interleaved placement; one chunk is the plain pipeline). An action is a
:class:`PipelineAction` ``(stage, kind, microbatch)``: the virtual stage, ``"F"``
(forward), ``"B"`` (backward), or, for schedules that split the backward (zero-bubble),
``"I"`` (input gradient, sent on at once) and ``"W"`` (weight gradient).

:func:`pipeline_program` is the one definition of a schedule's order: the simulator
(:func:`dflop.simulator.simulate_pipeline`, whose native core uses the same C++ function),
the planner's memory model (:func:`peak_in_flight`) and the runtime's pipeline engine
(:mod:`dflop.runtime.pipeline`) all use it, so a simulated step and an executed one agree
action by action. :func:`validate_program` checks any program, generated or hand-written
(every action on its virtual stage's owner, each microbatch's forward before its
backward, and no stage waiting for an action that waits for it). A new schedule is one
generator and its memory rule in the native core (``cpp/src/pipeline_program.cpp``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from dflop import _core
from dflop.errors import InputTypeError

__all__ = [
    "ACTION_KINDS",
    "MAX_ACTIONS_MICROBATCHES",
    "SCHEDULES",
    "PipelineAction",
    "PipelineProgram",
    "peak_in_flight",
    "pipeline_actions",
    "pipeline_program",
    "validate_program",
]

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved-1f1b")
"""The generated pipeline schedules (case-insensitive names)."""

ACTION_KINDS: tuple[str, ...] = ("F", "B", "I", "W")
"""Action kinds in the order of the native codes 0..3."""

MAX_ACTIONS_MICROBATCHES = 10_000_000
"""The most microbatches a program lists (two actions each per virtual stage)."""


class PipelineAction(NamedTuple):
    """One action of a stage: run ``kind`` of virtual stage ``stage`` on ``microbatch``."""

    stage: int
    kind: str
    microbatch: int

    @property
    def is_forward(self) -> bool:
        return self.kind == "F"

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclass(frozen=True)
class PipelineProgram:
    """A whole pipeline's schedule: who runs each virtual stage, and every physical stage's
    actions in order."""

    num_microbatches: int
    owner: tuple[int, ...]
    """Per virtual stage: the physical stage that runs it."""
    actions: tuple[tuple[PipelineAction, ...], ...]
    """Per physical stage: its actions in execution order."""

    @property
    def num_stages(self) -> int:
        return len(self.actions)

    @property
    def num_virtual_stages(self) -> int:
        return len(self.owner)

    def virtual_stages_of(self, stage: int) -> tuple[int, ...]:
        """The virtual stages physical ``stage`` runs, in model order (its chunks)."""
        return tuple(v for v, owner in enumerate(self.owner) if owner == stage)


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


def _count(num_microbatches: Any) -> int:
    count = as_int("num_microbatches", num_microbatches)
    if count > MAX_ACTIONS_MICROBATCHES:
        raise ValueError(
            f"num_microbatches={count} is more than {MAX_ACTIONS_MICROBATCHES:,} (the action "
            "list would not fit in memory)"
        )
    return count


def _ints(name: str, values: Any) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InputTypeError(f"{name} must be a sequence of integers, got {values!r}")
    return [as_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def _actions(rows: np.ndarray) -> tuple[PipelineAction, ...]:
    return tuple(PipelineAction(int(v), ACTION_KINDS[int(k)], int(j)) for v, k, j in rows.tolist())


def pipeline_program(
    schedule: str,
    stages: Sequence[int],
    num_microbatches: int,
    *,
    chunks: Sequence[int] | None = None,
) -> PipelineProgram:
    """The program of a generated schedule over segments of ``stages[g]`` physical stages
    holding ``chunks[g]`` model chunks each (default: one each).

    - ``"gpipe"``: every forward, then every backward.
    - ``"1f1b"`` (Megatron-LM's non-interleaved schedule; chunks 1): stage s of S runs
      ``w = min(S - 1 - s, m)`` warm-up forwards, then forward / backward pairs, then the
      remaining backwards: at most ``S - s`` microbatches in flight.
    - ``"interleaved-1f1b"`` (Megatron-LM's interleaved schedule, chunks > 1 on the last
      segment only): forwards in rounds of P microbatches chunk by chunk, backwards with the
      chunks reversed, ``min(2 (P - 1 - p) + (v - 1) P, m v)`` warm-up forwards; m must be
      a multiple of the last segment's stages P. Earlier segments run 1F1B, warmed up for
      what the last segment's first stage takes before its first backward.

    Raises:
        ValueError: an unknown schedule, bad counts, chunks the schedule cannot run, or
            (interleaved) m not a multiple of the last segment's stages.
    """
    name = schedule_name(schedule)
    stage_counts = _ints("stages", stages)
    chunk_counts = [1] * len(stage_counts) if chunks is None else _ints("chunks", chunks)
    count = _count(num_microbatches)
    owner, lists = _core.pipeline_program(name, stage_counts, chunk_counts, count)
    return PipelineProgram(count, tuple(owner), tuple(_actions(rows) for rows in lists))


def pipeline_actions(
    schedule: str, num_stages: int, num_microbatches: int, stage: int
) -> list[PipelineAction]:
    """The actions of ``stage`` (0-indexed) of a plain ``num_stages``-stage pipeline (one
    segment, one chunk per stage): ``pipeline_program(schedule, [num_stages], m)``'s.

    - "gpipe": F0, F1, ..., F(m-1), then B0, B1, ..., B(m-1).
    - "1f1b": ``w = min(num_stages - 1 - stage, m)`` warm-up forwards F0..F(w-1); then for
      i = 0 .. m-w-1 the pair F(w+i), B(i); then the cool-down backwards B(m-w)..B(m-1).
      Equivalently: run a forward while forwards remain and fewer than
      ``num_stages - stage`` microbatches are in flight, else the oldest backward.

    Raises:
        ValueError: an unknown schedule, counts < 1, or ``stage`` out of range.
    """
    total = as_int("num_stages", num_stages)
    index = as_int("stage", stage)
    if not 0 <= index < max(total, 1):
        raise ValueError(f"stage must be in [0, {total}), got {index}")
    return list(pipeline_program(schedule, [total], num_microbatches).actions[index])


def peak_in_flight(
    schedule: str,
    stages: Sequence[int],
    num_microbatches: int,
    stage: int,
    *,
    chunks: Sequence[int] | None = None,
) -> int:
    """The memory rule of a generated schedule: the most (virtual stage, microbatch)
    activations physical ``stage`` holds at once (1F1B: ``min(S - stage, m)``; GPipe: all
    ``m * chunks``; interleaved: its warm-up + 1). Equal to the peak counted along
    :func:`pipeline_program`'s list (a forward keeps its activations until its ``B``, or
    its ``W``, ends)."""
    stage_counts = _ints("stages", stages)
    chunk_counts = [1] * len(stage_counts) if chunks is None else _ints("chunks", chunks)
    return int(
        _core.peak_in_flight(
            schedule_name(schedule),
            stage_counts,
            chunk_counts,
            _count(num_microbatches),
            as_int("stage", stage),
        )
    )


def validate_program(program: PipelineProgram) -> None:
    """Check a (possibly hand-written) program; see the module docstring.

    Raises:
        ValueError: naming the physical stage, the action's index and the action.
    """
    if not isinstance(program, PipelineProgram):
        raise InputTypeError(f"program must be a PipelineProgram, got {type(program).__name__}")
    _core.validate_program(
        list(program.owner), action_arrays(program.actions), program.num_microbatches
    )


def action_arrays(actions: Sequence[Sequence[PipelineAction]]) -> list[np.ndarray]:
    """Action lists as the native core's (n, 3) int64 arrays."""
    out = []
    for s, stage_actions in enumerate(actions):
        rows = []
        for i, action in enumerate(stage_actions):
            stage, kind, microbatch = action
            if kind not in ACTION_KINDS:
                raise ValueError(f"actions[{s}][{i}] has kind {kind!r}, not one of {ACTION_KINDS}")
            rows.append(
                (as_int("stage", stage), ACTION_KINDS.index(kind), as_int("microbatch", microbatch))
            )
        out.append(np.array(rows, dtype=np.int64).reshape(-1, 3))
    return out
