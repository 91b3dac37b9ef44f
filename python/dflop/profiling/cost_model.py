"""Per-sample costs for ``dflop.schedule()`` and their online (adaptive) correction.

``CostModel`` wraps a profiled ``PerformanceModel``:

* ``costs(shapes)`` -> (N, 2) float64 seconds per sample: column 0 the encoder
  (``per_unit_s * units``), column 1 the LLM (``per_token_s * seq + per_token_sq_s * seq^2
  + per_target_token_s * targets``; ``head_costs`` is the last term: the LM head and loss,
  on the sample's target tokens).
  Costs are additive within a microbatch; the per-microbatch constants are reported apart
  (``microbatch_constant_s``) because the scheduler sums per-sample costs.
* ``observe(shapes_per_microbatch, measured_times)`` re-fits the time coefficients from
  the runtime's measured per-microbatch stage times.

Adaptive correction, in one paragraph: every observed microbatch gives one linear
equation ``time = features . coefficients`` (encoder features ``[units, 1]``; LLM features
``[tokens, sum(seq^2), targets, 1]``). Equations are weighted by ``1/time^2`` (relative errors), by
a robust weight and by an exponential forgetting factor, and accumulated into sufficient
statistics ``X^T W X`` and ``X^T W y`` (memory O(coefficients^2), whatever the number of
steps). The coefficients solve a ridge problem anchored to the profiled prior, under
non-negativity: ``min sum_i w_i (x_i.theta - y_i)^2 / y_i^2 + prior_strength *
sum_j M_j (theta_j - prior_j)^2`` with ``M_j`` the (weighted) mean of ``(x_ij / y_i)^2``,
so the prior is worth ``prior_strength`` microbatches in every direction. The robust
weight compares each relative residual with a running median/MAD of the recent residuals
(a bounded window): Huber down-weighting beyond ``huber_k`` robust sigmas, rejection
beyond ``reject_k``. Because the window holds residuals of *all* recent observations, a
genuine, persistent change moves the median and is accepted after about
``residual_window / 2`` observations, while a few wild outliers never are.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop.data.shapes import SampleShapes
from dflop.errors import InputTypeError
from dflop.profiling.perf_model import (
    EncoderTimeCoefficients,
    LLMTimeCoefficients,
    PerformanceModel,
    _nonnegative_quadratic_min,
)

__all__ = ["AdaptiveConfig", "CostModel", "ObservationReport"]

ENCODER = 0
"""Column of the encoder in ``costs`` / ``measured_times``."""
LLM = 1
"""Column of the LLM in ``costs`` / ``measured_times``."""


@dataclass(frozen=True)
class AdaptiveConfig:
    """Settings of the online correction.

    Attributes:
        forgetting_factor: per accepted microbatch observation, in (0, 1]; the statistics
            remember about ``1 / (1 - forgetting_factor)`` recent microbatches.
        prior_strength: weight of the profiled prior, in microbatch observations (>= 0).
        huber_k: robust sigmas from the running median beyond which an observation is
            down-weighted (Huber).
        reject_k: robust sigmas beyond which an observation is ignored (>= huber_k).
        residual_window: number of recent relative residuals kept for the running
            median / MAD (>= 8).
        min_relative_sigma: floor of the robust sigma, as a relative error (> 0): the
            timing noise one expects anyway.
        max_coefficient_ratio: a coefficient may not exceed this multiple of its profiled
            value (> 1; coefficients profiled as 0 are only bounded by the prior).
    """

    forgetting_factor: float = 0.95
    prior_strength: float = 0.25
    huber_k: float = 2.5
    reject_k: float = 8.0
    residual_window: int = 32
    min_relative_sigma: float = 0.01
    max_coefficient_ratio: float = 100.0

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"AdaptiveConfig.{name} must be {rule}, got {getattr(self, name)!r}")

        if not 0.0 < self.forgetting_factor <= 1.0:
            raise bad("forgetting_factor", "in (0, 1]")
        if not (math.isfinite(self.prior_strength) and self.prior_strength >= 0):
            raise bad("prior_strength", "finite and >= 0")
        if not (math.isfinite(self.huber_k) and self.huber_k > 0):
            raise bad("huber_k", "finite and > 0")
        if not (self.reject_k >= self.huber_k):
            raise bad("reject_k", f">= huber_k ({self.huber_k})")
        if int(self.residual_window) != self.residual_window or self.residual_window < 8:
            raise bad("residual_window", "an integer >= 8")
        if not (math.isfinite(self.min_relative_sigma) and self.min_relative_sigma > 0):
            raise bad("min_relative_sigma", "finite and > 0")
        if not (self.max_coefficient_ratio > 1):
            raise bad("max_coefficient_ratio", "> 1")


@dataclass(frozen=True)
class ObservationReport:
    """What one ``observe`` call did, per component (index 0 encoder, 1 LLM).

    ``relative_residuals[c]`` are ``(measured - predicted) / predicted`` under the
    coefficients *before* the update (nan where the microbatch had nothing to measure).
    """

    relative_residuals: np.ndarray
    num_accepted: tuple[int, int]
    num_downweighted: tuple[int, int]
    num_rejected: tuple[int, int]


class _OnlineLinearFit:
    """Exponentially weighted, robust, prior-anchored non-negative linear regression;
    the coefficients ``fixed`` stay at their prior."""

    def __init__(
        self, prior: np.ndarray, config: AdaptiveConfig, fixed: tuple[int, ...] = ()
    ) -> None:
        self.prior = np.asarray(prior, dtype=np.float64).copy()
        self.config = config
        self.fixed = list(fixed)
        num = len(self.prior)
        self.xtx = np.zeros((num, num))
        self.xty = np.zeros(num)
        self.total_weight = 0.0
        self.coefficients = self.prior.copy()
        self.residuals: deque[float] = deque(maxlen=int(config.residual_window))
        self.num_observations = 0

    def robust_center_sigma(self) -> tuple[float, float]:
        window = np.fromiter(self.residuals, dtype=np.float64)
        if len(window) == 0:
            return 0.0, self.config.min_relative_sigma
        center = float(np.median(window))
        mad = float(np.median(np.abs(window - center)))
        return center, max(1.4826 * mad, self.config.min_relative_sigma)

    def update(self, features: np.ndarray, measured: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feed rows (features (n, p), measured (n,) > 0); returns (residuals, weights)."""
        # A fixed term is priced by the prior and left out of the equations.
        measured = measured - features[:, self.fixed] @ self.prior[self.fixed]
        features = features.copy()
        features[:, self.fixed] = 0.0
        predicted = features @ self.coefficients
        residuals = (measured - predicted) / np.maximum(predicted, 1e-12 * measured)
        # Push first: a persistent shift must be able to move the centre it is judged by.
        self.residuals.extend(float(r) for r in residuals)
        center, sigma = self.robust_center_sigma()
        distance = np.abs(residuals - center) / sigma
        cfg = self.config
        weights = np.where(distance <= cfg.huber_k, 1.0, cfg.huber_k / np.maximum(distance, 1e-300))
        weights = np.where(distance > cfg.reject_k, 0.0, weights)
        lam = cfg.forgetting_factor
        for row, y, w in zip(features, measured, weights):
            if w <= 0:
                continue
            z = row / y  # relative-error normalisation: each equation reads "z . theta = 1"
            self.xtx = lam * self.xtx + w * np.outer(z, z)
            self.xty = lam * self.xty + w * z
            self.total_weight = lam * self.total_weight + w
            self.num_observations += 1
        if self.total_weight > 0:
            self.coefficients = self._solve()
        return residuals, weights

    def _solve(self) -> np.ndarray:
        cfg = self.config
        mean_sq = np.diag(self.xtx) / self.total_weight
        penalty = cfg.prior_strength * np.maximum(mean_sq, 1e-12 * max(mean_sq.max(), 1e-300))
        hessian = self.xtx + np.diag(penalty)
        linear = self.xty + penalty * self.prior
        # Diagonal scaling for conditioning (features span many orders of magnitude).
        scale = 1.0 / np.sqrt(np.maximum(np.diag(hessian), 1e-300))
        u = _nonnegative_quadratic_min(hessian * np.outer(scale, scale), linear * scale)
        theta = u * scale
        upper = np.where(self.prior > 0, cfg.max_coefficient_ratio * self.prior, np.inf)
        return np.minimum(theta, upper)


