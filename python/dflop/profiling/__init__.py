"""Profiling: measured model costs and the cost model that prices samples with them.

- :class:`PerformanceModel` (``perf_model``): the fitted coefficients of one (encoder,
  LLM) pair on one machine (``profile_model`` + ``fit_performance_model``), saved as
  JSON. Data, not a pricing object.
- :class:`CostModel` (``cost_model``): a :class:`dflop.data.costs.SampleCostModel` (the
  one protocol the scheduler, planner and simulator price samples through) built on a
  PerformanceModel, corrected online from measured microbatches.
- :class:`dflop.data.costs.AnalyticCostModel`: the other SampleCostModel, from FLOP
  counts at an assumed rate (no measurement).
"""

from dflop.profiling.cost_model import AdaptiveConfig, CostModel, ObservationReport
from dflop.profiling.model_profiler import (
    DecoderMeasurement,
    EncoderMeasurement,
    ProfileResult,
    default_seq_len_mixes,
    default_unit_counts,
    fit_performance_model,
    merge_profiles,
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
    "merge_profiles",
    "nonnegative_least_squares",
    "profile_model",
]
