"""Timelines of pipeline steps, simulated or measured: Chrome-trace JSON and PNG Gantt charts.

A timeline is a structured numpy array of :data:`EVENT_DTYPE` (one row per event, times in
seconds from the start of the step). :func:`dflop.simulator.simulate_pipeline` returns one;
a measured timeline is built with :func:`make_events` from the runtime's records.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, Union

import numpy as np

__all__ = [
    "COMPUTE_KINDS",
    "EVENT_DTYPE",
    "EVENT_KINDS",
    "as_events",
    "make_events",
    "to_chrome_trace",
    "write_chrome_trace",
    "write_gantt_png",
]

EVENT_KINDS: tuple[str, ...] = ("fwd", "bwd", "send", "allreduce", "bwd_input", "bwd_weight")
"""Kinds the simulator emits, in the order of the native codes 0..5. Measured timelines
may use other kind names; they are drawn as communication."""
COMPUTE_KINDS: frozenset[str] = frozenset({"fwd", "bwd", "bwd_input", "bwd_weight"})

EVENT_DTYPE = np.dtype(
    [
        ("replica", np.int64),
        ("stage", np.int64),
        ("kind", "U16"),
        ("microbatch", np.int64),  # -1 where it does not apply (all-reduce)
        ("peer_stage", np.int64),  # send: the receiving stage; else -1
        ("start_s", np.float64),
        ("end_s", np.float64),
        # The model chunk's virtual stage (interleaved schedules); -1 where unknown.
        ("virtual_stage", np.int64),
    ]
)
_OPTIONAL_FIELDS = ("peer_stage", "virtual_stage")

# Communication of stage s goes on its own track (tid = stage + _COMM_TID_OFFSET) because
# transfers overlap compute, and trace viewers only nest slices that are properly nested.
_COMM_TID_OFFSET = 100_000

_COLORS = {
    "fwd": "#4C72B0",
    "bwd": "#55A868",
    "bwd_input": "#55A868",
    "bwd_weight": "#8172B2",
    "send": "#8C8C8C",
    "allreduce": "#C44E52",
}
_OTHER_COLOR = "#DD8452"

EventsLike = Union[np.ndarray, Iterable[Mapping[str, Any]], Any]


def make_events(records: Iterable[Mapping[str, Any]]) -> np.ndarray:
    """Build a timeline from mappings with keys ``replica``, ``stage``, ``kind``,
    ``microbatch``, ``start_s``, ``end_s`` and optionally ``peer_stage`` and
    ``virtual_stage`` (default -1).

    Raises:
        ValueError: a missing key, an unknown value type, or ``end_s < start_s``, naming the
            record's index.
    """
    rows = []
    for i, rec in enumerate(records):
        try:
            row = (
                int(rec["replica"]),
                int(rec["stage"]),
                str(rec["kind"]),
                int(rec["microbatch"]),
                int(rec.get("peer_stage", -1)),
                float(rec["start_s"]),
                float(rec["end_s"]),
                int(rec.get("virtual_stage", -1)),
            )
        except KeyError as exc:
            raise ValueError(f"records[{i}] lacks key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"records[{i}] has a malformed value: {exc}") from None
        rows.append(row)
    events = np.array(rows, dtype=EVENT_DTYPE)
    _check_events(events)
    return events


def as_events(timeline: EventsLike) -> np.ndarray:
    """Accept a structured array of EVENT_DTYPE, an object with an ``events`` attribute
    (a :class:`dflop.simulator.SimulationResult`), or an iterable of record mappings."""
    if hasattr(timeline, "events") and not isinstance(timeline, np.ndarray):
        timeline = timeline.events
    if isinstance(timeline, np.ndarray):
        if timeline.dtype.names is None:
            raise ValueError("events must be a structured array with EVENT_DTYPE fields")
        missing = [name for name in EVENT_DTYPE.names if name not in timeline.dtype.names]
        if missing and set(missing) <= set(_OPTIONAL_FIELDS):
            out = np.full(timeline.shape, -1, dtype=EVENT_DTYPE).reshape(-1)
            for name in timeline.dtype.names:
                if name in EVENT_DTYPE.names:
                    out[name] = timeline[name].reshape(-1)
            timeline = out
        elif missing:
            raise ValueError(f"events lack fields {missing}")
        events = timeline.reshape(-1).astype(EVENT_DTYPE, copy=False)
        _check_events(events)
        return events
    return make_events(timeline)


def _check_events(events: np.ndarray) -> None:
    for name in ("start_s", "end_s"):
        bad = np.flatnonzero(~np.isfinite(events[name]))
        if bad.size:
            raise ValueError(f"events[{bad[0]}].{name} is not finite: {events[name][bad[0]]}")
    bad = np.flatnonzero(events["end_s"] < events["start_s"])
    if bad.size:
        raise ValueError(
            f"events[{bad[0]}] ends before it starts "
            f"({events['end_s'][bad[0]]} < {events['start_s'][bad[0]]})"
        )


_COMPUTE_LETTERS = {"fwd": "F", "bwd": "B", "bwd_input": "I", "bwd_weight": "W"}


def _event_name(kind: str, microbatch: int, peer_stage: int) -> str:
    if kind in _COMPUTE_LETTERS:
        return f"{_COMPUTE_LETTERS[kind]}{microbatch}"
    if kind == "send":
        return f"send mb{microbatch} -> stage {peer_stage}"
    return kind if microbatch < 0 else f"{kind} mb{microbatch}"


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}


def to_chrome_trace(timeline: EventsLike) -> dict[str, Any]:
    """The timeline as a Chrome-trace (Trace Event Format) object, loadable in Perfetto
    (ui.perfetto.dev) or chrome://tracing: pid = replica, tid = stage for compute, and a
    separate "stage s comm" track for sends and all-reduces. Times are in microseconds."""
    events = as_events(timeline)
    trace: list[dict[str, Any]] = []
    tracks = sorted({(int(e["replica"]), int(e["stage"])) for e in events})
    for replica in sorted({r for r, _ in tracks}):
        trace.append(_meta("process_name", replica, 0, {"name": f"replica {replica}"}))
        trace.append(_meta("process_sort_index", replica, 0, {"sort_index": replica}))
    for replica, stage in tracks:
        for tid, label, order in (
            (stage, f"stage {stage}", 2 * stage),
            (stage + _COMM_TID_OFFSET, f"stage {stage} comm", 2 * stage + 1),
        ):
            trace.append(_meta("thread_name", replica, tid, {"name": label}))
            trace.append(_meta("thread_sort_index", replica, tid, {"sort_index": order}))
    for e in events:
        kind = str(e["kind"])
        stage = int(e["stage"])
        microbatch = int(e["microbatch"])
        peer_stage = int(e["peer_stage"])
        args: dict[str, Any] = {"microbatch": microbatch}
        if peer_stage >= 0:
            args["peer_stage"] = peer_stage
        if int(e["virtual_stage"]) >= 0:
            args["virtual_stage"] = int(e["virtual_stage"])
        trace.append(
            {
                "ph": "X",
                "name": _event_name(kind, microbatch, peer_stage),
                "cat": kind,
                "pid": int(e["replica"]),
                "tid": stage if kind in COMPUTE_KINDS else stage + _COMM_TID_OFFSET,
                "ts": float(e["start_s"]) * 1e6,
                "dur": float(e["end_s"] - e["start_s"]) * 1e6,
                "args": args,
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(timeline: EventsLike, path: str | os.PathLike) -> None:
    """Write :func:`to_chrome_trace` as JSON to ``path`` (whole or not at all: a failure
    raises :class:`~dflop.errors.WriteError` and leaves no partial file)."""
    from dflop.output import write_text

    write_text(path, json.dumps(to_chrome_trace(timeline)))


def _require_matplotlib() -> Any:
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError(
            "writing a PNG timeline needs matplotlib: pip install 'dflop[plot]' "
            "(or pip install matplotlib)"
        ) from exc
    return Figure, FigureCanvasAgg, Patch


def write_gantt_png(
    timeline: EventsLike,
    path: str | os.PathLike,
    *,
    title: str | None = None,
    dpi: int = 120,
) -> None:
    """Draw the timeline as a Gantt chart (one row per replica and stage; forwards,
    backwards and all-reduces as bars, sends as thin bars under them) to a PNG at ``path``.

    Raises:
        ImportError: matplotlib is not installed (the ``plot`` extra).
    """
    Figure, FigureCanvasAgg, Patch = _require_matplotlib()
    events = as_events(timeline)
    rows = sorted({(int(e["replica"]), int(e["stage"])) for e in events})
    row_of = {key: i for i, key in enumerate(rows)}
    end_s = float(events["end_s"].max()) if events.size else 1.0
    span_s = end_s if end_s > 0 else 1.0
    fig = Figure(figsize=(12.0, 1.2 + 0.45 * len(rows)))
    FigureCanvasAgg(fig)  # attaches the Agg canvas; no pyplot global state
    ax = fig.add_subplot(1, 1, 1)
    # One broken_barh per (row, kind): per-event calls are slow on long timelines.
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in events:
        kind = str(e["kind"])
        y = row_of[(int(e["replica"]), int(e["stage"]))]
        start, width = float(e["start_s"]), float(e["end_s"] - e["start_s"])
        bars.setdefault((y, kind), []).append((start, width))
        # Label a bar only when it is wide enough to hold the label.
        if kind in COMPUTE_KINDS and width > 0.02 * span_s:
            ax.text(
                start + width / 2,
                y - 0.05,
                str(int(e["microbatch"])),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                zorder=3,
            )
    for (y, kind), spans in bars.items():
        color = _COLORS.get(kind, _OTHER_COLOR)
        if kind == "send":  # thin, under the row: transfers overlap compute
            ax.broken_barh(spans, (y + 0.3, 0.12), facecolors=color)
        else:
            ax.broken_barh(
                spans, (y - 0.35, 0.6), facecolors=color, edgecolor="white", linewidth=0.5
            )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"r{r} s{s}" for r, s in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, span_s)
    ax.set_xlabel("time (s)")
    present = [k for k in _COLORS if np.any(events["kind"] == k)] if events.size else []
    if present:
        # Outside the axes, so that it never hides bars.
        ax.legend(
            handles=[Patch(color=_COLORS[k], label=k) for k in present],
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            fontsize=7,
        )
    if title:
        ax.set_title(title)
    fig.tight_layout()
    from dflop.output import write_file

    write_file(path, lambda f: fig.savefig(f, dpi=dpi, format="png"))
