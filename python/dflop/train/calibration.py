"""``OnlineCalibration``: rank 0's step model, learned from the steps it measures.

Three things are corrected while a run trains (none in a deterministic run):

- the cost model's coefficients, from every microbatch's measured encoder and LLM time
  (``adaptive``; :func:`~dflop.train.metrics.measured_microbatch_times` documents which
  time belongs to which samples);
- the forward share of each module's action time (smoothed), which the step model splits
  forward and backward by (measured under the run's training regime; the planner's model
  takes it converted to full training, :func:`~dflop.planner.full_training_forward_fraction`);
- the per-transfer link latency: what makes the step model, fed the cost model's action
  times, reproduce the measured step (the median of the last fits).

Only dflop's steps feed it (in compare mode the blind run overlaps its modules less and
its microbatches run faster on shared cores), and never a run's first step (one-time
costs: first kernels, allocations, connections).
"""

from __future__ import annotations

import collections
import math
from typing import Any, Callable

import numpy as np

from dflop.planner import full_training_forward_fraction, regime_forward_fraction
from dflop.train.metrics import RankRecord, measured_microbatch_times

__all__ = ["OnlineCalibration", "fit_link_latency"]


class OnlineCalibration:
    """The forward shares and link latency rank 0's step model uses, and their fits.

    Args:
        forward_fraction: (encoder, LLM) full-training forward shares to start from (a
            plan's); default: the profiler's measured ones (``passthrough``), else one
            third each.
        trainable: the run's training regime (a frozen part runs less backward, so its
            module's measured forward share is larger).
        passthrough: the performance model's measured ``passthrough_factors`` (what a
            frozen layer's backward costs; None: the planner's default).
    """

    def __init__(
        self,
        forward_fraction: tuple[float, float] | None = None,
        trainable: str = "full",
        passthrough: dict[str, Any] | None = None,
    ) -> None:
        self.trainable = trainable
        self.passthrough = passthrough
        measured = (passthrough or {}).get("forward_fraction")
        self._full_training_start = tuple(
            float(f) for f in (forward_fraction or measured or (1.0 / 3.0, 1.0 / 3.0))
        )
        fractions = regime_forward_fraction(self._full_training_start, trainable, passthrough)
        self._start_shares = (float(fractions[0]), float(fractions[1]))
        self.forward_fraction = {"encoder": float(fractions[0]), "llm": float(fractions[1])}
        """(encoder, LLM) forward shares under the run's regime, as its steps measure them."""
        self.link_latency_s = 0.0
        self.calibrated = False
        """Whether ``link_latency_s`` was fitted to a measured step (else the plan's)."""
        self._latency_fits: collections.deque[float] = collections.deque(maxlen=9)
        self._observed_steps: collections.deque[tuple[Any, Any, float]] = collections.deque(
            maxlen=32
        )

    @property
    def shares(self) -> tuple[float, float]:
        """(encoder, LLM) forward shares now, under the run's regime (the runtime
        scheduler's pipeline model splits the stage costs by them)."""
        return self.forward_fraction["encoder"], self.forward_fraction["llm"]

    @property
    def full_training_shares(self) -> tuple[float, float]:
        """:attr:`shares` as the planner's model takes them: the shares of full training
        (a module whose layers run no backward keeps the starting share). Until the steps
        move them, exactly the starting ones (a plan's: the conversion there and back can
        move the last bit, and with it a tie in the schedule search)."""
        if self.shares == self._start_shares:
            return self._full_training_start
        return full_training_forward_fraction(
            self.shares, self.trainable, self._full_training_start, self.passthrough
        )

    def learn(
        self,
        records: list[RankRecord],
        schedule: Any,
        plan: Any,
        shapes: Any,
        audit: Any,
        layout: Any,
        cost_model: Any = None,
    ) -> None:
        """Fold one measured step in: the forward shares, the cost model (when given:
        ``adaptive``) and the link latency (``audit``: the step model's view of the step,
        priced before it ran). A colocated layout's first stage times its encoder's forward
        apart, its backward by the encoder's forward share (which that layout leaves as it
        is: :func:`~dflop.train.metrics.measured_microbatch_times`)."""
        encoder_s, llm_s, fraction = measured_microbatch_times(
            records,
            schedule.num_microbatches,
            layout.encoder.dp,
            schedule.dp_size,
            self.forward_fraction["encoder"],
        )
        for module, value in fraction.items():  # smoothed forward share, for predictions
            self.forward_fraction[module] = 0.8 * self.forward_fraction[module] + 0.2 * value
        if cost_model is not None:
            _observe_microbatches(cost_model, encoder_s, llm_s, schedule, plan, shapes)
        self._fit_latency(records, schedule, audit, shapes)

    def _fit_latency(self, records: list[RankRecord], schedule: Any, audit: Any, shapes: Any):
        """Fit the per-transfer latency that makes the step model, fed the cost model's
        action times (the step's audit), reproduce the measured step: it takes what the
        action times do not explain (per-message costs, Python overhead, the loss
        all-reduce, and the waiting that timing noise adds to a pipeline). The median of
        the last fits: one step slowed by another process on shared cores moves it little;
        later predictions use it."""
        if audit.llm_forward_s.shape[1] + audit.num_encoder_stages < 2:
            return  # one stage: no links
        measured = max(r.step_time_s for r in records)
        self._observed_steps.append((shapes, schedule, measured))
        self._latency_fits.append(fit_link_latency([audit], measured))
        self.link_latency_s = float(np.median(self._latency_fits))
        self.calibrated = True

    def final_link_latency_s(self, audit: Callable[[Any, Any], Any]) -> float | None:
        """The latency that, with the cost model and forward shares as they are now (the
        run's end), makes the mean simulated step of the last observed steps equal their
        mean measured step (``audit(schedule, shapes)``: the step model of a step now): a
        consistent snapshot for planning (``dflop plan --local`` calibrates with it). The
        running estimate pairs each step's latency with the cost model of that step, which
        kept moving."""
        if not self.calibrated or not self._observed_steps:
            return None
        audits = [audit(s, shapes) for shapes, s, _ in self._observed_steps]
        measured = float(np.mean([t for _, _, t in self._observed_steps]))
        return fit_link_latency(audits, measured)


