"""Profiling: measured model costs (performance model), per-sample costs for the
scheduler with online correction (cost model), and the data profiler."""

from dflop.profiling.cost_model import AdaptiveConfig, CostModel, ObservationReport
from dflop.profiling.model_profiler import (
    DecoderMeasurement,
    EncoderMeasurement,
    ProfileResult,
    default_seq_len_mixes,
    default_unit_counts,
    fit_performance_model,
    profile_model,
)
from dflop.profiling.perf_model import (
    EncoderTimeCoefficients,
    FitReport,
    LLMTimeCoefficients,
    MemoryCoefficients,
    PerformanceModel,
    fit_encoder_time,
    fit_llm_time,
    fit_memory,
    nonnegative_least_squares,
)

__all__ = [
    # -- model profiler, performance model, cost model ----------------------------------
    "AdaptiveConfig",
    "CostModel",
    "DecoderMeasurement",
    "EncoderMeasurement",
    "EncoderTimeCoefficients",
    "FitReport",
    "LLMTimeCoefficients",
    "MemoryCoefficients",
    "ObservationReport",
    "PerformanceModel",
    "ProfileResult",
    "default_seq_len_mixes",
    "default_unit_counts",
    "fit_encoder_time",
    "fit_llm_time",
    "fit_memory",
    "fit_performance_model",
    "nonnegative_least_squares",
    "profile_model",
]
