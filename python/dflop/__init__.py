"""dflop: data-driven planning and per-step scheduling for multimodal LLM training."""

from dflop._deprecated import install_module_aliases
from dflop.scheduling.balance import (
    InfeasibleError,
    Schedule,
    data_blind_schedule,
    schedule,
    schedule_from_assignment,
)
from dflop.scheduling.pipeline_schedule import PipelineModel, pipeline_schedule

__version__ = "0.1.0"

install_module_aliases()

__all__ = [
    "InfeasibleError",
    "PipelineModel",
    "Schedule",
    "__version__",
    "data_blind_schedule",
    "pipeline_schedule",
    "schedule",
    "schedule_from_assignment",
]
