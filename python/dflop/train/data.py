"""Per-step global batches as shapes, identical on every rank.

Step ``k``'s global batch is drawn from the data source with the seed ``(seed, k)``, so
every rank draws the same batch with no communication, and a resumed run sees the same
batches as an uninterrupted one. The shapes are then mapped onto the (small) model by a
:class:`~dflop.runtime.synthetic_batch.ShapeScaler`. The tensors come from the dataset's
own files for a LLaVA-style dataset (:class:`~dflop.runtime.dataset_batch.DatasetBatch`:
each rank decodes only its samples' pixels or tokenises only its samples' text), and are
synthesised from the shapes for the embedded mix or a saved shape distribution
(:class:`~dflop.runtime.synthetic_batch.SyntheticBatch`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from dflop.data.shapes import SampleShapes
from dflop.models.config import ModelConfig
from dflop.runtime.synthetic_batch import ShapeScaler

__all__ = ["ScaledShapes", "StepShapes", "describe_records", "load_distribution"]

_DATASET_SUFFIXES = (".jsonl", ".yaml", ".yml")


def load_distribution(
    data: str,
    family: str = "llava-ov",
    progress: bool = False,
    *,
    image_folder: str | None = None,
    video_folder: str | None = None,
) -> Any:
    """The sample source of ``data``: None for ``"synthetic"``, a ShapeDistribution for a
    saved one, or a :class:`~dflop.runtime.dataset_batch.RecordSet` (records + their
    profile) for a LLaVA-style dataset (image / video paths relative to the folders)."""
    if data == "synthetic":
        return None
    from dflop.data import ShapeDistribution
    from dflop.runtime.dataset_batch import read_records

    def records() -> Any:
        return read_records(
            data, family=family, image_folder=image_folder, video_folder=video_folder
        )

    if data.endswith(_DATASET_SUFFIXES):
        return records()
    if data.endswith(".parquet"):
        return ShapeDistribution.load(data)
    # A .json is either a saved ShapeDistribution or a LLaVA-style dataset (a list).
    try:
        return ShapeDistribution.load(data)
    except (ValueError, KeyError, TypeError):
        return records()


def describe_records(records: Any) -> tuple[str, bool]:
    """A one-paragraph account of what a dataset gave (read, usable, skipped by reason
    with an example) and whether too little of it is usable to train on as meant (more
    than half skipped, or no visual sample left)."""
    dist = records.distribution
    usable = len(dist.samples)
    skipped = sum(dist.skipped.values())
    visual = int((dist.samples.encoder_units > 0).sum()) if usable else 0
    lines = [
        f"dataset {dist.source}: read {dist.num_read}, usable {usable} "
        f"({visual} with images or video), skipped {skipped}"
    ]
    for reason, count in sorted(dist.skipped.items(), key=lambda kv: -kv[1]):
        example = next((e for e in dist.skipped_examples if e["reason"] == reason), None)
        lines.append(f"  {reason}: {count}" + (f" (e.g. {example['message']})" if example else ""))
    if any(r in dist.skipped for r in ("missing_image", "missing_video")):
        lines.append(
            "  image and video paths are relative to --image-folder / --video-folder "
            "(default: the dataset file's folder)"
        )
    return "\n".join(lines), skipped > usable or (usable > 0 and visual == 0)


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
        from dflop.runtime.dataset_batch import RecordSet

        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self.records = distribution if isinstance(distribution, RecordSet) else None
        if self.records is not None:
            distribution = self.records.distribution
        self.distribution = distribution
        self.family = family
        self.mix = mix
        settings = dict(scaler or {})
        if {"unit_divisor", "text_divisor"} <= settings.keys():
            self.scaler = ShapeScaler.for_model(model, **settings)
        else:  # fit what is not given to the data, keeping its relative sizes
            self.scaler = ShapeScaler.fitted(model, self._reference(), **settings)

    def _reference(self) -> SampleShapes:
        """The data the scaler is fitted to: the dataset's samples, or 4,096 draws."""
        if self.records is not None:
            return self.records.distribution.samples
        if self.distribution is None:
            from dflop.data.synthetic import synthetic_shapes

            return synthetic_shapes(4096, seed=self.seed, family=self.family, mix=self.mix)
        return self.distribution.sample(4096, seed=self.seed)

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

    def batch(self, step: int, model: ModelConfig, data_seed: int) -> Any:
        """``step``'s batch source (its ``.shapes`` equal ``shapes(step)``): the dataset's
        records, or tensors synthesised from the shapes."""
        if self.records is None:
            from dflop.runtime.synthetic_batch import SyntheticBatch

            return SyntheticBatch(self.shapes(step), model, seed=data_seed)
        from dflop.runtime.dataset_batch import DatasetBatch

        records = self.records.draw(self.global_batch, seed=_step_seed(self.seed, step))
        return DatasetBatch(records, model, self.scaler, family=self.family)


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
