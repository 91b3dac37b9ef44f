"""Per-step global batches as shapes, identical on every rank.

Step ``k``'s global batch is drawn from the data source with the seed ``(seed, k)``, so
every rank draws the same batch with no communication, and a resumed run sees the same
batches as an uninterrupted one. The shapes are then mapped onto the (small) model by a
:class:`~dflop.runtime.synthetic_batch.ShapeScaler`, and the tensors are synthesised from
them (:class:`~dflop.runtime.synthetic_batch.SyntheticBatch`): a LLaVA-style dataset is
read for its shapes (image sizes, text lengths), not decoded.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from dflop.data.shapes import SampleShapes
from dflop.models.config import ModelConfig
from dflop.runtime.synthetic_batch import ShapeScaler

__all__ = ["ScaledShapes", "StepShapes", "load_distribution"]

_DATASET_SUFFIXES = (".jsonl", ".yaml", ".yml")


def load_distribution(data: str, family: str = "llava-ov", progress: bool = False) -> Any:
    """The shape source of ``data``: None for ``"synthetic"``, else a ShapeDistribution
    (a saved one, or a LLaVA-style dataset profiled now)."""
    if data == "synthetic":
        return None
    from dflop.data import ShapeDistribution, profile_dataset

    if data.endswith(_DATASET_SUFFIXES):
        return profile_dataset(data, family=family, progress=progress)
    if data.endswith(".parquet"):
        return ShapeDistribution.load(data)
    # A .json is either a saved ShapeDistribution or a LLaVA-style dataset (a list).
    try:
        return ShapeDistribution.load(data)
    except (ValueError, KeyError, TypeError):
        return profile_dataset(data, family=family, progress=progress)


class StepShapes:
    """``shapes(step)``: the scaled global batch of ``step`` (same on every rank)."""

    def __init__(
        self,
        model: ModelConfig,
        global_batch: int,
        *,
        seed: int = 0,
        distribution: Any = None,
        family: str = "llava-ov",
        mix: dict[str, float] | None = None,
        scaler: dict[str, Any] | None = None,
    ) -> None:
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self.distribution = distribution
        self.family = family
        self.mix = mix
        self.scaler = ShapeScaler.for_model(model, **(scaler or {}))

    def raw(self, step: int) -> SampleShapes:
        """The unscaled shapes of ``step``'s batch."""
        seed = _step_seed(self.seed, step)
        if self.distribution is None:
            from dflop.data.synthetic import synthetic_shapes

            return synthetic_shapes(self.global_batch, seed=seed, family=self.family, mix=self.mix)
        return self.distribution.sample(self.global_batch, seed=seed)

    def shapes(self, step: int) -> SampleShapes:
        """``step``'s global batch, conformed to the model."""
        return self.scaler.scale(self.raw(step))


class ScaledShapes:
    """A shape distribution as the trained model sees it (``.sample(n, seed)``): what the
    planner should sample when planning for the scaled-down model."""

    def __init__(self, step_shapes: StepShapes) -> None:
        self.step_shapes = step_shapes

    def sample(self, num_samples: int, seed: int = 0) -> SampleShapes:
        s = self.step_shapes
        if s.distribution is None:
            from dflop.data.synthetic import synthetic_shapes

            raw = synthetic_shapes(num_samples, seed=seed, family=s.family, mix=s.mix)
        else:
            raw = s.distribution.sample(num_samples, seed=seed)
        return s.scaler.scale(raw)


def _step_seed(seed: int, step: int) -> int:
    # A distinct, reproducible stream per (seed, step).
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


def data_description(data: str) -> str:
    return "embedded synthetic mix" if data == "synthetic" else os.path.basename(data)
