"""One sample already turned into model inputs (e.g. by a Hugging Face processor):
:class:`ProcessedSample`, what a model's record converter makes
(:meth:`dflop.models.spec.ModelSpec.dataset_inputs`) and a
:class:`~dflop.runtime.processed_batch.ProcessedBatch` serves; :func:`truncate_sample`
applies the length policy to one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflop.batch.visual import VisualItem

if TYPE_CHECKING:  # torch is imported where a sample is used: a launcher plans without it
    from torch import Tensor

__all__ = ["ProcessedSample", "truncate_sample"]


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
        import torch

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
    keep = visual | ((~visual).cumsum(0) <= room)
    return dataclasses.replace(sample, input_ids=sample.input_ids[keep], labels=sample.labels[keep])
