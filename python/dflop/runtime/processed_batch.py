"""A batch source over samples already turned into model inputs (e.g. by a Hugging Face
processor): per sample its visual units' pixels, token ids, labels and visual items.

:class:`ProcessedBatch` gives the pipeline engine what every batch source gives
(``pixel_values`` of an encoder replica's pieces, packed ``text_inputs`` with each sample's
``visual_items``) and the planner the exact shapes (``shapes``, ``target_tokens()``), so a
model with its own visual-token rule (LLaVA-OneVision's unpadding) is planned on the
counts it really has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from dflop.data.shapes import Modality, SampleShapes
from dflop.models.decoder import IGNORE_INDEX
from dflop.models.spec import VisualItem
from dflop.runtime.synthetic_batch import PackedBatchSource

__all__ = ["ProcessedBatch", "ProcessedSample", "truncate_sample"]


@dataclass(frozen=True)
class ProcessedSample:
    """One sample as model inputs.

    Attributes:
        input_ids: LongTensor[T], visual placeholders included.
        labels: LongTensor[T], -100 where there is no loss (placeholders included).
        pixel_values: ``[U, C, H, W]`` (every unit of every item, in item order), or None
            for a text-only sample or one whose pixels ``load`` gives.
        items: the sample's visual items (their units sum to U).
        placeholder_ids: the token ids that mark visual positions.
        load: makes ``pixel_values`` on first use (decoding only what a rank computes).
        files: the image files ``load`` decodes (checked before a step trains).
    """

    input_ids: Tensor
    labels: Tensor
    pixel_values: Tensor | None
    items: tuple[VisualItem, ...]
    placeholder_ids: tuple[int, ...]
    load: Callable[[], Tensor] | None = field(default=None, compare=False, repr=False)
    files: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @property
    def units(self) -> int:
        return sum(item.units for item in self.items)

    def unit_pixel_rows(self) -> list[int]:
        """Rows of ``pixel_values`` per unit: 1 (an image ``[C, H, W]``), or the patches of
        a gridded unit (a patch-sequence encoder's pixels are one row per patch)."""
        return [
            1 if item.grid_thw is None else item.unit_tokens
            for item in self.items
            for _ in range(item.units)
        ]

    def pixels(self) -> Tensor | None:
        """``pixel_values``, loaded now if the sample is lazy."""
        return self.pixel_values if self.load is None else self.load()

    @property
    def placeholder_mask(self) -> Tensor:
        return torch.isin(self.input_ids, torch.tensor(self.placeholder_ids))


def truncate_sample(sample: ProcessedSample, max_seq_len: int) -> ProcessedSample:
    """``sample`` cut to ``max_seq_len`` positions by the length policy
    (:mod:`dflop.data.length`): every visual placeholder stays, and the first ``max_seq_len
    - visual`` text positions in order (with their labels); unchanged when it fits.

    Raises:
        ValueError: its visual tokens alone exceed ``max_seq_len`` (they are never cut).
    """
    length = int(sample.input_ids.numel())
    if length <= max_seq_len:
        return sample
    visual = sample.placeholder_mask
    room = int(max_seq_len) - int(visual.sum())
    if room < 0:
        raise ValueError(
            f"the sample's {int(visual.sum())} visual tokens exceed max_seq_len={max_seq_len}: "
            "visual tokens are never cut"
        )
    keep = visual | (torch.cumsum(~visual, 0) <= room)
    return dataclasses.replace(sample, input_ids=sample.input_ids[keep], labels=sample.labels[keep])


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