def _observe_microbatches(
    cost_model: Any,
    encoder_s: np.ndarray,
    llm_s: np.ndarray,
    schedule: Any,
    plan: Any,
    shapes: Any,
) -> None:
    """Feed measured times to the cost model: per microbatch, every encoder replica's
    time for the units of its pieces, and every LLM replica's for its bin."""
    rows, times = [], []
    for j, mb in enumerate(plan.microbatches):
        for e, share in enumerate(mb.encoder):
            if share.units:
                rows.append(_pieces_as_shapes(shapes, share))
                times.append((encoder_s[j, e], math.nan))
        for r in range(schedule.dp_size):
            rows.append(shapes.take(schedule.microbatches(r)[j]))
            times.append((math.nan, llm_s[j, r]))
    cost_model.observe(rows, np.array(times))


def _pieces_as_shapes(shapes: Any, share: Any) -> Any:
    """An encoder replica's pieces as samples of their own units (what it computed)."""
    from dataclasses import replace

    part = shapes.take(share.sample_ids)
    units = np.asarray(share.num_units, dtype=part.encoder_units.dtype)
    return replace(part, encoder_units=units, llm_visual_tokens=units * part.tokens_per_unit)


def fit_link_latency(audits: list[Any], measured_s: float) -> float:
    """The per-transfer latency at which the mean simulated step of ``audits`` (the step
    model of each step, :class:`~dflop.planner.StepAudit`) equals ``measured_s``; 0 if the
    action times alone already reach it. Bisection: the simulated step grows with it."""

    def simulated(latency_s: float) -> float:
        return float(
            np.mean(
                [
                    a.simulate(link_latency_s=latency_s, record_events=False).step_time_s
                    for a in audits
                ]
            )
        )

    low, high = 0.0, measured_s
    if simulated(low) >= measured_s:
        return 0.0
    for _ in range(20):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if simulated(mid) < measured_s else (low, mid)
    return 0.5 * (low + high)
