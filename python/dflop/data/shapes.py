"""Sample shapes: what every planner/scheduler component sees of a sample.

Everything downstream of the data profiler works on shapes, never on pixels. A batch of
shapes is columnar (one numpy array per field) so that 10^6 samples stay cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["TARGET_SHARE_ESTIMATE", "Modality", "SampleShapes", "estimate_target_tokens"]

TARGET_SHARE_ESTIMATE = 0.6
"""Share of a sample's text tokens taken as its target (loss) tokens when a source does
not know them (shapes built without ``target_tokens``, shape profiles written before
dflop counted targets). Measured with the data profiler, the answers hold 68% of the text
tokens of tests/data/llava_mini and 76% of benchmarks/make_llava_bench.py's data (long
answers); short-answer VQA data holds less, so 0.6 sits between. Such shapes say so
(``SampleShapes.targets_estimated``)."""


class Modality:
    """Integer codes of ``SampleShapes.modality``."""

    TEXT = 0
    IMAGE = 1
    MULTI_IMAGE = 2
    VIDEO = 3
    NAMES = ("text", "image", "multi_image", "video")


def estimate_target_tokens(text_tokens: np.ndarray) -> np.ndarray:
    """The documented estimate of target tokens: ``round(TARGET_SHARE_ESTIMATE x text)``
    within ``[1, text - 1]`` (a prompt token and an answer; 0 below 2 text tokens)."""
    text = np.asarray(text_tokens, dtype=np.int64)
    estimate = np.round(TARGET_SHARE_ESTIMATE * text).astype(np.int64)
    return np.clip(estimate, 1, None).clip(max=text - 1).clip(min=0)


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
        target_tokens: the sample's next-token targets (the loss tokens: its answers'
            text and end-of-turn tokens, as the chat template labels them), at most
            ``text_tokens``. The LM head and the loss run on these only. Omitted (None):
            :func:`estimate_target_tokens`, and ``targets_estimated`` is True.

    ``seq_len`` (LLM sequence length) is ``llm_visual_tokens + text_tokens``.
    """

    encoder_units: np.ndarray
    tokens_per_unit: np.ndarray
    llm_visual_tokens: np.ndarray
    text_tokens: np.ndarray
    modality: np.ndarray
    target_tokens: np.ndarray | None = None
    targets_estimated: bool = field(default=False, compare=False)
    """True when ``target_tokens`` is the documented estimate, not a count."""

    def __post_init__(self) -> None:
        n = len(self.encoder_units)
        for name in ("tokens_per_unit", "llm_visual_tokens", "text_tokens", "modality"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"SampleShapes.{name} has length {len(getattr(self, name))}, "
                    f"expected {n} (length of encoder_units)"
                )
        if self.target_tokens is None:
            object.__setattr__(self, "target_tokens", estimate_target_tokens(self.text_tokens))
            object.__setattr__(self, "targets_estimated", True)
            return
        targets = np.asarray(self.target_tokens)
        if len(targets) != n:
            raise ValueError(
                f"SampleShapes.target_tokens has length {len(targets)}, expected {n} "
                "(length of encoder_units)"
            )
        bad = np.flatnonzero((targets < 0) | (targets > np.asarray(self.text_tokens)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"SampleShapes.target_tokens[{i}]={int(targets[i])} must be in [0, "
                f"text_tokens[{i}]={int(self.text_tokens[i])}]"
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
            target_tokens=self.target_tokens[indices],
            targets_estimated=self.targets_estimated,
        )

    @staticmethod
    def empty() -> SampleShapes:
        """No samples."""
        z = np.zeros(0, dtype=np.int64)
        return SampleShapes(
            z, z.copy(), z.copy(), z.copy(), np.zeros(0, dtype=np.int8), target_tokens=z.copy()
        )

    @staticmethod
    def concat(parts: list[SampleShapes]) -> SampleShapes:
        columns = (
            "encoder_units",
            "tokens_per_unit",
            "llm_visual_tokens",
            "text_tokens",
            "modality",
            "target_tokens",
        )
        return SampleShapes(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in columns),
            targets_estimated=any(p.targets_estimated for p in parts),
        )
