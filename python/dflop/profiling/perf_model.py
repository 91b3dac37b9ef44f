"""Performance model: measured cost coefficients of the encoder and the LLM.

The model is deliberately small and physical:

* encoder time of a microbatch  = ``per_unit_s * units + constant_s``
* LLM time of a microbatch      = ``per_token_s * tokens + per_token_sq_s * sum(seq_len^2)
  + per_target_token_s * targets + constant_s`` (the quadratic term is attention; ``tokens
  = sum(seq_len)``; the LM head and the loss run on the ``targets`` only, so they have a
  term of their own)
* peak memory of a microbatch   = ``per_item_bytes * items + constant_bytes`` (items are
  units for the encoder, tokens for the LLM)

Per-sample costs are additive (``CostModel.costs``); the constants are per microbatch and
kept separately. Coefficients are fitted by non-negative least squares on *relative*
errors (every measurement counts the same, whatever its size) with numpy only.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Union

import numpy as np

from dflop.errors import InputTypeError

__all__ = [
    "EncoderTimeCoefficients",
    "FitReport",
    "LLMTimeCoefficients",
    "MemoryCoefficients",
    "PerformanceModel",
    "fit_encoder_time",
    "fit_llm_time",
    "fit_memory",
    "nonnegative_least_squares",
]

FORMAT_NAME = "dflop.performance_model"
FORMAT_VERSION = 2
"""2: the LLM's head term ``per_target_token_s``. A version-1 file (profiled with the head
on every token) loads with that term 0: its ``per_token_s`` holds the head, and
``metadata["head_per_token"]`` says so; profile the model again to separate them."""

PathLike = Union[str, "os.PathLike[str]"]


MAX_COEFFICIENT = {"s": 1e6, "bytes": 2.0**60}
"""The largest coefficient a performance model may hold, by unit: a million seconds (per
unit, token or microbatch: far beyond any model on any device) and an exbibyte. A larger
one is a damaged or hand-edited file, refused by name before it prices anything."""


def _check_nonnegative_finite(owner: str, name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}.{name} must be finite and >= 0, got {value!r}")
    unit = "bytes" if name.endswith("_bytes") else "s"
    if value > MAX_COEFFICIENT[unit]:
        raise ValueError(
            f"{owner}.{name}={value!r} is more than {MAX_COEFFICIENT[unit]:g} {unit}: not a "
            "measured cost (a damaged or hand-edited performance model)"
        )
    return value


FROZEN_SHARE_FIELDS = (
    "forward_fraction",
    "passthrough_backward_factor",
    "passthrough_activation_fraction",
)
"""The ``PerformanceModel`` fields of frozen parts' costs: ``(encoder, llm)`` shares."""


def _share_pair(name: str, value: Any) -> tuple[float, float] | None:
    """``value`` as an ``(encoder, llm)`` pair of floats in [0, 1] (None stays None)."""
    if value is None:
        return None
    what = f"PerformanceModel.{name} must be None or an (encoder, llm) pair of numbers in [0, 1]"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (Sequence, np.ndarray)):
        raise ValueError(f"{what}, got {value!r}")
    if len(value) != 2:
        raise ValueError(f"{what}, got {len(value)} values: {value!r}")
    pair = []
    for v in value:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number)):
            raise ValueError(f"{what}, got {value!r}")
        v = float(v)
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            raise ValueError(f"{what}, got {value!r}")
        pair.append(v)
    return pair[0], pair[1]


@dataclass(frozen=True)
class EncoderTimeCoefficients:
    """Encoder (+ projector) forward+backward time: ``per_unit_s * units + constant_s``."""

    per_unit_s: float
    constant_s: float

    def __post_init__(self) -> None:
        for name in ("per_unit_s", "constant_s"):
            object.__setattr__(
                self,
                name,
                _check_nonnegative_finite("EncoderTimeCoefficients", name, getattr(self, name)),
            )

    def as_array(self) -> np.ndarray:
        return np.array([self.per_unit_s, self.constant_s], dtype=np.float64)


