"""A batch source over samples already turned into model inputs (e.g. by a Hugging Face
processor): per sample its visual units' pixels, token ids, labels and visual items.

:class:`ProcessedBatch` gives the pipeline engine what every batch source gives
(``pixel_values`` of an encoder replica's pieces, packed ``text_inputs`` with each sample's
``visual_items``) and the planner the exact shapes (``shapes``, ``target_tokens()``), so a
model with its own visual-token rule (LLaVA-OneVision's unpadding) is planned on the
counts it really has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dflop.data.shapes import Modality, SampleShapes
from dflop.models.decoder import IGNORE_INDEX
from dflop.models.spec import VisualItem
from dflop.runtime.synthetic_batch import TextInputs

__all__ = ["ProcessedBatch", "ProcessedSample"]


@dataclass(frozen=True)
class ProcessedSample:
    """One sample as model inputs.

    Attributes:
        input_ids: LongTensor[T], visual placeholders included.
        labels: LongTensor[T], -100 where there is no loss (placeholders included).
        pixel_values: ``[U, C, H, W]`` (every unit of every item, in item order), or None
            for a text-only sample.
        items: the sample's visual items (their units sum to U).
        placeholder_ids: the token ids that mark visual positions.
    """

    input_ids: Tensor
    labels: Tensor
    pixel_values: Tensor | None
    items: tuple[VisualItem, ...]
    placeholder_ids: tuple[int, ...]

    @property
    def units(self) -> int:
        return sum(item.units for item in self.items)

    @property
    def placeholder_mask(self) -> Tensor:
        return torch.isin(self.input_ids, torch.tensor(self.placeholder_ids))


def _modality(items: tuple[VisualItem, ...]) -> int:
    if not items:
        return Modality.TEXT
    if any(item.kind == "video" for item in items):
        return Modality.VIDEO
    return Modality.MULTI_IMAGE if len(items) > 1 else Modality.IMAGE


class ProcessedBatch:
    """The batch source of a list of :class:`ProcessedSample` (sample ids are positions)."""

    def __init__(self, samples: Sequence[ProcessedSample], tokens_per_unit: int) -> None:
        for i, s in enumerate(samples):
            if s.input_ids.dim() != 1 or s.labels.shape != s.input_ids.shape:
                raise ValueError(
                    f"sample {i}: input_ids and labels must be 1-D of one length, got "
                    f"{tuple(s.input_ids.shape)} and {tuple(s.labels.shape)}"
                )
            units = 0 if s.pixel_values is None else int(s.pixel_values.shape[0])
            if units != s.units:
                raise ValueError(f"sample {i}: pixel_values has {units} units, its items {s.units}")
        self.samples = list(samples)
        self.tokens_per_unit = int(tokens_per_unit)
        visual = [int(s.placeholder_mask.sum()) for s in self.samples]
        lengths = [int(s.input_ids.numel()) for s in self.samples]
        units = np.array([s.units for s in self.samples], dtype=np.int64)
        self.shapes = SampleShapes(
            encoder_units=units,
            tokens_per_unit=np.where(units > 0, self.tokens_per_unit, 0).astype(np.int64),
            llm_visual_tokens=np.array(visual, dtype=np.int64),
            text_tokens=np.array(lengths, dtype=np.int64) - np.array(visual, dtype=np.int64),
            modality=np.array([_modality(s.items) for s in self.samples], dtype=np.int8),
        )

    def __len__(self) -> int:
        return len(self.samples)

    def target_tokens(self) -> np.ndarray:
        """(N,) int64: next-token targets of every sample (labels after the first)."""
        return np.array(
            [int((s.labels[1:] != IGNORE_INDEX).sum()) for s in self.samples], dtype=np.int64
        )

    def pixel_values(
        self,
        sample_ids: Sequence[int] | np.ndarray,
        first_unit: Sequence[int] | np.ndarray | None = None,
        num_units: Sequence[int] | np.ndarray | None = None,
    ) -> Tensor:
        """``[U, C, H, W]``: units ``[first_unit[k], first_unit[k] + num_units[k])`` of
        sample ``sample_ids[k]`` (all of them by default), in order."""
        ids = [int(i) for i in sample_ids]
        firsts = [0] * len(ids) if first_unit is None else [int(f) for f in first_unit]
        counts = (
            [self.samples[i].units for i in ids]
            if num_units is None
            else [int(c) for c in num_units]
        )
        parts = []
        for i, first, count in zip(ids, firsts, counts):
            sample = self.samples[i]
            if first < 0 or count < 0 or first + count > sample.units:
                raise ValueError(
                    f"sample {i}: units [{first}, {first + count}) are out of its "
                    f"{sample.units} units"
                )
            if count:
                parts.append(sample.pixel_values[first : first + count])
        if not parts:
            reference = next((s.pixel_values for s in self.samples if s.units), None)
            shape = (0,) if reference is None else (0, *reference.shape[1:])
            return torch.zeros(shape)
        return torch.cat(parts)

    def text_inputs(self, sample_ids: Sequence[int] | np.ndarray) -> TextInputs:
        """The packed LLM inputs of ``sample_ids`` with their visual items."""
        samples = [self.samples[int(i)] for i in sample_ids]
        lengths = [int(s.input_ids.numel()) for s in samples]
        cu = torch.tensor([0, *np.cumsum(lengths, dtype=np.int64).tolist()], dtype=torch.long)
        units = torch.tensor([s.units for s in samples], dtype=torch.long)
        items = tuple(s.items for s in samples)
        if not samples:
            empty = torch.zeros(0, dtype=torch.long)
            return TextInputs(empty, empty.bool(), empty, cu, units, items)
        return TextInputs(
            torch.cat([s.input_ids for s in samples]).long(),
            torch.cat([s.placeholder_mask for s in samples]),
            torch.cat([s.labels for s in samples]).long(),
            cu,
            units,
            items,
        )
