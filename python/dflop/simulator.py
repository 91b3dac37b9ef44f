"""Pipeline step simulator: ``dflop.simulator.simulate_pipeline()``.

Simulates one training step of one or more pipeline replicas (data parallelism) under
1F1B or GPipe with the native discrete-event core. The model:

- Each stage runs its actions in the order :func:`dflop.scheduling.pipeline_actions` gives (the order
  dflop's runtime executes), one at a time. An action starts when its stage is free and
  its input has arrived: forward k at stage s waits for forward k of stage s-1 plus the
  transfer; backward k at stage s waits for backward k of stage s+1 plus the transfer.
- A transfer over link l (stage l <-> l+1) takes ``activation_bytes / bandwidth`` seconds
  of that link direction, FIFO in the sender's order, and arrives ``link_latency_s`` later.
  Gradients are as large as activations. Transfers never occupy a stage's compute.
- After its last backward, each stage waits for the same stage of every replica and then
  all-reduces gradients for ``allreduce_s[stage]`` seconds; the step ends when the last
  all-reduce does (step barrier).
- busy = forward + backward seconds; idle = step time - busy (bubbles, waiting for inputs,
  all-reduce and barrier).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop import _core
from dflop.errors import InputTypeError
from dflop.scheduling.actions import schedule_name
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
    schedule: str
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


def _broadcast(name: str, value: Any, shape: tuple[int, ...], accepted: str) -> np.ndarray:
    array = _numeric(name, value)
    if array.ndim != 0 and array.shape != shape:
        raise ValueError(
            f"{name} must be a scalar or have shape {accepted} = {shape}, got shape {array.shape}"
        )
    return np.ascontiguousarray(np.broadcast_to(array, shape))


def simulate_pipeline(
    forward_s: Any,
    backward_s: Any,
    *,
    schedule: str = "1f1b",
    link_latency_s: Any = 0.0,
    activation_bytes: Any = None,
    link_bandwidth_bytes_per_s: Any = math.inf,
    allreduce_s: Any = 0.0,
    record_events: bool = True,
) -> SimulationResult:
    """Simulate one training step of pipelines.

    Args:
        forward_s: forward seconds per (stage, microbatch), shape (S, m), or per (replica,
            stage, microbatch), shape (R, S, m), for R data-parallel replicas.
        backward_s: backward seconds, the same shape as ``forward_s``.
        schedule: "1f1b" (non-interleaved, Megatron-LM style) or "gpipe"; the order of
            each stage is :func:`dflop.scheduling.pipeline_actions`.
        link_latency_s: point-to-point latency of link l (stage l -> l+1): a scalar or
            shape (S-1,).
        activation_bytes: bytes of microbatch k's activation over link l (the gradient back
            is as large): None (nothing is sent; transfers take only the latency), a scalar,
            shape (S-1, m), or (R, S-1, m).
        link_bandwidth_bytes_per_s: bandwidth of each link, a scalar or shape (S-1,); > 0,
            ``inf`` means free transfers.
        allreduce_s: gradient all-reduce seconds of each stage after its last backward: a
            scalar or shape (S,). All zeros means no all-reduce (no all-reduce events).
        record_events: False leaves ``events`` empty (faster when only times matter).

    Returns:
        A :class:`SimulationResult`; its per-stage arrays are (R, S) (R = 1 for 2-D input).

    Raises:
        TypeError: non-numeric arrays or a non-str schedule.
        ValueError: wrong shapes, or negative, NaN or infinite times and sizes, naming
            the argument (and the first offending index).
    """
    name = schedule_name(schedule)
    fwd = _numeric("forward_s", forward_s)
    if fwd.ndim == 2:
        fwd = fwd[np.newaxis]
    if fwd.ndim != 3:
        raise ValueError(f"forward_s must have shape (S, m) or (R, S, m), got shape {fwd.shape}")
    num_replicas, num_stages, num_microbatches = fwd.shape
    for dim, size in zip(("R", "S", "m"), fwd.shape):
        if size < 1:
            raise ValueError(f"forward_s must have {dim} >= 1, got shape {fwd.shape}")
    bwd = _numeric("backward_s", backward_s)
    if bwd.ndim == 2:
        bwd = bwd[np.newaxis]
    if bwd.shape != fwd.shape:
        raise ValueError(
            f"backward_s must have the shape of forward_s {np.shape(forward_s)}, "
            f"got {np.shape(backward_s)}"
        )
    num_links = num_stages - 1
    latency = _broadcast("link_latency_s", link_latency_s, (num_links,), "(S-1,)")
    bandwidth = _broadcast(
        "link_bandwidth_bytes_per_s", link_bandwidth_bytes_per_s, (num_links,), "(S-1,)"
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
                "activation_bytes must be a scalar or have shape (S-1, m) or (R, S-1, m) = "
                f"{target}, got shape {np.shape(activation_bytes)}"
            )
        sizes = np.ascontiguousarray(np.broadcast_to(sizes, target))
    allreduce = _broadcast("allreduce_s", allreduce_s, (num_stages,), "(S,)")
    raw = _core.simulate_pipeline(
        np.ascontiguousarray(fwd),
        np.ascontiguousarray(bwd),
        name,
        latency,
        bandwidth,
        sizes,
        None if np.all(allreduce == 0.0) else allreduce,
        bool(record_events),
    )
    if not (np.isfinite(raw["step_time_s"]) and np.isfinite(raw["busy_s"]).all()):
        raise ValueError(
            "the simulated times overflow float64 (inputs too large: their sums over the "
            "pipeline are not finite); give times in seconds of a real step"
        )
    columns = raw["events"]
    events = np.empty(columns["start_s"].shape[0], dtype=EVENT_DTYPE)
    events["kind"] = np.asarray(EVENT_KINDS)[columns["kind"].astype(np.intp)]
    for field in ("replica", "stage", "microbatch", "peer_stage", "start_s", "end_s"):
        events[field] = columns[field]
    return SimulationResult(
        step_time_s=float(raw["step_time_s"]),
        busy_s=_frozen(raw["busy_s"]),
        idle_s=_frozen(raw["idle_s"]),
        compute_end_s=_frozen(raw["compute_end_s"]),
        events=_frozen(events),
        schedule=name,
        num_replicas=num_replicas,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
    )