@dataclass(frozen=True)
class LLMTimeCoefficients:
    """LLM forward+backward time: ``per_token_s*tokens + per_token_sq_s*sum(seq^2) +
    per_target_token_s*targets + constant_s`` (the last-but-one: the LM head and loss, on
    the target tokens)."""

    per_token_s: float
    per_token_sq_s: float
    constant_s: float
    per_target_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_token_s", "per_token_sq_s", "constant_s", "per_target_token_s"):
            object.__setattr__(
                self,
                name,
                _check_nonnegative_finite("LLMTimeCoefficients", name, getattr(self, name)),
            )

    def as_array(self) -> np.ndarray:
        """``[per_token_s, per_token_sq_s, per_target_token_s, constant_s]`` (the order of
        the fit's features)."""
        return np.array(
            [self.per_token_s, self.per_token_sq_s, self.per_target_token_s, self.constant_s],
            dtype=np.float64,
        )

    @staticmethod
    def from_array(values: Any) -> LLMTimeCoefficients:
        """The inverse of :meth:`as_array`."""
        a, b, h, c = (float(v) for v in values)
        return LLMTimeCoefficients(
            per_token_s=a, per_token_sq_s=b, constant_s=c, per_target_token_s=h
        )


@dataclass(frozen=True)
class MemoryCoefficients:
    """Peak memory of one forward+backward: ``per_item_bytes * items + constant_bytes``.

    Items are visual units for the encoder and tokens for the LLM. The constant holds the
    weights and their gradients; optimizer state is *not* included.
    """

    per_item_bytes: float
    constant_bytes: float

    def __post_init__(self) -> None:
        for name in ("per_item_bytes", "constant_bytes"):
            object.__setattr__(
                self,
                name,
                _check_nonnegative_finite("MemoryCoefficients", name, getattr(self, name)),
            )

    def predict_bytes(self, num_items: Any) -> np.ndarray:
        return self.per_item_bytes * np.asarray(num_items, dtype=np.float64) + self.constant_bytes


@dataclass(frozen=True)
class FitReport:
    """Quality of a fit, on the fitting points and on held-out points.

    Errors are relative: ``|predicted - measured| / measured``. ``nan`` when there were no
    held-out points.
    """

    num_fit_points: int
    num_holdout_points: int
    fit_median_abs_rel_error: float
    holdout_median_abs_rel_error: float
    holdout_max_abs_rel_error: float

    @staticmethod
    def empty() -> FitReport:
        return FitReport(0, 0, math.nan, math.nan, math.nan)


def _abs_rel_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    measured = np.asarray(measured, dtype=np.float64)
    return np.abs(np.asarray(predicted, dtype=np.float64) - measured) / np.maximum(
        np.abs(measured), 1e-300
    )


def _median_or_nan(values: np.ndarray) -> float:
    return float(np.median(values)) if len(values) else math.nan


def _max_or_nan(values: np.ndarray) -> float:
    return float(np.max(values)) if len(values) else math.nan


# --------------------------------------------------------------------------------------
# Non-negative least squares / non-negative quadratic minimisation (numpy only)
# --------------------------------------------------------------------------------------


def _nonnegative_quadratic_min(hessian: np.ndarray, linear: np.ndarray) -> np.ndarray:
    """argmin_{u >= 0} 0.5 u^T H u - c^T u for a small symmetric PSD ``H``.

    Exact for the few (<= 8) coefficients of a performance model: the optimum is the
    unconstrained minimiser on its own support, so we try every support and keep the best
    feasible candidate. Deterministic, no iteration tolerances.
    """
    num = hessian.shape[0]
    if num > 8:
        raise ValueError(f"at most 8 coefficients are supported, got {num}")
    best = np.zeros(num)
    best_value = 0.0
    for size in range(1, num + 1):
        for support in itertools.combinations(range(num), size):
            idx = np.array(support)
            sub_h = hessian[np.ix_(idx, idx)]
            sub_c = linear[idx]
            sub_u, *_ = np.linalg.lstsq(sub_h, sub_c, rcond=None)
            if np.any(sub_u < 0) or not np.all(np.isfinite(sub_u)):
                continue
            value = 0.5 * float(sub_u @ sub_h @ sub_u) - float(sub_c @ sub_u)
            if value < best_value - 1e-15 * max(1.0, abs(best_value)):
                best_value = value
                best = np.zeros(num)
                best[idx] = sub_u
    return best


