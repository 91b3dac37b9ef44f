"""Training: ``dflop train`` and its building blocks.

- :class:`TrainConfig` (:mod:`dflop.train.config`): every setting, validated.
- :class:`Trainer` (:mod:`dflop.train.trainer`): one rank's loop (schedule in the loop,
  pipelined step, AdamW, adaptive cost model, metrics, checkpoints).
- :func:`run_training` (:mod:`dflop.train.run`): prepare, launch (local processes or
  torchrun), write the measured timelines.

Imports torch only when a trainer or a run starts.
"""

from __future__ import annotations

from typing import Any

from dflop.train.config import SCHEDULE_MODES, TrainConfig

__all__ = [
    "SCHEDULE_MODES",
    "TrainConfig",
    "TrainReport",
    "Trainer",
    "print_summary",
    "run_training",
]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from dflop.train import trainer

        return trainer.Trainer
    if name == "TrainReport":
        from dflop.train import metrics

        return metrics.TrainReport
    if name in ("run_training", "print_summary"):
        from dflop.train import run

        return getattr(run, name)
    raise AttributeError(f"module 'dflop.train' has no attribute {name!r}")
