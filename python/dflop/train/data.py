"""Per-step global batches as shapes, identical on every rank.

Step ``k``'s global batch is drawn from the data source with the seed ``(seed, k)``, so
every rank draws the same batch with no communication, and a resumed run sees the same
batches as an uninterrupted one.

dflop's reference model: the shapes are mapped onto the (small) model by a
:class:`~dflop.runtime.synthetic_batch.ShapeScaler`. The tensors come from the dataset's
own files for a LLaVA-style dataset (:class:`~dflop.runtime.dataset_batch.DatasetBatch`:
each rank decodes only its samples' pixels or tokenises only its samples' text), and are
synthesised from the shapes for the embedded mix or a saved shape distribution
(:class:`~dflop.runtime.synthetic_batch.SyntheticBatch`).

A model with its own shape rules (a Hugging Face model, ``ModelSpec.family`` set) trains
on a dataset's records unscaled, through the model's converter
(``ModelSpec.dataset_inputs()``): every rank tokenises the batch and reads the image
headers (the shapes), and decodes and processes only the pixels it computes
(:class:`~dflop.runtime.processed_batch.ProcessedBatch` of lazy samples).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from dflop.data.length import LengthPolicy
from dflop.data.shapes import SampleShapes
from dflop.models.registry import model_spec
from dflop.models.spec import ModelSpec
from dflop.runtime.synthetic_batch import ShapeScaler

__all__ = [
    "ScaledShapes",
    "StepShapes",
    "describe_records",
    "length_policy",
    "load_distribution",
]

_DATASET_SUFFIXES = (".jsonl", ".yaml", ".yml")
MAX_REDRAWS = 64
"""Redraws for one batch position before the run gives up on a dataset of bad images."""


def length_policy(
    model: ModelSpec | str, max_seq_len: int | None = None, too_long: str = "truncate"
) -> LengthPolicy | None:
    """The length policy (:mod:`dflop.data.length`) of a model with its own shape rules:
    ``max_seq_len`` (default: the model's position limit) and ``too_long``. None for dflop's
    reference model, whose shapes are scaled to fit it (:class:`ShapeScaler`)."""
    spec = model_spec(model)
    if spec.family is None:
        return None
    if max_seq_len is None:
        return LengthPolicy(
            spec.max_seq_len, too_long, "the model's position limit, max_position_embeddings"
        )
    return LengthPolicy(int(max_seq_len), too_long, "TrainConfig.max_seq_len")


def load_distribution(
    data: str,
    family: str = "llava-ov",
    progress: bool = False,
    *,
    image_folder: str | None = None,
    video_folder: str | None = None,
    model: ModelSpec | str | None = None,
    length: LengthPolicy | None = None,
    allow_outside_paths: bool = False,
) -> Any:
    """The sample source of ``data``: None for ``"synthetic"``, a ShapeDistribution for a
    saved one, or a :class:`~dflop.data.reader.RecordSet` (records + their
    profile) for a LLaVA-style dataset (image / video paths relative to the folders).
    A ``model`` with its own shape rules profiles the dataset by them and its text
    converter, under ``length`` (:func:`length_policy`), and needs a dataset. A record
    whose paths are absolute or leave the folders is skipped (``outside_folder``) unless
    ``allow_outside_paths``."""
    spec = None if model is None else model_spec(model)
    own_rules = spec is not None and spec.family is not None
    if own_rules and (data == "synthetic" or not data.endswith((".json", *_DATASET_SUFFIXES))):
        raise ValueError(
            f"TrainConfig.data={data!r}: the model {spec.name} trains on a LLaVA-style "
            "dataset (.json/.jsonl/.yaml with its image files), not on synthetic shapes"
        )
    if data == "synthetic":
        return None
    if os.path.isdir(data):
        raise ValueError(
            f"TrainConfig.data={data!r} is a folder; give a dataset file (.json, .jsonl, "
            ".yaml) or a shapes file, with its images under --image-folder"
        )
    from dflop.data import ShapeDistribution
    from dflop.data.reader import read_records

    def records() -> Any:
        if own_rules:
            return read_records(
                data,
                family=spec.family,
                image_folder=image_folder,
                video_folder=video_folder,
                text_counter=spec.dataset_inputs().text_counter(),
                allow_outside_paths=allow_outside_paths,
            )
        return read_records(
            data,
            family=family,
            image_folder=image_folder,
            video_folder=video_folder,
            allow_outside_paths=allow_outside_paths,
        )

    if own_rules:
        found = records()
        if length is None:
            return found
        return found.limited(length, spec.dataset_inputs().text_counter())

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
    """``shapes(step)``: the global batch of ``step`` as the model sees it (same on every
    rank); ``batch(step)``: its batch source."""

    def __init__(
        self,
        model: ModelSpec | str,
        global_batch: int,
        *,
        seed: int = 0,
        distribution: Any = None,
        family: str = "llava-ov",
        mix: dict[str, float] | None = None,
        scaler: dict[str, Any] | None = None,
        length: LengthPolicy | None = None,
    ) -> None:
        from dflop.data.reader import RecordSet

        self.spec = model_spec(model)
        self.length = length
        """The length policy the records were profiled under: the runtime cuts the
        samples the same way (:func:`~dflop.runtime.processed_batch.truncate_sample`)."""
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self.records = distribution if isinstance(distribution, RecordSet) else None
        if self.records is not None:
            distribution = self.records.distribution
        self.distribution = distribution
        self.family = family
        self.mix = mix
        self.inputs = None
        self.scaler: ShapeScaler | None = None
        self._batches: dict[int, tuple[tuple[int, ...], Any]] = {}
        self.good_records: set[int] = set()
        """Records whose image files decoded (by index into ``records.records``)."""
        self.bad_records: dict[int, str] = {}
        """Records whose image files did not decode, with why: they are never trained on
        (:meth:`record_indices` draws a replacement)."""
        if self.spec.family is not None:  # the model's own rules: records as they are
            if self.records is None:
                raise ValueError(
                    f"the model {self.spec.name} needs a dataset's records "
                    "(load_distribution(..., model=...))"
                )
            if scaler:
                raise ValueError(
                    f"TrainConfig.scaler: the model {self.spec.name} trains on its own "
                    "shapes; a scaler applies to dflop's reference model only"
                )
            self.inputs = self.spec.dataset_inputs()
            return
        config = self.spec.config
        settings = dict(scaler or {})
        if {"unit_divisor", "text_divisor"} <= settings.keys():
            self.scaler = ShapeScaler.for_model(config, **settings)
        else:  # fit what is not given to the data, keeping its relative sizes
            self.scaler = ShapeScaler.fitted(config, self._reference(), **settings)

    def _reference(self) -> SampleShapes:
        """The data the scaler is fitted to: the dataset's samples, or 4,096 draws."""
        if self.records is not None:
            return self.records.distribution.samples
        if self.distribution is None:
            from dflop.data.synthetic import synthetic_shapes

            return synthetic_shapes(4096, seed=self.seed, family=self.family, mix=self.mix)
        return self.distribution.sample(4096, seed=self.seed)

    def raw(self, step: int) -> SampleShapes:
        """The unscaled shapes of ``step``'s batch (as profiled)."""
        seed = _step_seed(self.seed, step)
        if self.distribution is None:
            from dflop.data.synthetic import synthetic_shapes

            return synthetic_shapes(self.global_batch, seed=seed, family=self.family, mix=self.mix)
        if self.records is not None:
            return self.distribution.samples.take(self.record_indices(step))
        return self.distribution.sample(self.global_batch, seed=seed)

    def record_indices(self, step: int) -> np.ndarray:
        """The records of ``step``'s batch (indices into ``records.records``): the seeded
        draw, where a record in :attr:`bad_records` is replaced by the first of its
        position's own seeded redraws that is not. The result depends only on which
        records are bad, not on when that was found, so a resumed run and every rank
        agree."""
        seed = _step_seed(self.seed, step)
        indices = self.records.indices(self.global_batch, seed=seed)
        for position in np.flatnonzero([int(k) in self.bad_records for k in indices]):
            for attempt in range(1, MAX_REDRAWS + 1):
                rng = np.random.default_rng([seed, int(position), attempt])
                candidate = int(rng.integers(0, len(self.records)))
                if candidate not in self.bad_records:
                    indices[position] = candidate
                    break
            else:
                example = next(iter(self.bad_records.values()))
                raise ValueError(
                    f"step {step}: {MAX_REDRAWS} draws in a row for batch sample {position} "
                    f"were records with undecodable images ({len(self.bad_records)} of "
                    f"{len(self.records)} records known bad, e.g. {example}): repair or "
                    "remove them from the dataset"
                )
        return indices

    def unchecked_records(self, step: int) -> list[int]:
        """The records of ``step``'s batch not yet known good or bad, each once."""
        indices = self.record_indices(step)
        return [k for k in dict.fromkeys(int(i) for i in indices) if k not in self.good_records]

    def shapes(self, step: int) -> SampleShapes:
        """``step``'s global batch, conformed to the model (for a model with its own
        rules: the shapes of its batch source, its exact token counts)."""
        if self.scaler is None:
            return self.batch(step, 0).shapes
        return self.scaler.scale(self.raw(step))

    def batch(self, step: int, data_seed: int) -> Any:
        """``step``'s batch source (its ``.shapes`` equal ``shapes(step)``): the dataset's
        records, or tensors synthesised from the shapes."""
        if self.records is None:
            from dflop.runtime.synthetic_batch import SyntheticBatch

            return SyntheticBatch(self.shapes(step), self.spec.config, seed=data_seed)
        indices = self.record_indices(step)
        records = [self.records.records[int(k)] for k in indices]
        if self.inputs is not None:
            return self._processed(step, records, tuple(int(k) for k in indices))
        from dflop.runtime.dataset_batch import DatasetBatch

        return DatasetBatch(records, self.spec.config, self.scaler, family=self.family)

    def _processed(self, step: int, records: list[Any], key: tuple[int, ...]) -> Any:
        """The batch of a model with its own rules, kept from the scheduler's look at a
        step ahead until the step trains (unless a record was replaced since); the batches
        of earlier steps (and the pixels they decoded) are dropped."""
        from dflop.batch.sample import truncate_sample
        from dflop.runtime.processed_batch import ProcessedBatch

        for old in [s for s in self._batches if s < step]:
            del self._batches[old]
        if self._batches.get(step, (None,))[0] != key:
            samples = [
                self.inputs.sample(
                    raw.data,
                    image_folder=raw.image_folder,
                    video_folder=raw.video_folder,
                    where=raw.where,
                    lazy=True,
                )
                for raw in records
            ]
            if self.length is not None:
                samples = [truncate_sample(s, self.length.max_seq_len) for s in samples]
            self._batches[step] = (key, ProcessedBatch(samples, self.spec.tokens_per_unit))
        return self._batches[step][1]


class ScaledShapes:
    """A shape distribution as the trained model sees it (``.sample(n, seed)``): what the
    planner should sample when planning for the scaled-down model."""

    def __init__(self, step_shapes: StepShapes) -> None:
        self.step_shapes = step_shapes

    def sample(self, num_samples: int, seed: int = 0) -> SampleShapes:
        s = self.step_shapes
        if s.scaler is None:  # the model's own rules: the profile as it is
            return s.distribution.sample(num_samples, seed=seed)
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