def nonnegative_least_squares(
    features: np.ndarray, targets: np.ndarray, weights: np.ndarray | None = None
) -> np.ndarray:
    """Coefficients ``x >= 0`` minimising ``sum_i w_i (features_i . x - targets_i)^2``.

    Args:
        features: (num_points, num_coefficients) float array, num_coefficients <= 8.
        targets: (num_points,) float array.
        weights: optional (num_points,) non-negative weights (default 1).
    """
    features = np.asarray(features, dtype=np.float64)
    targets = np.asarray(targets, dtype=np.float64)
    if features.ndim != 2:
        raise ValueError(f"features must be 2-D (points, coefficients), got {features.shape}")
    if targets.shape != (features.shape[0],):
        raise ValueError(f"targets must have shape ({features.shape[0]},), got {targets.shape}")
    if not (np.all(np.isfinite(features)) and np.all(np.isfinite(targets))):
        raise ValueError("features and targets must be finite")
    if weights is None:
        weights = np.ones(len(targets))
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != targets.shape or np.any(weights < 0) or not np.all(np.isfinite(weights)):
        raise ValueError("weights must be finite, >= 0 and have one entry per target")
    # Column scaling for conditioning (tokens ~1e3, sum(seq^2) ~1e7).
    scale = np.sqrt(np.sum(weights[:, None] * features**2, axis=0))
    scale[scale == 0] = 1.0
    scaled = features / scale
    hessian = scaled.T @ (weights[:, None] * scaled)
    linear = scaled.T @ (weights * targets)
    return _nonnegative_quadratic_min(hessian, linear) / scale


def _relative_nnls(features: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """NNLS on relative errors: weight 1/target^2 so every point counts the same."""
    targets = np.asarray(targets, dtype=np.float64)
    if np.any(targets <= 0):
        raise ValueError("measured values must be > 0 to fit relative errors")
    return nonnegative_least_squares(features, targets, weights=1.0 / targets**2)


def _encoder_features(num_units: np.ndarray) -> np.ndarray:
    num_units = np.asarray(num_units, dtype=np.float64)
    return np.stack([num_units, np.ones_like(num_units)], axis=1)


def _llm_features(
    num_tokens: np.ndarray, sum_seq_sq: np.ndarray, num_targets: np.ndarray
) -> np.ndarray:
    num_tokens = np.asarray(num_tokens, dtype=np.float64)
    sum_seq_sq = np.asarray(sum_seq_sq, dtype=np.float64)
    num_targets = np.asarray(num_targets, dtype=np.float64)
    return np.stack([num_tokens, sum_seq_sq, num_targets, np.ones_like(num_tokens)], axis=1)


def _split_holdout(
    num_points: int, holdout_fraction: float, min_fit_points: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    if not 0.0 <= holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction!r}")
    num_holdout = int(math.floor(holdout_fraction * num_points))
    num_holdout = max(0, min(num_holdout, num_points - min_fit_points))
    order = np.random.default_rng(seed).permutation(num_points)
    return np.sort(order[num_holdout:]), np.sort(order[:num_holdout])


def _fit_with_holdout(
    features: np.ndarray, targets: np.ndarray, holdout_fraction: float, seed: int, what: str
) -> tuple[np.ndarray, FitReport]:
    num_points, num_coefficients = features.shape
    if num_points < num_coefficients:
        raise ValueError(
            f"{what}: need at least {num_coefficients} measurements to fit, got {num_points}"
        )
    min_fit_points = min(num_points, num_coefficients + 1)
    fit_idx, holdout_idx = _split_holdout(num_points, holdout_fraction, min_fit_points, seed)
    coefficients = _relative_nnls(features[fit_idx], targets[fit_idx])
    fit_err = _abs_rel_errors(features[fit_idx] @ coefficients, targets[fit_idx])
    hold_err = _abs_rel_errors(features[holdout_idx] @ coefficients, targets[holdout_idx])
    report = FitReport(
        num_fit_points=len(fit_idx),
        num_holdout_points=len(holdout_idx),
        fit_median_abs_rel_error=_median_or_nan(fit_err),
        holdout_median_abs_rel_error=_median_or_nan(hold_err),
        holdout_max_abs_rel_error=_max_or_nan(hold_err),
    )
    return coefficients, report


def _as_1d(name: str, values: Any) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        bad = int(np.flatnonzero(~np.isfinite(array) | (array < 0))[0])
        raise ValueError(f"{name}[{bad}] must be finite and >= 0, got {array[bad]!r}")
    return array


def _check_same_length(**arrays: np.ndarray) -> None:
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"arrays must have the same length, got {lengths}")


