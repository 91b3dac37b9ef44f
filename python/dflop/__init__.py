"""dflop: data-driven planning and per-step scheduling for multimodal LLM training."""

from dflop.scheduler import InfeasibleError, Schedule, schedule

__version__ = "0.1.0"

__all__ = ["InfeasibleError", "Schedule", "schedule", "__version__"]
