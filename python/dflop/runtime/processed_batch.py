"""A batch source over samples already turned into model inputs (e.g. by a Hugging Face
processor): per sample its visual units' pixels, token ids, labels and visual items.

:class:`ProcessedBatch` gives the pipeline engine what every batch source gives
(``pixel_values`` of an encoder replica's pieces, packed ``text_inputs`` with each sample's
``visual_items``) and the planner the exact shapes (``shapes``, ``target_tokens()``), so a
model with its own visual-token rule (LLaVA-OneVision's unpadding) is planned on the
counts it really has. Its samples are :class:`~dflop.batch.sample.ProcessedSample` s
(re-exported here with :func:`~dflop.batch.sample.truncate_sample`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from dflop.batch.sample import ProcessedSample, truncate_sample
from dflop.batch.visual import VisualItem
from dflop.data.shapes import Modality, SampleShapes
from dflop.models.decoder import IGNORE_INDEX
from dflop.runtime.synthetic_batch import PackedBatchSource

__all__ = ["ProcessedBatch", "ProcessedSample", "truncate_sample"]


def _modality(items: tuple[VisualItem, ...]) -> int:
    if not items:
        return Modality.TEXT
    if any(item.kind == "video" for item in items):
        return Modality.VIDEO
    return Modality.MULTI_IMAGE if len(items) > 1 else Modality.IMAGE


class ProcessedBatch(PackedBatchSource):
    """The batch source of a list of :class:`ProcessedSample` (sample ids are positions):
    ``pixel_values`` of an encoder replica's pieces and packed ``text_inputs`` as every
    batch source gives them (:class:`~dflop.runtime.synthetic_batch.PackedBatchSource`),
    with each sample's visual items."""

    def __init__(self, samples: Sequence[ProcessedSample], tokens_per_unit: int | None) -> None:
        for i, s in enumerate(samples):
            if s.input_ids.dim() != 1 or s.labels.shape != s.input_ids.shape:
                raise ValueError(
                    f"sample {i}: input_ids and labels must be 1-D of one length, got "
                    f"{tuple(s.input_ids.shape)} and {tuple(s.labels.shape)}"
                )
            if s.load is None:
                _check_units(i, s.pixel_values, s)
        self.samples = list(samples)
        self._pixels: dict[int, Tensor | None] = {}
        self._pixel_offsets = [np.cumsum([0, *s.unit_pixel_rows()]) for s in self.samples]
        self.tokens_per_unit = None if tokens_per_unit is None else int(tokens_per_unit)
        visual = [int(s.placeholder_mask.sum()) for s in self.samples]
        lengths = [int(s.input_ids.numel()) for s in self.samples]
        units = np.array([s.units for s in self.samples], dtype=np.int64)
        if self.tokens_per_unit is None:  # each unit its own size: the mean per sample
            totals = np.array([sum(t) for t in self.unit_tokens()], dtype=np.int64)
            per_unit = np.round(totals / np.maximum(units, 1)).astype(np.int64)
        else:
            per_unit = np.full(len(units), self.tokens_per_unit, dtype=np.int64)
        self.shapes = SampleShapes(
            encoder_units=units,
            tokens_per_unit=np.where(units > 0, per_unit, 0).astype(np.int64),
            llm_visual_tokens=np.array(visual, dtype=np.int64),
            text_tokens=np.array(lengths, dtype=np.int64) - np.array(visual, dtype=np.int64),
            modality=np.array([_modality(s.items) for s in self.samples], dtype=np.int8),
            target_tokens=self.target_tokens(),
        )

    def __len__(self) -> int:
        return len(self.samples)

    def release_pixels(self) -> None:
        """Drop the samples' decoded pixels (kept so that a sample split into pieces
        decodes once): once a step's pieces are read, the pieces hold copies of them."""
        self._pixels.clear()

    def _sample_pixels(self, i: int) -> Tensor | None:
        if i not in self._pixels:
            sample = self.samples[i]
            pixels = sample.pixels()
            _check_units(i, pixels, sample)
            self._pixels[i] = pixels
        return self._pixels[i]

    def target_tokens(self) -> np.ndarray:
        """(N,) int64: next-token targets of every sample (labels after the first)."""
        return np.array(
            [int((s.labels[1:] != IGNORE_INDEX).sum()) for s in self.samples], dtype=np.int64
        )

    def unit_tokens(self) -> list[list[int]]:
        """Per sample, the encoder tokens of each unit (gridded items: ``h x w``; a model
        with fixed units: ``tokens_per_unit`` each), for ``StepPlan.build``."""
        return [
            [
                self.tokens_per_unit if item.grid_thw is None else item.unit_tokens
                for item in s.items
                for _ in range(item.units)
            ]
            for s in self.samples
        ]

    def unit_grid(
        self,
        sample_ids: Sequence[int] | np.ndarray,
        first_unit: Sequence[int] | np.ndarray,
        num_units: Sequence[int] | np.ndarray,
    ) -> Tensor:
        """``[U, 3]`` long: the (1, h, w) patch grid of each unit of the pieces."""
        rows = []
        for i, first, count in zip(sample_ids, first_unit, num_units):
            grids = [
                (1, *item.grid_thw[1:])
                for item in self.samples[int(i)].items
                for _ in range(item.units)
            ]
            rows += grids[int(first) : int(first) + int(count)]
        return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)

    def _render_units(self, sample_id: int, first: int, count: int) -> Tensor:
        offsets = self._pixel_offsets[sample_id]
        return self._sample_pixels(sample_id)[offsets[first] : offsets[first + count]]

    def _no_pixels(self) -> Tensor:
        return torch.zeros(0)

    def _sample_text(self, sample_id: int) -> tuple[Tensor, Tensor, Tensor]:
        s = self.samples[sample_id]
        return s.input_ids.long(), s.placeholder_mask, s.labels.long()

    def _visual_items(self, sample_ids: list[int]) -> tuple:
        return tuple(self.samples[i].items for i in sample_ids)

    def visual_files(self, sample_id: int) -> list[str]:
        return list(self.samples[sample_id].files)


def _check_units(i: int, pixels: Tensor | None, sample: ProcessedSample) -> None:
    found = 0 if pixels is None else int(pixels.shape[0])
    expected = sum(sample.unit_pixel_rows())
    if found != expected:
        raise ValueError(
            f"sample {i}: pixel_values has {found} rows, its items' {sample.units} units "
            f"need {expected}"
        )
