"""The LLM side of a packed microbatch: :class:`TextInputs`, what every batch source's
``text_inputs(sample_ids)`` gives and an LLM stage's ``merge_visual`` reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflop.batch.visual import VisualItem

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["IGNORE_INDEX", "TextInputs"]

#: Label value that marks a position with no loss (PyTorch's cross-entropy default).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class TextInputs:
    """The LLM side of a packed microbatch (T positions, n samples)."""

    token_ids: Tensor
    """LongTensor[T]; placeholder ids at visual positions (a synthetic batch's
    :data:`~dflop.runtime.synthetic_batch.IMAGE_TOKEN_ID`)."""
    image_token_mask: Tensor
    """BoolTensor[T]: True at image placeholder positions."""
    labels: Tensor
    """LongTensor[T]: token ids on answers, -100 elsewhere."""
    cu_seqlens: Tensor
    """LongTensor[n + 1]: cumulative sample lengths, 0 .. T."""
    unit_counts: Tensor
    """LongTensor[n]: visual units per sample."""
    visual_items: tuple[tuple[VisualItem, ...], ...] | None = None
    """Per sample, its visual inputs in order, for models whose per-sample visual
    operations need them (``LLMStageModule.merge_visual``); None when the model does not."""
