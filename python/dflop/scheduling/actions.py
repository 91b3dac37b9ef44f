"""Pipeline schedules as data: the actions each physical stage runs, in order.

A pipeline is a sequence of segments (modules: the vision encoder, then the LLM); segment
g has ``stages[g]`` physical stages (ranks of one replica) holding ``chunks[g]`` model
chunks each. Its layers are cut into ``stages[g] * chunks[g]`` *virtual stages*: virtual
stage ``c * stages[g] + p`` runs on the segment's physical stage p (Megatron-LM's
interleaved placement; one chunk is the plain pipeline). An action is a
:class:`PipelineAction` ``(stage, kind, microbatch)``: the virtual stage, ``"F"``
(forward), ``"B"`` (backward), or, for schedules that split the backward (zero-bubble),
``"I"`` (input gradient, sent on at once) and ``"W"`` (weight gradient).

:func:`pipeline_program` is the one definition of a pipeline order: the simulator
(:func:`dflop.simulator.simulate_pipeline`, whose native core uses the same C++ function),
the planner's memory model (:func:`peak_in_flight`) and the runtime's pipeline engine
(:mod:`dflop.runtime.engine`) all use it, so a simulated step and an executed one agree
action by action. :func:`validate_program` checks any program, generated or hand-written
(every action on its virtual stage's owner, each microbatch's forward before its
backward, and no stage waiting for an action that waits for it); its errors show the
program as a stage x time grid with the failing action marked (:func:`program_grid`).

The pipeline orders are a registry in the native core (``pipeline_order_registry()`` in
``cpp/src/pipeline_program.cpp``): each is a name, its generator and its memory rule, and
:data:`PIPELINE_ORDERS` lists them from there. A new pipeline order is one generator and its memory
rule registered there. :func:`pipeline_order_for` is the one choice of the pipeline order dflop runs
on a pipeline (the native core's, which the planner and the trainer's scheduler use too).

Actions as text: :func:`format_action` / :func:`parse_action` (``"F1.3"``: kind, virtual
stage, ``.``, microbatch). A whole program round-trips through a text file
(:func:`save_program` / :func:`load_program`, :func:`format_program` /
:func:`parse_program`), validated on load::

    # comments and blank lines are ignored
    microbatches 4
    owners 0 1 0 1
    stage 0: F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 ...
    stage 1: F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 ...

``microbatches`` (the count m) and ``owners`` (per virtual stage, the physical stage
that runs it) once each, then one ``stage s:`` line per physical stage, s = 0, 1, ... in
order, holding its actions in execution order, separated by spaces.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from dflop import _core
from dflop.errors import InputTypeError, bounded_repr

__all__ = [
    "ACTION_KINDS",
    "MAX_ACTIONS_MICROBATCHES",
    "PIPELINE_ORDERS",
    "PipelineAction",
    "PipelineProgram",
    "format_action",
    "format_program",
    "load_program",
    "parse_action",
    "parse_program",
    "peak_in_flight",
    "pipeline_actions",
    "pipeline_program",
    "program_grid",
    "save_program",
    "pipeline_order_for",
    "validate_program",
    "virtual_stage_owners",
]

PIPELINE_ORDERS: tuple[str, ...] = tuple(_core.pipeline_order_names())
"""The generated pipeline schedules (case-insensitive names), from the native core's
registry: ``("1f1b", "gpipe", "interleaved-1f1b")``."""

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
    """A whole pipeline's program: who runs each virtual stage, and every physical stage's
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


def pipeline_order_for(layout: Any) -> str:
    """The pipeline order dflop runs on a pipeline: ``"interleaved-1f1b"`` when a segment has
    chunks > 1 (the LLM's virtual stages), else ``"1f1b"``. The choice is the native
    core's ``pipeline_order_for`` (the one the planner and the trainer's scheduler make), so it
    exists once.

    Args:
        layout: a :class:`~dflop.runtime.topology.RuntimeLayout` (anything with
            ``pipeline_stages``), or a ``(stages, chunks)`` pair of per-segment counts.

    Raises:
        ValueError: bad counts.
    """
    pair = getattr(layout, "pipeline_stages", layout)
    if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
        raise InputTypeError(
            "pipeline_order_for takes a RuntimeLayout or a (stages, chunks) pair, got "
            f"{bounded_repr(layout)}"
        )
    return str(_core.pipeline_order_for(_ints("stages", pair[0]), _ints("chunks", pair[1])))