def fit_encoder_time(
    num_units: Any, time_s: Any, *, holdout_fraction: float = 0.0, seed: int = 0
) -> tuple[EncoderTimeCoefficients, FitReport]:
    """Fit ``time_s ~ per_unit_s * num_units + constant_s`` (non-negative, relative error)."""
    num_units = _as_1d("num_units", num_units)
    time_s = _as_1d("time_s", time_s)
    _check_same_length(num_units=num_units, time_s=time_s)
    coef, report = _fit_with_holdout(
        _encoder_features(num_units), time_s, holdout_fraction, seed, "encoder time"
    )
    return EncoderTimeCoefficients(per_unit_s=coef[0], constant_s=coef[1]), report


def fit_llm_time(
    num_tokens: Any,
    sum_seq_sq: Any,
    time_s: Any,
    *,
    num_targets: Any = None,
    holdout_fraction: float = 0.0,
    seed: int = 0,
) -> tuple[LLMTimeCoefficients, FitReport]:
    """Fit ``time_s ~ per_token_s*num_tokens + per_token_sq_s*sum_seq_sq +
    per_target_token_s*num_targets + constant_s`` (``num_targets`` None: every token is a
    target, and the head's cost cannot be told from the body's: it stays in
    ``per_token_s``)."""
    num_tokens = _as_1d("num_tokens", num_tokens)
    sum_seq_sq = _as_1d("sum_seq_sq", sum_seq_sq)
    time_s = _as_1d("time_s", time_s)
    separate = num_targets is not None
    targets = _as_1d("num_targets", num_targets) if separate else np.zeros_like(num_tokens)
    _check_same_length(
        num_tokens=num_tokens, sum_seq_sq=sum_seq_sq, num_targets=targets, time_s=time_s
    )
    features = _llm_features(num_tokens, sum_seq_sq, targets)
    if not separate:
        features = features[:, [0, 1, 3]]
    coef, report = _fit_with_holdout(features, time_s, holdout_fraction, seed, "LLM time")
    if not separate:
        coef = np.array([coef[0], coef[1], 0.0, coef[2]])
    return LLMTimeCoefficients.from_array(coef), report


def fit_memory(num_items: Any, peak_bytes: Any) -> MemoryCoefficients:
    """Fit ``peak_bytes ~ per_item_bytes * num_items + constant_bytes`` (non-negative)."""
    num_items = _as_1d("num_items", num_items)
    peak_bytes = _as_1d("peak_bytes", peak_bytes)
    _check_same_length(num_items=num_items, peak_bytes=peak_bytes)
    if len(num_items) == 0:
        return MemoryCoefficients(0.0, 0.0)
    coef = nonnegative_least_squares(_encoder_features(num_items), peak_bytes)
    return MemoryCoefficients(per_item_bytes=coef[0], constant_bytes=coef[1])


# --------------------------------------------------------------------------------------
# PerformanceModel
# --------------------------------------------------------------------------------------


