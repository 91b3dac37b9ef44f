"""The demo's verdict: paired step times and one picture of both schedules.

Every demo step runs twice on the same weights and batch (dflop's schedule, then the
data-blind one), so the honest comparison is per step: the ratio of the two times, its
median and spread over the measured steps, and how often dflop was faster. The figure
shows the step whose ratio is the median (a representative one, not the best) with both
schedules on one time axis, rows named by module and stage, and every measured step's two
times beside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PairedSteps", "paired_steps", "write_demo_png"]


@dataclass(frozen=True)
class PairedSteps:
    """The measured steps (after the warm-up) of both schedules, paired by step."""

    steps: np.ndarray  # step indices
    dflop_s: np.ndarray
    blind_s: np.ndarray

    @property
    def ratios(self) -> np.ndarray:
        """dflop's step time over data-blind's, per step (< 1: dflop faster)."""
        return self.dflop_s / self.blind_s

    @property
    def representative(self) -> int:
        """The step whose ratio is the median one (the lower middle of an even count)."""
        order = np.argsort(self.ratios, kind="stable")
        return int(self.steps[order[(len(order) - 1) // 2]])

    def headline(self) -> str:
        r = self.ratios
        q1, median, q3 = np.percentile(r, [25, 50, 75])
        faster = int(np.sum(r < 1.0))
        return (
            f"dflop vs data-blind over {len(r)} paired steps (same weights and batch): step "
            f"time median {median:.2f}x (middle half {q1:.2f}x-{q3:.2f}x, range "
            f"{r.min():.2f}x-{r.max():.2f}x); dflop faster in {faster} of {len(r)} steps"
        )


def paired_steps(metrics: list[Any], warmup: int) -> PairedSteps:
    """The steps both schedules ran, after the first ``warmup`` (one-time costs)."""
    times: dict[str, dict[int, float]] = {"dflop": {}, "blind": {}}
    for m in metrics:
        if m.mode in times:
            times[m.mode][m.step] = m.step_time_s
    steps = sorted(set(times["dflop"]) & set(times["blind"]))
    steps = steps[warmup:] if len(steps) > warmup else steps
    if not steps:
        raise ValueError("no step ran with both schedules")
    return PairedSteps(
        np.array(steps),
        np.array([times["dflop"][s] for s in steps]),
        np.array([times["blind"][s] for s in steps]),
    )


def _step_events(
    events: np.ndarray, metrics: list[Any], mode: str, step: int, trace_steps: int
) -> np.ndarray:
    """The events of ``step`` from a mode's timeline of its last ``trace_steps`` steps
    laid end to end (as :meth:`dflop.train.metrics.StepLog.timelines` lays them)."""
    offset_s = 0.0
    for m in [m for m in metrics if m.mode == mode][-trace_steps:]:
        if m.step == step:
            inside = (events["start_s"] >= offset_s) & (
                events["start_s"] < offset_s + m.step_time_s
            )
            out = events[inside].copy()
            out["start_s"] -= offset_s
            out["end_s"] -= offset_s
            return out
        offset_s += m.step_time_s
    raise ValueError(f"step {step} of the {mode} schedule is not in its timeline")


def _row_names(encoder_stages: int, colocated: bool) -> Any:
    def name(replica: int, stage: int) -> str:
        if stage < encoder_stages:
            return f"encoder stage {stage} · replica {replica}"
        if colocated and stage == 0:
            return f"encoder + LLM stage 0 · replica {replica}"
        return f"LLM stage {stage - encoder_stages} · replica {replica}"

    return name


def write_demo_png(
    report: Any,
    paired: PairedSteps,
    path: str | os.PathLike[str],
    encoder_stages: int,
    trace_steps: int,
    colocated: bool = False,
) -> int:
    """One PNG: the representative step under both schedules on a shared time axis, and
    every measured step's two times (``report.timelines``: the last ``trace_steps``
    steps). Returns the step shown. ``encoder_stages``: the layout's own encoder stages
    (0 when ``colocated``: the first LLM stage runs the encoder)."""
    from dflop.timeline import _COLORS, _OTHER_COLOR, _require_matplotlib, make_events

    Figure, FigureCanvasAgg, Patch = _require_matplotlib()
    step = paired.representative
    shown = {
        mode: _step_events(
            make_events(report.timelines[mode]), report.metrics, mode, step, trace_steps
        )
        for mode in ("dflop", "blind")
    }
    name = _row_names(encoder_stages, colocated)
    rows = sorted({(int(e["replica"]), int(e["stage"])) for ev in shown.values() for e in ev})
    rows.sort(key=lambda rs: (rs[1], rs[0]))
    end_s = max(float(ev["end_s"].max()) for ev in shown.values() if ev.size)
    fig = Figure(figsize=(13.0, 3.2 + 0.9 * len(rows)))
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(3, 2, width_ratios=(3.2, 1.0), height_ratios=(1, 1, 0.08))
    gantt = [fig.add_subplot(grid[0, 0])]
    gantt.append(fig.add_subplot(grid[1, 0], sharex=gantt[0]))
    titles = {"dflop": "dflop's schedule", "blind": "data-blind (equal-count microbatches)"}
    for ax, mode in zip(gantt, ("dflop", "blind")):
        events = shown[mode]
        step_s = float(events["end_s"].max()) if events.size else 0.0
        for e in events:
            y = rows.index((int(e["replica"]), int(e["stage"])))
            start, width = float(e["start_s"]), float(e["end_s"] - e["start_s"])
            color = _COLORS.get(str(e["kind"]), _OTHER_COLOR)
            ax.broken_barh([(start, width)], (y - 0.35, 0.7), facecolors=color,
                           edgecolor="white", linewidth=0.6)  # fmt: skip
            if width > 0.02 * end_s:  # a label where it fits
                label = (
                    f"mb {int(e['microbatch'])}"
                    if width > 0.045 * end_s
                    else str(int(e["microbatch"]))
                )
                ax.text(start + width / 2, y, label, ha="center", va="center", fontsize=7,
                        color="white")  # fmt: skip
        ax.axvline(step_s, color="black", linestyle="--", linewidth=1)
        ax.text(step_s, -0.7, f" {step_s:.3f} s", fontsize=8, va="bottom")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([name(r, s) for r, s in rows], fontsize=8)
        ax.set_ylim(len(rows) - 0.4, -0.9)
        ax.set_title(f"{titles[mode]}: step {step + 1}", fontsize=10, loc="left")
    gantt[1].set_xlabel(
        "time since the step's start (s); mb k: microbatch k (a microbatch without images has "
        "no encoder work, so it is missing from the encoder's rows)"
    )
    gantt[0].set_xlim(0, end_s * 1.08)
    gantt[0].legend(
        handles=[Patch(color=_COLORS["fwd"], label="forward"),
                 Patch(color=_COLORS["bwd"], label="backward")],
        loc="upper right", fontsize=8,
    )  # fmt: skip
    bars = fig.add_subplot(grid[0:2, 1])
    x = np.arange(len(paired.steps))
    bars.bar(x - 0.2, paired.dflop_s, 0.4, label="dflop", color="#4C72B0")
    bars.bar(x + 0.2, paired.blind_s, 0.4, label="data-blind", color="#C44E52")
    at = int(np.flatnonzero(paired.steps == step)[0])
    bars.annotate("shown", (at, max(paired.dflop_s[at], paired.blind_s[at])),
                  ha="center", va="bottom", fontsize=7)  # fmt: skip
    every = max(1, -(-len(x) // 10))
    bars.set_xticks(x[::every])
    bars.set_xticklabels([str(s + 1) for s in paired.steps[::every]], fontsize=7)
    bars.set_xlabel("step")
    bars.set_ylabel("step time (s)")
    bars.set_title("every measured step, both schedules", fontsize=10, loc="left")
    bars.legend(fontsize=8)
    fig.suptitle(paired.headline(), fontsize=9)
    fig.tight_layout()
    from dflop.output import write_file

    write_file(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    return step
