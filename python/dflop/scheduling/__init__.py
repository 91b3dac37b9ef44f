"""Scheduling: which samples share a microbatch, and in which order stages run them.

- :mod:`~dflop.scheduling.balance`: :func:`schedule` (the per-step balancer of samples
  over microbatches x data-parallel ranks), :class:`Schedule`, the data-blind baseline.
- :mod:`~dflop.scheduling.pipeline_schedule`: :func:`pipeline_schedule`, a schedule refined
  on the simulated encoder -> LLM step (:class:`PipelineModel`).
- :mod:`~dflop.scheduling.async_scheduler`: :class:`AsyncScheduler`, schedules computed
  in a background thread a few steps ahead, with deadlines.
- :mod:`~dflop.scheduling.actions`: :func:`pipeline_program`, the pipeline orders (1F1B,
  GPipe, interleaved 1F1B, registered in the native core) as per-stage lists of
  ``(stage, kind, microbatch)`` actions that the simulator, the planner's memory model and
  the runtime all execute; :func:`pipeline_order_for`, the one choice of a pipeline order;
  :func:`validate_program` for any hand-written one; actions as text (``"F1.3"``,
  :func:`format_action` / :func:`parse_action`) and programs as files
  (:func:`save_program` / :func:`load_program`).

``dflop.schedule``, ``dflop.pipeline_schedule`` and ``dflop.Schedule`` are re-exported at
the package's top level.
"""

from dflop._deprecated import attribute_aliases
from dflop.scheduling.actions import (
    PIPELINE_ORDERS,
    PipelineAction,
    PipelineProgram,
    format_action,
    format_program,
    load_program,
    parse_action,
    parse_program,
    peak_in_flight,
    pipeline_actions,
    pipeline_order_for,
    pipeline_program,
    program_grid,
    save_program,
    validate_program,
)
from dflop.scheduling.async_scheduler import AsyncScheduler
from dflop.scheduling.balance import (
    InfeasibleError,
    Schedule,
    data_blind_schedule,
    schedule,
    schedule_from_assignment,
)
from dflop.scheduling.pipeline_schedule import PipelineModel, pipeline_schedule

__all__ = [
    "PIPELINE_ORDERS",
    "AsyncScheduler",
    "InfeasibleError",
    "PipelineAction",
    "PipelineModel",
    "PipelineProgram",
    "Schedule",
    "data_blind_schedule",
    "format_action",
    "format_program",
    "load_program",
    "parse_action",
    "parse_program",
    "peak_in_flight",
    "pipeline_actions",
    "pipeline_program",
    "pipeline_schedule",
    "program_grid",
    "save_program",
    "pipeline_order_for",
    "schedule",
    "schedule_from_assignment",
    "validate_program",
]

# Renamed (docs/concepts.md › Glossary): "schedule" is a step's sample assignment only.
__getattr__ = attribute_aliases(
    __name__,
    {"SCHEDULES": "PIPELINE_ORDERS", "schedule_for": "pipeline_order_for"},
    lambda new: globals()[new],
)