def default_metadata() -> dict[str, Any]:
    """Metadata every saved model carries (dflop version, date); profilers add hardware."""
    try:
        from dflop import __version__ as dflop_version
    except Exception:  # pragma: no cover - partial installs
        dflop_version = "unknown"
    return {
        "dflop_version": dflop_version,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@dataclass(frozen=True)
class PerformanceModel:
    """Fitted time and memory coefficients of one (encoder, LLM) pair on one hardware.

    Attributes:
        encoder: encoder (+ projector) forward+backward time per microbatch.
        llm: LLM forward+backward time per microbatch.
        encoder_memory: peak memory vs number of visual units in a microbatch.
        llm_memory: peak memory vs number of tokens in a microbatch.
        tensor_parallel_size: tp degree the coefficients were measured at.
        tokens_per_unit: encoder tokens per visual unit the encoder was profiled with
            (0 if unknown).
        encoder_per_token: the encoder's units differ in size (a patch-sequence encoder,
            Qwen-VL): its time is per ``tokens_per_unit`` encoder tokens, so a sample's
            encoder cost counts ``encoder_units x its tokens_per_unit / tokens_per_unit``
            profiled units (the attention within a unit, quadratic in its size, is
            taken as linear).
        encoder_fit, llm_fit: fit quality (held-out error).
        metadata: free-form JSON-able description: hardware (device name, CPU/GPU),
            torch version, dtype, model configs, dflop version, date, ...
        forward_fraction: ``(encoder, llm)``: the forward pass's share of the module's
            forward+backward time (``t_forward / t_full``, the forward run under
            ``torch.no_grad()``): what a frozen stage with nothing trained before it
            costs, relative to ``encoder`` / ``llm``.
        passthrough_backward_factor: ``(encoder, llm)``: the backward of a *pass-through*
            stage (every parameter frozen, its input requiring grad: a frozen layer with
            a trained part before it) over a training stage's backward, ``(t_passthrough -
            t_forward) / (t_full - t_forward)``, clipped to [0, 1]. So a pass-through
            stage costs ``forward_fraction + (1 - forward_fraction) *
            passthrough_backward_factor`` of ``encoder`` / ``llm``.
        passthrough_activation_fraction: ``(encoder, llm)``: the bytes autograd saves
            for the backward of a pass-through stage over those of a training stage
            (a frozen linear layer keeps its weight, not its input), clipped to [0, 1].

        The three are medians over the profiled shapes of the per-shape ratios (see
        :func:`~dflop.profiling.fit_performance_model`); ``None`` where not measured: a
        profile without the frozen variants (older files), a profile of one module only,
        the activation share of a profile without memory, the analytic model.
    """

    encoder: EncoderTimeCoefficients
    llm: LLMTimeCoefficients
    encoder_memory: MemoryCoefficients = field(default_factory=lambda: MemoryCoefficients(0, 0))
    llm_memory: MemoryCoefficients = field(default_factory=lambda: MemoryCoefficients(0, 0))
    tensor_parallel_size: int = 1
    tokens_per_unit: int = 0
    encoder_per_token: bool = False
    encoder_fit: FitReport = field(default_factory=FitReport.empty)
    llm_fit: FitReport = field(default_factory=FitReport.empty)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    forward_fraction: tuple[float, float] | None = None
    passthrough_backward_factor: tuple[float, float] | None = None
    passthrough_activation_fraction: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        checks = (
            ("encoder", EncoderTimeCoefficients),
            ("llm", LLMTimeCoefficients),
            ("encoder_memory", MemoryCoefficients),
            ("llm_memory", MemoryCoefficients),
            ("encoder_fit", FitReport),
            ("llm_fit", FitReport),
        )
        for name, kind in checks:
            if not isinstance(getattr(self, name), kind):
                raise InputTypeError(
                    f"PerformanceModel.{name} must be a {kind.__name__}, "
                    f"got {type(getattr(self, name)).__name__}"
                )
        if int(self.tensor_parallel_size) < 1:
            raise ValueError(
                f"PerformanceModel.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if int(self.tokens_per_unit) < 0:
            raise ValueError(
                f"PerformanceModel.tokens_per_unit must be >= 0, got {self.tokens_per_unit}"
            )
        if self.encoder_per_token and int(self.tokens_per_unit) < 1:
            raise ValueError(
                "PerformanceModel.encoder_per_token needs the profiled tokens_per_unit (>= 1)"
            )
        for name in FROZEN_SHARE_FIELDS:
            object.__setattr__(self, name, _share_pair(name, getattr(self, name)))

    def encoder_unit_equivalents(self, shapes: Any) -> np.ndarray:
        """(N,) float64: the profiled units each sample's encoder work equals: its units,
        or with ``encoder_per_token`` its encoder tokens over the profiled unit's."""
        units = np.asarray(shapes.encoder_units, dtype=np.float64)
        if not self.encoder_per_token:
            return units
        tokens = units * np.asarray(shapes.tokens_per_unit, dtype=np.float64)
        return tokens / float(self.tokens_per_unit)

    # -- predictions (microbatch level) ------------------------------------------------

    def encoder_time_s(self, num_units: Any) -> np.ndarray:
        """Encoder time of microbatches with ``num_units`` units (0 units -> 0 s)."""
        units = np.asarray(num_units, dtype=np.float64)
        time = self.encoder.per_unit_s * units + self.encoder.constant_s
        return np.where(units > 0, time, 0.0)

    def llm_time_s(self, num_tokens: Any, sum_seq_sq: Any, num_targets: Any) -> np.ndarray:
        """LLM time of microbatches with ``num_tokens`` tokens, ``sum(seq^2) = sum_seq_sq``
        and ``num_targets`` target tokens."""
        tokens = np.asarray(num_tokens, dtype=np.float64)
        sq = np.asarray(sum_seq_sq, dtype=np.float64)
        targets = np.asarray(num_targets, dtype=np.float64)
        c = self.llm
        time = (
            c.per_token_s * tokens
            + c.per_token_sq_s * sq
            + c.per_target_token_s * targets
            + c.constant_s
        )
        return np.where(tokens > 0, time, 0.0)

    def encoder_peak_bytes(self, num_units: Any) -> np.ndarray:
        return self.encoder_memory.predict_bytes(num_units)

    def llm_peak_bytes(self, num_tokens: Any) -> np.ndarray:
        return self.llm_memory.predict_bytes(num_tokens)

    def with_time_coefficients(
        self, encoder: EncoderTimeCoefficients, llm: LLMTimeCoefficients
    ) -> PerformanceModel:
        """A copy with other time coefficients (e.g. after adaptive correction)."""
        return replace(self, encoder=encoder, llm=llm, metadata=dict(self.metadata))

    # -- persistence --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        def report(r: FitReport) -> dict[str, Any]:
            return {
                k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(r).items()
            }

        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "encoder": asdict(self.encoder),
            "llm": asdict(self.llm),
            "encoder_memory": asdict(self.encoder_memory),
            "llm_memory": asdict(self.llm_memory),
            "tensor_parallel_size": int(self.tensor_parallel_size),
            "tokens_per_unit": int(self.tokens_per_unit),
            "encoder_per_token": bool(self.encoder_per_token),
            "encoder_fit": report(self.encoder_fit),
            "llm_fit": report(self.llm_fit),
            "metadata": _jsonable(dict(self.metadata)),
            **{
                name: None if getattr(self, name) is None else list(getattr(self, name))
                for name in FROZEN_SHARE_FIELDS
            },
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> PerformanceModel:
        if data.get("format") != FORMAT_NAME:
            raise ValueError(
                f"not a dflop performance model: field 'format' is {data.get('format')!r}, "
                f"expected {FORMAT_NAME!r}"
            )
        version = data.get("format_version")
        if version not in (1, FORMAT_VERSION):
            raise ValueError(
                f"unsupported field 'format_version' {version!r} (this dflop reads 1 to "
                f"{FORMAT_VERSION})"
            )

        def section(name: str, kind: Any) -> Any:
            if name not in data:
                raise ValueError(f"performance model JSON lacks field {name!r}")
            try:
                return kind(**data[name])
            except TypeError as err:
                raise ValueError(f"performance model field {name!r} is malformed: {err}") from None

        def report(name: str) -> FitReport:
            raw = dict(data.get(name) or {})
            if not raw:
                return FitReport.empty()
            raw = {k: (math.nan if v is None else v) for k, v in raw.items()}
            try:
                return FitReport(**raw)
            except TypeError as err:
                raise ValueError(f"performance model field {name!r} is malformed: {err}") from None

        metadata = dict(data.get("metadata") or {})
        if version == 1:  # the head was profiled on every token: it is in per_token_s
            metadata["head_per_token"] = True
        return PerformanceModel(
            encoder=section("encoder", EncoderTimeCoefficients),
            llm=section("llm", LLMTimeCoefficients),
            encoder_memory=section("encoder_memory", MemoryCoefficients),
            llm_memory=section("llm_memory", MemoryCoefficients),
            tensor_parallel_size=int(data.get("tensor_parallel_size", 1)),
            tokens_per_unit=int(data.get("tokens_per_unit", 0)),
            encoder_per_token=bool(data.get("encoder_per_token", False)),
            encoder_fit=report("encoder_fit"),
            llm_fit=report("llm_fit"),
            metadata=metadata,
            # absent from files written before they were measured: None
            **{name: data.get(name) for name in FROZEN_SHARE_FIELDS},
        )

    def save(self, path: PathLike) -> None:
        """Write the model as JSON (atomically: a temporary file, then rename)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)

    @staticmethod
    def load(path: PathLike) -> PerformanceModel:
        from dflop.safe_io import JSONTooDeepError, load_json, open_regular

        path = os.fspath(path)
        try:  # a named pipe is refused before it is opened (it would block forever)
            with open_regular(path, "r", "performance model file") as f:
                data = load_json(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"performance model file not found: {path}") from None
        except (json.JSONDecodeError, JSONTooDeepError) as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object")
        try:
            return PerformanceModel.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    def summary(self) -> str:
        """A few human-readable lines."""

        def pct(x: float) -> str:
            return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"

        hw = self.metadata.get("device_name", self.metadata.get("device", "?"))
        return "\n".join(
            [
                f"PerformanceModel on {hw} (tp={self.tensor_parallel_size}, "
                f"dtype={self.metadata.get('dtype', '?')})",
                f"  encoder: {self.encoder.per_unit_s * 1e3:.4g} ms/unit + "
                f"{self.encoder.constant_s * 1e3:.4g} ms  (held-out median err "
                f"{pct(self.encoder_fit.holdout_median_abs_rel_error)}, "
                f"n_fit={self.encoder_fit.num_fit_points}, "
                f"n_holdout={self.encoder_fit.num_holdout_points})",
                f"  llm:     {self.llm.per_token_s * 1e6:.4g} us/token + "
                f"{self.llm.per_token_sq_s * 1e9:.4g} ns/token^2 + "
                f"{self.llm.per_target_token_s * 1e6:.4g} us/target (head) + "
                f"{self.llm.constant_s * 1e3:.4g} ms  (held-out median err "
                f"{pct(self.llm_fit.holdout_median_abs_rel_error)}, "
                f"n_fit={self.llm_fit.num_fit_points}, "
                f"n_holdout={self.llm_fit.num_holdout_points})",
                f"  memory:  encoder {self._memory_text('encoder')}; llm "
                f"{self._memory_text('llm')}",
            ]
            + self._frozen_text()
            + (
                [
                    "  note: a version-1 profile, the LM head timed on every token (in us/token): "
                    "profile the model again to price it on the target tokens"
                ]
                if self.metadata.get("head_per_token")
                else []
            )
        )

    def _frozen_text(self) -> list[str]:
        """The summary's line of the frozen parts' measured shares (none if unmeasured)."""

        def pair(value: tuple[float, float] | None, fmt: str) -> str:
            return "n/a" if value is None else " / ".join(format(v, fmt) for v in value)

        if all(getattr(self, name) is None for name in FROZEN_SHARE_FIELDS):
            return []
        return [
            f"  frozen:  forward {pair(self.forward_fraction, '.0%')} of forward+backward; "
            f"pass-through backward {pair(self.passthrough_backward_factor, '.2f')} of a "
            f"full one, activations {pair(self.passthrough_activation_fraction, '.0%')} "
            "(encoder / llm)"
        ]

    def _memory_text(self, module: str) -> str:
        """A module's memory coefficients, or "not measured" (e.g. a quick CPU profile)."""
        measured = self.metadata.get("memory_measured", {})
        coefficients = self.encoder_memory if module == "encoder" else self.llm_memory
        if not measured.get(module, True) or (
            coefficients.per_item_bytes == 0 and coefficients.constant_bytes == 0
        ):
            return "not measured"
        if module == "encoder":
            return (
                f"{coefficients.per_item_bytes / 2**20:.4g} MiB/unit + "
                f"{coefficients.constant_bytes / 2**20:.4g} MiB"
            )
        return (
            f"{coefficients.per_item_bytes / 2**10:.4g} KiB/token + "
            f"{coefficients.constant_bytes / 2**20:.4g} MiB"
        )


def _jsonable(value: Any) -> Any:
    """Best-effort conversion of metadata to JSON types."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, float) and math.isnan(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def sum_seq_sq(seq_lens: Sequence[int]) -> int:
    """sum(seq_len^2) of a packed microbatch (the attention feature)."""
    return int(sum(int(s) * int(s) for s in seq_lens))