def _check_shapes(name: str, shapes: Any) -> SampleShapes:
    if not isinstance(shapes, SampleShapes):
        raise InputTypeError(
            f"{name} must be a dflop.data.shapes.SampleShapes, got {type(shapes).__name__}"
        )
    return shapes


def _microbatch_features(
    shapes: SampleShapes, model: PerformanceModel
) -> tuple[np.ndarray, np.ndarray]:
    """(encoder features [units, 1 if units else 0], LLM features [tokens, sum sq,
    targets, 1 if tokens]); units as the profiled units they equal."""
    units = float(np.sum(model.encoder_unit_equivalents(shapes)))
    seq = np.asarray(shapes.seq_len, dtype=np.float64)
    tokens = float(seq.sum())
    sum_sq = float(np.dot(seq, seq))
    targets = float(np.sum(shapes.target_tokens))
    encoder = np.array([units, 1.0 if units > 0 else 0.0])
    llm = np.array([tokens, sum_sq, targets, 1.0 if tokens > 0 else 0.0])
    return encoder, llm


class CostModel:
    """Per-sample costs for the scheduler, with online correction from measured times.

    Args:
        performance_model: the profiled prior.
        adaptive: settings of ``observe`` (defaults: ``AdaptiveConfig()``).

    Reading (``costs``, ``predict_microbatch``) is safe from another thread while
    ``observe`` runs: coefficients are swapped atomically.
    """

    def __init__(
        self, performance_model: PerformanceModel, adaptive: AdaptiveConfig | None = None
    ) -> None:
        if not isinstance(performance_model, PerformanceModel):
            raise InputTypeError(
                "performance_model must be a PerformanceModel, "
                f"got {type(performance_model).__name__}"
            )
        if adaptive is not None and not isinstance(adaptive, AdaptiveConfig):
            raise InputTypeError(
                f"adaptive must be an AdaptiveConfig, got {type(adaptive).__name__}"
            )
        self._prior = performance_model
        self._config = adaptive or AdaptiveConfig()
        self._lock = threading.Lock()
        self.reset()

    # -- state ------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget all observations; back to the profiled prior."""
        with self._lock:
            self._encoder_fit = _OnlineLinearFit(self._prior.encoder.as_array(), self._config)
            # The head's term is learned only where the profile separated it: a profile with
            # the head on every token has it in per_token_s, a term that moves with it.
            llm = self._prior.llm.as_array()
            head_fixed = (2,) if llm[2] == 0.0 else ()
            self._llm_fit = _OnlineLinearFit(llm, self._config, fixed=head_fixed)
            self._coefficients = (self._prior.encoder.as_array(), self._prior.llm.as_array())

    @property
    def prior(self) -> PerformanceModel:
        """The profiled performance model this cost model started from."""
        return self._prior

    @property
    def adaptive_config(self) -> AdaptiveConfig:
        return self._config

    @property
    def performance_model(self) -> PerformanceModel:
        """The current (corrected) coefficients as a PerformanceModel."""
        enc, llm = self._coefficients
        return self._prior.with_time_coefficients(
            EncoderTimeCoefficients(per_unit_s=enc[0], constant_s=enc[1]),
            LLMTimeCoefficients.from_array(llm),
        )

    @property
    def passthrough_factors(self) -> dict[str, tuple[float, float] | None] | None:
        """The profile's measured costs of frozen parts, ``(encoder, llm)`` pairs, or
        None when the performance model has none (an older profile, the analytic model):

        * ``"forward_fraction"``: the forward's share of a training stage's time (a
          frozen stage with nothing trained before it runs the forward only);
        * ``"backward"``: a pass-through stage's backward (frozen, its input needing
          gradients: a trained part before it) over a training stage's backward;
        * ``"activations"``: the activation bytes a pass-through stage holds over a
          training stage's.

        A key is None where that share was not measured (``"activations"`` of a profile
        without memory). Not corrected online: ``observe`` refits the training times.
        """
        perf = self._prior
        factors = {
            "forward_fraction": perf.forward_fraction,
            "backward": perf.passthrough_backward_factor,
            "activations": perf.passthrough_activation_fraction,
        }
        if all(value is None for value in factors.values()):
            return None
        return factors

    @property
    def num_observations(self) -> tuple[int, int]:
        """Accepted (non-rejected) microbatch observations so far: (encoder, LLM)."""
        return self._encoder_fit.num_observations, self._llm_fit.num_observations

    # -- predictions ------------------------------------------------------------------

    @property
    def microbatch_constant_s(self) -> np.ndarray:
        """(2,) per-microbatch constants (encoder, LLM) not included in ``costs``.

        The encoder constant applies to microbatches with at least one visual unit.
        """
        enc, llm = self._coefficients
        return np.array([enc[1], llm[3]], dtype=np.float64)

    def costs(self, shapes: SampleShapes) -> np.ndarray:
        """(N, 2) float64 seconds per sample: column 0 encoder, column 1 LLM (C-contiguous).

        Encoder: ``per_unit_s * encoder_units``. LLM: ``per_token_s * seq_len +
        per_token_sq_s * seq_len^2 + per_target_token_s * target_tokens``. Per-microbatch
        constants are excluded.
        """
        shapes = _check_shapes("shapes", shapes)
        enc, llm = self._coefficients
        units = self._prior.encoder_unit_equivalents(shapes)
        seq = np.asarray(shapes.seq_len, dtype=np.float64)
        out = np.empty((len(shapes), 2), dtype=np.float64)
        out[:, 0] = enc[0] * units
        out[:, 1] = llm[0] * seq + llm[1] * seq * seq + self._head(llm, shapes)
        return out

    def activation_bytes_per_token_layer(
        self, encoder: Any, llm: Any
    ) -> tuple[float | None, float | None]:
        """The profile's measured memory per token (``PerformanceModel.llm_memory`` per
        token; ``encoder_memory`` per unit, over its ``tokens_per_unit``, less the pixels
        it read, which the planner counts apart) spread over the module's layers, for the
        planner's memory model; None where not measured."""
        perf = self._prior
        measured = perf.metadata.get("memory_measured", {})
        out: list[float | None] = [None, None]
        if measured.get("encoder") and perf.encoder_memory.per_item_bytes > 0:
            tokens = perf.tokens_per_unit or encoder.tokens_per_unit
            held = perf.encoder_memory.per_item_bytes / tokens - encoder.input_bytes_per_token
            out[0] = max(held, 0.0) / encoder.num_layers
        if measured.get("llm") and perf.llm_memory.per_item_bytes > 0:
            out[1] = perf.llm_memory.per_item_bytes / llm.num_layers
        return out[0], out[1]

    def head_costs(self, shapes: SampleShapes) -> np.ndarray:
        """(N,) seconds of ``costs``' LLM column that are the LM head and loss
        (``per_target_token_s * target_tokens``): what runs on the LLM's last stage only."""
        shapes = _check_shapes("shapes", shapes)
        return self._head(self._coefficients[1], shapes)

    @staticmethod
    def _head(llm: np.ndarray, shapes: SampleShapes) -> np.ndarray:
        return llm[2] * np.asarray(shapes.target_tokens, dtype=np.float64)

    def predict_microbatch(self, shapes_in_microbatch: SampleShapes) -> tuple[float, float]:
        """(encoder_s, llm_s) of one microbatch, constants included."""
        shapes = _check_shapes("shapes_in_microbatch", shapes_in_microbatch)
        enc_x, llm_x = _microbatch_features(shapes, self._prior)
        enc, llm = self._coefficients
        return float(enc_x @ enc), float(llm_x @ llm)

    def predict_microbatches(self, shapes_per_microbatch: Sequence[SampleShapes]) -> np.ndarray:
        """(num_microbatches, 2) predicted (encoder_s, llm_s), constants included."""
        out = np.zeros((len(shapes_per_microbatch), 2), dtype=np.float64)
        for i, shapes in enumerate(shapes_per_microbatch):
            out[i] = self.predict_microbatch(_check_shapes(f"shapes_per_microbatch[{i}]", shapes))
        return out

    # -- adaptive correction ----------------------------------------------------------

    def observe(
        self, shapes_per_microbatch: Sequence[SampleShapes], measured_times: Any
    ) -> ObservationReport:
        """Update the coefficients from measured stage times of microbatches.

        Args:
            shapes_per_microbatch: the samples of each measured microbatch.
            measured_times: (num_microbatches, 2) seconds: column 0 the encoder
                forward+backward time of that microbatch, column 1 the LLM's. ``nan``
                marks a time that was not measured (that entry is skipped). Encoder
                times of microbatches without visual units are ignored.

        Returns:
            An ``ObservationReport`` (residuals before the update, accepted/rejected counts).
        """
        if isinstance(shapes_per_microbatch, SampleShapes):
            raise InputTypeError(
                "shapes_per_microbatch must be a sequence of SampleShapes (one per microbatch)"
            )
        shapes_list = [
            _check_shapes(f"shapes_per_microbatch[{i}]", s)
            for i, s in enumerate(shapes_per_microbatch)
        ]
        times = np.asarray(measured_times, dtype=np.float64)
        if times.shape != (len(shapes_list), 2):
            raise ValueError(
                f"measured_times must have shape ({len(shapes_list)}, 2) "
                f"(one row per microbatch: encoder_s, llm_s), got {times.shape}"
            )
        bad = np.argwhere(np.isinf(times) | (times < 0))
        if len(bad):
            i, c = (int(v) for v in bad[0])
            raise ValueError(
                f"measured_times[{i}, {c}] must be a finite time >= 0 (or nan), got {times[i, c]!r}"
            )
        rows = [_microbatch_features(s, self._prior) for s in shapes_list]
        residuals = np.full((len(shapes_list), 2), np.nan)
        counts = {"accepted": [0, 0], "down": [0, 0], "rejected": [0, 0]}
        with self._lock:
            for col, fit in ((ENCODER, self._encoder_fit), (LLM, self._llm_fit)):
                keep = [
                    i
                    for i in range(len(rows))
                    if rows[i][col][-1] > 0 and times[i, col] > 0 and not math.isnan(times[i, col])
                ]
                if not keep:
                    continue
                features = np.stack([rows[i][col] for i in keep])
                res, weights = fit.update(features, times[keep, col])
                residuals[keep, col] = res
                counts["accepted"][col] = int(np.sum(weights >= 1.0))
                counts["down"][col] = int(np.sum((weights > 0) & (weights < 1.0)))
                counts["rejected"][col] = int(np.sum(weights <= 0))
            self._coefficients = (
                self._encoder_fit.coefficients.copy(),
                self._llm_fit.coefficients.copy(),
            )
        return ObservationReport(
            relative_residuals=residuals,
            num_accepted=tuple(counts["accepted"]),  # type: ignore[arg-type]
            num_downweighted=tuple(counts["down"]),  # type: ignore[arg-type]
            num_rejected=tuple(counts["rejected"]),  # type: ignore[arg-type]
        )
