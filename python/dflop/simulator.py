"""Pipeline step simulator: ``dflop.simulator.simulate_pipeline()``.

Simulates one training step of one or more pipeline replicas (data parallelism) running a
pipeline program (1F1B, GPipe, interleaved 1F1B, or any valid action list; see
:mod:`dflop.scheduling.actions`) with the native discrete-event core. The model:

- Each physical stage runs its actions in the program's order (the order dflop's runtime
  executes), one at a time. An action starts when its stage is free and its input has
  arrived: forward k at virtual stage v waits for forward k of v-1 plus the transfer;
  backward k at v waits for backward k of v+1 plus the transfer (a weight-gradient
  backward waits for nothing, nor does any backward at v when ``gradient_links[v]`` is 0:
  no gradient comes back over that boundary).
- A transfer over boundary l (virtual stage l <-> l+1) takes ``activation_bytes /
  bandwidth`` seconds of the link between their physical stages in that direction, FIFO
  in the senders' order, and arrives ``link_latency_s`` later. Gradients are as large as
  activations. Transfers never occupy a stage's compute.
- After its last backward, each stage waits for the same stage of every replica and then
  all-reduces gradients for ``allreduce_s[stage]`` seconds; the step ends when the last
  all-reduce does (step barrier).
- busy = forward + backward seconds; idle = step time - busy (bubbles, waiting for inputs,
  all-reduce and barrier).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop import _core
from dflop._deprecated import warn_renamed
from dflop.errors import InputTypeError
from dflop.scheduling.actions import (
    PipelineProgram,
    action_arrays,
    as_int,
    pipeline_order_name,
    virtual_stage_owners,
)
from dflop.timeline import EVENT_DTYPE, EVENT_KINDS, write_chrome_trace, write_gantt_png

__all__ = ["SimulationResult", "simulate_pipeline"]


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@dataclass(frozen=True)
class SimulationResult:
    """The outcome of one simulated step. Arrays are read-only; times in seconds."""

    step_time_s: float
    """Step time: the end of the last gradient all-reduce (or backward, without one)."""
    busy_s: np.ndarray
    """(R, S) float64: forward + backward seconds of each replica's stage."""
    idle_s: np.ndarray
    """(R, S) float64: ``step_time_s - busy_s``."""
    compute_end_s: np.ndarray
    """(R, S) float64: when each replica's stage finished its last backward."""
    events: np.ndarray
    """Structured array of :data:`dflop.timeline.EVENT_DTYPE`: every forward, backward,
    send and all-reduce, sorted by start time (then replica, stage, kind, microbatch)."""
    order: str
    """The pipeline order simulated (e.g. ``"1f1b"``)."""
    num_replicas: int
    num_stages: int
    num_microbatches: int

    @property
    def idle_fraction(self) -> float:
        """GPU-seconds not computing over all GPU-seconds of the step (0.0 for an empty step)."""
        total_s = self.step_time_s * self.num_replicas * self.num_stages
        return float(self.idle_s.sum() / total_s) if total_s > 0 else 0.0

    def write_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write the timeline as Chrome-trace JSON (opens in Perfetto)."""
        write_chrome_trace(self.events, path)

    def write_gantt_png(self, path: str | os.PathLike, *, title: str | None = None) -> None:
        """Draw the timeline as a PNG Gantt chart (needs matplotlib)."""
        write_gantt_png(self.events, path, title=title)


def _numeric(name: str, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind not in "iuf":
        raise InputTypeError(f"{name} must be numeric (integer or float), got dtype {array.dtype}")
    return array.astype(np.float64)


def _segments(
    stages: Sequence[int] | None, chunks: Sequence[int] | None, num_virtual: int
) -> tuple[list[int], list[int]]:
    if stages is None:
        if chunks is not None:
            raise ValueError("chunks needs stages (the physical stages of each segment)")
        return [num_virtual], [1]
    stage_counts = [as_int(f"stages[{i}]", s) for i, s in enumerate(stages)]
    if chunks is None:
        return stage_counts, [1] * len(stage_counts)
    return stage_counts, [as_int(f"chunks[{i}]", c) for i, c in enumerate(chunks)]


def _broadcast(name: str, value: Any, shape: tuple[int, ...], accepted: str) -> np.ndarray:
    array = _numeric(name, value)
    if array.ndim != 0 and array.shape != shape:
        raise ValueError(
            f"{name} must be a scalar or have shape {accepted} = {shape}, got shape {array.shape}"
        )
    return np.ascontiguousarray(np.broadcast_to(array, shape))


def _like(name: str, value: Any, shaped: np.ndarray, other: str, given: Any) -> np.ndarray:
    """``value`` as a contiguous (R, V, m) array of ``shaped``'s shape (a 2-D one gains
    the replica axis); the error names ``other``, the argument whose shape it must have."""
    array = _numeric(name, value)
    if array.ndim == 2:
        array = array[np.newaxis]
    if array.shape != shaped.shape:
        raise ValueError(
            f"{name} must have the shape of {other} {np.shape(given)}, got {np.shape(value)}"
        )
    return np.ascontiguousarray(array)


def simulate_pipeline(
    forward_s: Any,
    backward_s: Any,
    *,
    order: str = "1f1b",
    stages: Sequence[int] | None = None,
    chunks: Sequence[int] | None = None,
    program: PipelineProgram | None = None,
    weight_grad_fraction: float = 0.5,
    weight_s: Any = None,
    link_latency_s: Any = 0.0,
    activation_bytes: Any = None,
    link_bandwidth_bytes_per_s: Any = math.inf,
    allreduce_s: Any = 0.0,
    gradient_links: Any = None,
    record_events: bool = True,
    schedule: str | None = None,
) -> SimulationResult:
    """Simulate one training step of pipelines.

    Args:
        forward_s: forward seconds per (virtual stage, microbatch), shape (V, m), or per
            (replica, virtual stage, microbatch), shape (R, V, m), for R data-parallel
            replicas. Without chunks, virtual stages are the physical stages (V = S).
        backward_s: backward seconds, the same shape as ``forward_s``.
        order: the pipeline order: "1f1b" (non-interleaved, Megatron-LM style), "gpipe",
            "interleaved-1f1b" or "zb-h1" (zero bubble, split backwards); the actions of each
            stage are
            :func:`dflop.scheduling.pipeline_program`'s.
        stages, chunks: the pipeline's segments (physical stages and chunks per stage of
            each module; see :mod:`dflop.scheduling.actions`). Default: one segment of V
            stages, one chunk each.
        program: a :class:`~dflop.scheduling.PipelineProgram` to run instead of the
            order's (validated; its owners must be those of ``stages`` / ``chunks``).
        weight_grad_fraction: the share of ``backward_s`` a ``"W"`` action takes (its ``"I"``
            the rest); used only by programs that split the backward, without ``weight_s``.
        weight_s: None, or the seconds of ``backward_s`` (at most it, same shape) a ``"W"``
            action takes per cell, its ``"I"`` the rest (e.g. a first stage, whose input
            takes no gradient, defers its whole backward).
        link_latency_s: point-to-point latency of boundary l (virtual stage l -> l+1): a
            scalar or shape (V-1,).
        activation_bytes: bytes of microbatch k's activation over boundary l (the gradient
            back is as large): None (nothing is sent; transfers take only the latency), a
            scalar, shape (V-1, m), or (R, V-1, m).
        link_bandwidth_bytes_per_s: bandwidth of each boundary, a scalar or shape (V-1,);
            > 0, ``inf`` means free transfers.
        allreduce_s: gradient all-reduce seconds of each physical stage after its last
            action: a scalar or shape (S,). All zeros means no all-reduce (no all-reduce
            events).
        gradient_links: None (every boundary carries gradients back), or shape (V-1,) of
            0 / 1 (or bools): 0 means boundary l sends no gradient back (e.g. virtual stages
            0..l are frozen and their backwards compute nothing), so the backward at l waits
            only for its own forward and no gradient is sent over boundary l.
        record_events: False leaves ``events`` empty (faster when only times matter).
        schedule: deprecated name of ``order``.

    Returns:
        A :class:`SimulationResult`; its per-stage arrays are (R, S) over physical stages
        (R = 1 for 2-D input).

    Raises:
        TypeError: non-numeric arrays or a non-str order.
        ValueError: wrong shapes, or negative, NaN or infinite times and sizes, naming
            the argument (and the first offending index).
    """
    if schedule is not None:
        warn_renamed("simulate_pipeline(schedule=...)", "simulate_pipeline(order=...)")
        order = schedule
    name = pipeline_order_name(order)
    fwd = _numeric("forward_s", forward_s)
    if fwd.ndim == 2:
        fwd = fwd[np.newaxis]
    if fwd.ndim != 3:
        raise ValueError(f"forward_s must have shape (S, m) or (R, S, m), got shape {fwd.shape}")
    num_replicas, num_virtual, num_microbatches = fwd.shape
    for dim, size in zip(("R", "V", "m"), fwd.shape):
        if size < 1:
            raise ValueError(f"forward_s must have {dim} >= 1, got shape {fwd.shape}")
    bwd = _like("backward_s", backward_s, fwd, "forward_s", forward_s)
    stage_counts, chunk_counts = _segments(stages, chunks, num_virtual)
    num_stages = sum(stage_counts)
    expected_virtual = sum(s * c for s, c in zip(stage_counts, chunk_counts))
    if expected_virtual != num_virtual:
        raise ValueError(
            f"forward_s has {num_virtual} virtual stages, the segments stages={stage_counts}, "
            f"chunks={chunk_counts} have {expected_virtual}"
        )
    actions = None
    if program is not None:
        if not isinstance(program, PipelineProgram):
            raise InputTypeError(f"program must be a PipelineProgram, got {program!r}")
        if program.num_microbatches != num_microbatches:
            raise ValueError(
                f"program has {program.num_microbatches} microbatches, forward_s {num_microbatches}"
            )
        owners = list(virtual_stage_owners(stage_counts, chunk_counts))
        if list(program.owner) != owners:
            raise ValueError(
                f"program's owners {list(program.owner)} are not those of stages="
                f"{stage_counts}, chunks={chunk_counts} ({owners})"
            )
        actions = action_arrays(program.actions)
    num_links = num_virtual - 1
    latency = _broadcast("link_latency_s", link_latency_s, (num_links,), "(V-1,)")
    bandwidth = _broadcast(
        "link_bandwidth_bytes_per_s", link_bandwidth_bytes_per_s, (num_links,), "(V-1,)"
    )
    sizes: np.ndarray | None = None
    if activation_bytes is not None:
        sizes = _numeric("activation_bytes", activation_bytes)
        if sizes.ndim == 2:
            sizes = sizes[np.newaxis]
        target = (num_replicas, num_links, num_microbatches)
        if sizes.ndim != 0 and (
            sizes.ndim != 3
            or sizes.shape[1:] != target[1:]
            or sizes.shape[0] not in (1, num_replicas)
        ):
            raise ValueError(
                "activation_bytes must be a scalar or have shape (V-1, m) or (R, V-1, m) = "
                f"{target}, got shape {np.shape(activation_bytes)}"
            )
        sizes = np.ascontiguousarray(np.broadcast_to(sizes, target))
    allreduce = _broadcast("allreduce_s", allreduce_s, (num_stages,), "(S,)")
    grad_links: np.ndarray | None = None
    if gradient_links is not None:
        grad_links = np.asarray(gradient_links)
        if grad_links.dtype == object or grad_links.dtype.kind not in "biu":
            raise InputTypeError(
                f"gradient_links must be integers or bools, got dtype {grad_links.dtype}"
            )
        if grad_links.shape != (num_links,):
            raise ValueError(
                f"gradient_links must have shape (V-1,) = {(num_links,)}, "
                f"got shape {grad_links.shape}"
            )
        grad_links = np.ascontiguousarray(grad_links, dtype=np.int64)
    weight = (
        None if weight_s is None else _like("weight_s", weight_s, fwd, "backward_s", backward_s)
    )
    raw = _core.simulate_pipeline(
        np.ascontiguousarray(fwd),
        np.ascontiguousarray(bwd),
        name,
        latency,
        bandwidth,
        sizes,
        None if np.all(allreduce == 0.0) else allreduce,
        bool(record_events),
        stages=stage_counts,
        chunks=chunk_counts,
        actions=actions,
        weight_grad_fraction=float(weight_grad_fraction),
        gradient_links=grad_links,
        weight_s=weight,
    )
    if not (np.isfinite(raw["step_time_s"]) and np.isfinite(raw["busy_s"]).all()):
        raise ValueError(
            "the simulated times overflow float64 (inputs too large: their sums over the "
            "pipeline are not finite); give times in seconds of a real step"
        )
    columns = raw["events"]
    events = np.empty(columns["start_s"].shape[0], dtype=EVENT_DTYPE)
    events["kind"] = np.asarray(EVENT_KINDS)[columns["kind"].astype(np.intp)]
    for field in (
        "replica",
        "stage",
        "microbatch",
        "peer_stage",
        "start_s",
        "end_s",
        "virtual_stage",
    ):
        events[field] = columns[field]
    return SimulationResult(
        step_time_s=float(raw["step_time_s"]),
        busy_s=_frozen(raw["busy_s"]),
        idle_s=_frozen(raw["idle_s"]),
        compute_end_s=_frozen(raw["compute_end_s"]),
        events=_frozen(events),
        order=name,
        num_replicas=num_replicas,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
    )