def virtual_stage_owners(
    stages: Sequence[int], chunks: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Per virtual stage, the physical stage that runs it, for segments of ``stages[g]``
    physical stages holding ``chunks[g]`` chunks each (Megatron-LM's placement: virtual
    stage ``c * stages[g] + p`` of segment g on its physical stage p)."""
    stage_counts = _ints("stages", stages)
    chunk_counts = [1] * len(stage_counts) if chunks is None else _ints("chunks", chunks)
    if len(chunk_counts) != len(stage_counts):
        raise ValueError(
            f"chunks has {len(chunk_counts)} entries, expected one per segment ({len(stage_counts)})"
        )
    owners: list[int] = []
    first = 0
    for count, chunk in zip(stage_counts, chunk_counts):
        owners.extend(first + p for _ in range(chunk) for p in range(count))
        first += count
    return tuple(owners)


def pipeline_order_name(order: Any) -> str:
    if not isinstance(order, str):
        raise InputTypeError(f"pipeline order must be a str, got {type(order).__name__} {order!r}")
    name = order.lower()
    if name not in PIPELINE_ORDERS:
        raise ValueError(f"pipeline order must be one of {PIPELINE_ORDERS}, got {order!r}")
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
    order: str,
    stages: Sequence[int],
    num_microbatches: int,
    *,
    chunks: Sequence[int] | None = None,
) -> PipelineProgram:
    """The program of a generated pipeline order over segments of ``stages[g]`` physical stages
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
    - ``"zb-h1"`` (zero bubble, Qi et al. 2023; chunks 1): 1F1B's warm-up with each
      backward split into ``I`` (input gradient) and ``W`` (weight gradients), stage s's
      ``W`` passes s microbatches behind its ``I`` passes, the cool-down's ``I`` passes each
      followed by the oldest ``W`` left: ``min(S, m)`` microbatches in flight on every stage.

    Raises:
        ValueError: an unknown pipeline order, bad counts, chunks it cannot run, or
            (interleaved) m not a multiple of the last segment's stages.
    """
    name = pipeline_order_name(order)
    stage_counts = _ints("stages", stages)
    chunk_counts = [1] * len(stage_counts) if chunks is None else _ints("chunks", chunks)
    count = _count(num_microbatches)
    owner, lists = _core.pipeline_program(name, stage_counts, chunk_counts, count)
    return PipelineProgram(count, tuple(owner), tuple(_actions(rows) for rows in lists))


def pipeline_actions(
    order: str, num_stages: int, num_microbatches: int, stage: int
) -> list[PipelineAction]:
    """The actions of ``stage`` (0-indexed) of a plain ``num_stages``-stage pipeline (one
    segment, one chunk per stage): ``pipeline_program(order, [num_stages], m)``'s.

    - "gpipe": F0, F1, ..., F(m-1), then B0, B1, ..., B(m-1).
    - "1f1b": ``w = min(num_stages - 1 - stage, m)`` warm-up forwards F0..F(w-1); then for
      i = 0 .. m-w-1 the pair F(w+i), B(i); then the cool-down backwards B(m-w)..B(m-1).
      Equivalently: run a forward while forwards remain and fewer than
      ``num_stages - stage`` microbatches are in flight, else the oldest backward.

    Raises:
        ValueError: an unknown pipeline order, counts < 1, or ``stage`` out of range.
    """
    total = as_int("num_stages", num_stages)
    index = as_int("stage", stage)
    if not 0 <= index < max(total, 1):
        raise ValueError(f"stage must be in [0, {total}), got {index}")
    return list(pipeline_program(order, [total], num_microbatches).actions[index])


def peak_in_flight(
    order: str,
    stages: Sequence[int],
    num_microbatches: int,
    stage: int,
    *,
    chunks: Sequence[int] | None = None,
) -> int:
    """The memory rule of a generated pipeline order: the most (virtual stage, microbatch)
    activations physical ``stage`` holds at once (1F1B: ``min(S - stage, m)``; GPipe: all
    ``m * chunks``; interleaved: its warm-up + 1). Equal to the peak counted along
    :func:`pipeline_program`'s list (a forward keeps its activations until its ``B``, or
    its ``W``, ends)."""
    stage_counts = _ints("stages", stages)
    chunk_counts = [1] * len(stage_counts) if chunks is None else _ints("chunks", chunks)
    return int(
        _core.peak_in_flight(
            pipeline_order_name(order),
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


def program_grid(program: PipelineProgram, marks: Sequence[tuple[int, int]] = ()) -> str:
    """``program`` as a stage x time grid (what a validation error shows): a row per
    physical stage, a column per time slot (the stage's action index), cells
    :func:`format_action`; the actions at ``marks`` (``(stage, index)`` pairs) shown as
    ``>F1.3<``. At most 16 rows and 12 columns, a window around the first mark, with what
    lies outside it counted."""
    if not isinstance(program, PipelineProgram):
        raise InputTypeError(f"program must be a PipelineProgram, got {type(program).__name__}")
    pairs = [(as_int("marks stage", s), as_int("marks index", i)) for s, i in marks]
    return str(
        _core.program_grid(
            list(program.owner), action_arrays(program.actions), program.num_microbatches, pairs
        )
    )


# --------------------------------------------------------------------------- text

ACTION_SYNTAX = "kind F/B/I/W, virtual stage, '.', microbatch, e.g. F1.3"
"""How an action is written (:func:`format_action`)."""

_ACTION = re.compile(r"([A-Za-z])(0|[1-9][0-9]{0,11})\.(0|[1-9][0-9]{0,11})")


def format_action(action: PipelineAction | tuple[int, str, int]) -> str:
    """The short text of an action: kind, virtual stage, ``.``, microbatch (``"F1.3"``:
    the forward of virtual stage 1 on microbatch 3; ``"W0.2"``: the weight gradient of
    virtual stage 0 on microbatch 2). :func:`parse_action` reads it back.

    Raises:
        ValueError: a kind other than F, B, I, W, or a negative index.
    """
    stage, kind, microbatch = action
    if kind not in ACTION_KINDS:
        raise ValueError(
            f"action kind {bounded_repr(kind)} is not one of {', '.join(ACTION_KINDS)}"
        )
    stage, microbatch = as_int("stage", stage), as_int("microbatch", microbatch)
    if stage < 0 or microbatch < 0:
        raise ValueError(f"action ({stage}, {kind!r}, {microbatch}) has a negative index")
    return f"{kind}{stage}.{microbatch}"


def parse_action(text: str) -> PipelineAction:
    """The action :func:`format_action` wrote as ``text`` (exactly that spelling: no spaces,
    no leading zeros, at most 12 digits per number).

    Raises:
        ValueError: naming the text, for anything else.
    """
    if not isinstance(text, str):
        raise InputTypeError(f"an action's text must be a str, got {type(text).__name__}")
    match = _ACTION.fullmatch(text)
    if match is None:
        raise ValueError(f"{bounded_repr(text, 40)} is not an action ({ACTION_SYNTAX})")
    kind = match.group(1)
    if kind not in ACTION_KINDS:
        raise ValueError(
            f"{bounded_repr(text, 40)} has kind {kind!r}, not one of {', '.join(ACTION_KINDS)}"
        )
    return PipelineAction(int(match.group(2)), kind, int(match.group(3)))


def format_program(program: PipelineProgram) -> str:
    """``program`` as the text :func:`parse_program` reads (the format in the module
    docstring), ending in a newline. Not validated (see :func:`validate_program`)."""
    if not isinstance(program, PipelineProgram):
        raise InputTypeError(f"program must be a PipelineProgram, got {type(program).__name__}")
    lines = [
        "# dflop pipeline program: one line per physical stage, its actions in execution order",
        "# (F1.3 = the forward of virtual stage 1 on microbatch 3; B backward, I / W its input",
        "# and weight halves)",
        f"microbatches {as_int('num_microbatches', program.num_microbatches)}",
        "owners " + " ".join(str(as_int("owner", o)) for o in program.owner),
    ]
    for s, actions in enumerate(program.actions):
        lines.append(" ".join([f"stage {s}:", *(format_action(a) for a in actions)]))
    return "\n".join(lines) + "\n"


def parse_program(text: str, *, source: str = "the program") -> PipelineProgram:
    """The program written as ``text`` (see the module docstring), validated
    (:func:`validate_program`). ``source`` names it in messages (e.g. the file).

    Raises:
        ValueError: naming ``source``, the line and the problem; a program that does not
            validate carries the validator's message and its stage x time grid.
    """
    if not isinstance(text, str):
        raise InputTypeError(f"a program's text must be a str, got {type(text).__name__}")
    microbatches: int | None = None
    owners: tuple[int, ...] | None = None
    stages: list[tuple[PipelineAction, ...]] = []

    def number(word: str, where: str) -> int:
        if not re.fullmatch(r"0|[1-9][0-9]{0,11}", word):
            raise ValueError(f"{where}: {bounded_repr(word, 40)} is not a whole number")
        return int(word)

    for index, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}, line {index}"
        key, *tail = line.split(None, 1)
        rest = tail[0] if tail else ""
        words = rest.split()
        if key == "microbatches":
            if microbatches is not None or len(words) != 1:
                raise ValueError(f"{where}: 'microbatches' takes one count, given once")
            microbatches = number(words[0], where)
        elif key == "owners":
            if owners is not None:
                raise ValueError(f"{where}: 'owners' is given twice")
            owners = tuple(number(w, where) for w in words)
        elif key == "stage":
            label, colon, actions = rest.partition(":")
            if not colon or label.strip() != str(len(stages)):
                raise ValueError(
                    f"{where}: expected 'stage {len(stages)}:' (stage lines in order from 0)"
                )
            parsed = []
            for k, word in enumerate(actions.split()):
                try:
                    parsed.append(parse_action(word))
                except ValueError as error:
                    raise ValueError(f"{where}, action {k}: {error}") from None
            stages.append(tuple(parsed))
        else:
            raise ValueError(
                f"{where}: {bounded_repr(key, 40)} is not 'microbatches', 'owners' or 'stage'"
            )
    if microbatches is None or owners is None or not stages:
        missing = [n for n, v in (("microbatches", microbatches), ("owners", owners)) if v is None]
        raise ValueError(
            f"{source} lacks {' and '.join(missing) or 'stage lines'} (see "
            "dflop.scheduling.actions for the format)"
        )
    program = PipelineProgram(microbatches, owners, tuple(stages))
    try:
        validate_program(program)
    except ValueError as error:
        raise ValueError(f"{source} is not a valid program: {error}") from None
    return program


def save_program(program: PipelineProgram, path: str | os.PathLike[str]) -> None:
    """Write ``program`` to ``path`` as :func:`format_program` (atomically: a failure
    leaves no partial file).

    Raises:
        WriteError: the file could not be written.
    """
    from dflop.output import write_text

    write_text(path, format_program(program))


def load_program(path: str | os.PathLike[str]) -> PipelineProgram:
    """The program in the file at ``path`` (:func:`save_program`'s format), validated.

    Raises:
        FileNotFoundError: no file there.
        ValueError: not a regular file, not UTF-8 text, or not a valid program (naming the
            file and line; see :func:`parse_program`).
    """
    from dflop.safe_io import open_regular, path_repr

    try:
        with open_regular(path, "r", "pipeline program file") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ValueError(f"pipeline program file {path_repr(path)} is not UTF-8 text") from None
    return parse_program(text, source=f"pipeline program file {path_repr(path)}")
