"""Sample shapes: what every planner/scheduler component sees of a sample.

Everything downstream of the data profiler works on shapes, never on pixels. A batch of
shapes is columnar (one numpy array per field) so that 10^6 samples stay cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Modality", "SampleShapes"]


class Modality:
    """Integer codes of ``SampleShapes.modality``."""

    TEXT = 0
    IMAGE = 1
    MULTI_IMAGE = 2
    VIDEO = 3
    NAMES = ("text", "image", "multi_image", "video")


@dataclass(frozen=True)
class SampleShapes:
    """Shapes of N samples (columnar).

    Fields (all (N,) int64 except ``modality``, int8):
        encoder_units: visual units the encoder runs on (image tiles incl. the base image,
            one per image of a multi-image sample, or video frames); 0 for text-only.
        tokens_per_unit: encoder tokens per unit (e.g. 729 for SigLIP at 384 px); 0 for
            text-only.
        llm_visual_tokens: visual tokens the LLM sees after projection/pooling/newlines.
        text_tokens: text tokens of the conversation.
        modality: a ``Modality`` code.

    ``seq_len`` (LLM sequence length) is ``llm_visual_tokens + text_tokens``.
    """

    encoder_units: np.ndarray
    tokens_per_unit: np.ndarray
    llm_visual_tokens: np.ndarray
    text_tokens: np.ndarray
    modality: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.encoder_units)
        for name in ("tokens_per_unit", "llm_visual_tokens", "text_tokens", "modality"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"SampleShapes.{name} has length {len(getattr(self, name))}, "
                    f"expected {n} (length of encoder_units)"
                )

    def __len__(self) -> int:
        return len(self.encoder_units)

    @property
    def seq_len(self) -> np.ndarray:
        return self.llm_visual_tokens + self.text_tokens

    @property
    def encoder_tokens(self) -> np.ndarray:
        return self.encoder_units * self.tokens_per_unit

    def take(self, indices: np.ndarray) -> SampleShapes:
        """The shapes at ``indices`` (any numpy index)."""
        return SampleShapes(
            encoder_units=self.encoder_units[indices],
            tokens_per_unit=self.tokens_per_unit[indices],
            llm_visual_tokens=self.llm_visual_tokens[indices],
            text_tokens=self.text_tokens[indices],
            modality=self.modality[indices],
        )

    @staticmethod
    def empty() -> SampleShapes:
        """No samples."""
        z = np.zeros(0, dtype=np.int64)
        return SampleShapes(z, z.copy(), z.copy(), z.copy(), np.zeros(0, dtype=np.int8))

    @staticmethod
    def concat(parts: list[SampleShapes]) -> SampleShapes:
        return SampleShapes(
            *(
                np.concatenate([getattr(p, f) for p in parts])
                for f in (
                    "encoder_units",
                    "tokens_per_unit",
                    "llm_visual_tokens",
                    "text_tokens",
                    "modality",
                )
            )
        )
