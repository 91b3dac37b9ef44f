"""Real model inputs for a global batch of synthetic sample shapes.

The planner and scheduler see only :class:`~dflop.data.SampleShapes`; training needs
tensors. :class:`SyntheticBatch` renders them deterministically from ``(seed, sample
index)``, one sample at a time, so every rank materialises ONLY the samples it needs
(encoder ranks: pixels of their share; LLM ranks: tokens and labels of theirs) and two
ranks asking for the same sample get the same tensors.

Layout of sample i (``T = units * tokens_per_unit + text_tokens`` positions)::

    [prompt head][image placeholders: units * tokens_per_unit][prompt tail][answer]

The answer is the shape's ``target_tokens``, the prompt the rest of its text, split around
the image. Labels are the token ids on the answer and ``IGNORE_INDEX`` (-100) on the prompt
and the placeholders, so sample i has exactly ``target_tokens`` target tokens (the answer
never starts at position 0, and the loss shifts within the sample): the global target count
is known from shapes alone, with no communication.

Shapes of a real model family (729 tokens per unit, thousands of text tokens) do not fit a
tiny CPU model: :class:`ShapeScaler` maps them onto the model first, keeping their relative
sizes (more units / longer text stay bigger) so scheduling still has something to balance.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dflop.batch.text import IGNORE_INDEX, TextInputs
from dflop.data.shapes import SampleShapes
from dflop.errors import InputTypeError
from dflop.models.config import ModelConfig

if TYPE_CHECKING:  # torch is imported where tensors are made: a launcher plans without it
    from torch import Tensor

__all__ = [
    "IMAGE_TOKEN_ID",
    "PackedBatchSource",
    "SampleLayout",
    "ShapeScaler",
    "SyntheticBatch",
    "TextInputs",
    "check_conformed",
    "sample_layout",
]

#: Token id at image placeholder positions (its embedding is replaced by visual features).
IMAGE_TOKEN_ID = 0

# Streams of the per-sample generators (seeded with (seed, sample index, stream)).
_PIXEL_STREAM, _TOKEN_STREAM = 0, 1


@dataclass(frozen=True)
class ShapeScaler:
    """Maps sample shapes onto a (small) model so that they can be trained on.

    Per sample: ``units = min(ceil(encoder_units / unit_divisor), max_units_per_sample)`` (a
    visual sample keeps at least one unit, a text-only sample none); the LLM sees ``units *
    tokens_per_unit`` visual tokens (the model's own tokens per unit, so placeholders and
    features agree), plus one for the newline row with ``visual_newline``; text tokens become
    ``clip(ceil(text_tokens / text_divisor), min_text_tokens, max_text_tokens)``, and keep
    their targets' share of the text: ``clip(round(scaled text x target_tokens /
    text_tokens), 1, scaled text - 1)`` (0 for a sample without targets).
    ``None`` disables a cap; ``ShapeScaler(tpu, max_units_per_sample=None, unit_divisor=1,
    text_divisor=1, min_text_tokens=2, max_text_tokens=None)`` only conforms the visual
    tokens to the model.
    """

    tokens_per_unit: int
    max_units_per_sample: int | None = 4
    unit_divisor: int = 4
    text_divisor: int = 8
    min_text_tokens: int = 4
    max_text_tokens: int | None = 64
    visual_newline: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "visual_newline":
                ok = isinstance(value, (bool, np.bool_))
            else:
                optional = f.name in ("max_units_per_sample", "max_text_tokens")
                ok = (value is None and optional) or (
                    isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                )
            if not ok:
                raise InputTypeError(
                    f"ShapeScaler.{f.name} must be "
                    + ("a bool" if f.name == "visual_newline" else "an integer")
                    + f", got {type(value).__name__} {value!r}"
                )
        if min(self.tokens_per_unit, self.unit_divisor, self.text_divisor) < 1:
            raise ValueError("ShapeScaler.tokens_per_unit and the divisors must be >= 1")
        if self.max_units_per_sample is not None and self.max_units_per_sample < 1:
            raise ValueError("ShapeScaler.max_units_per_sample must be >= 1 (or None)")
        # Two text tokens at least: one of prompt (so no answer starts a sample) + one answer.
        if self.min_text_tokens < 2:
            raise ValueError("ShapeScaler.min_text_tokens must be >= 2 (a prompt and an answer)")
        if self.max_text_tokens is not None and self.max_text_tokens < self.min_text_tokens:
            raise ValueError("ShapeScaler.max_text_tokens must be >= min_text_tokens")

    @classmethod
    def for_model(cls, config: ModelConfig, **caps: int | None) -> ShapeScaler:
        """A scaler for ``config`` (its tokens per unit and newline); ``caps`` override the
        defaults."""
        return cls(
            config.vision.tokens_per_unit, visual_newline=config.decoder.image_newline, **caps
        )

    @classmethod
    def fitted(
        cls,
        config: ModelConfig,
        shapes: SampleShapes,
        *,
        max_units_per_sample: int | None = 8,
        max_text_tokens: int | None = 256,
        quantile: float = 0.99,
        **fixed: int | None,
    ) -> ShapeScaler:
        """A scaler that keeps the data's relative sizes: divisors chosen so that the
        ``quantile`` of ``shapes``' units and text tokens maps onto the caps (only the
        tail above it is clipped), instead of fixed divisors whose caps would flatten
        most real samples to the same size. ``fixed`` sets any field explicitly (e.g.
        ``unit_divisor=1``)."""
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")

        def divisor(values: np.ndarray, cap: int | None) -> int:
            if cap is None or values.size == 0:
                return 1
            return max(1, math.ceil(float(np.quantile(values, quantile)) / cap))

        units = shapes.encoder_units[shapes.encoder_units > 0].astype(np.float64)
        text = shapes.text_tokens.astype(np.float64)
        fields = {
            "max_units_per_sample": max_units_per_sample,
            "max_text_tokens": max_text_tokens,
            "unit_divisor": divisor(units, max_units_per_sample),
            "text_divisor": divisor(text, max_text_tokens),
        }
        fields.update(fixed)
        return cls.for_model(config, **fields)

    def scale(self, shapes: SampleShapes) -> SampleShapes:
        units = -(-shapes.encoder_units.astype(np.int64) // self.unit_divisor)  # ceil
        if self.max_units_per_sample is not None:
            units = np.minimum(units, self.max_units_per_sample)
        text = -(-shapes.text_tokens.astype(np.int64) // self.text_divisor)  # ceil
        text = np.maximum(text, self.min_text_tokens)
        if self.max_text_tokens is not None:
            text = np.minimum(text, self.max_text_tokens)
        tokens_per_unit = np.where(units > 0, self.tokens_per_unit, 0).astype(np.int64)
        newline = (units > 0).astype(np.int64) if self.visual_newline else 0
        raw_text = np.maximum(shapes.text_tokens.astype(np.float64), 1.0)
        share = shapes.target_tokens.astype(np.float64) / raw_text
        targets = np.clip(np.round(text * share), 1, text - 1).astype(np.int64)
        return SampleShapes(
            encoder_units=units,
            tokens_per_unit=tokens_per_unit,
            llm_visual_tokens=units * tokens_per_unit + newline,
            text_tokens=text,
            modality=shapes.modality.copy(),
            target_tokens=np.where(shapes.target_tokens > 0, targets, 0),
            targets_estimated=shapes.targets_estimated,
        )


def check_conformed(shapes: SampleShapes, config: ModelConfig) -> np.ndarray:
    """``shapes.llm_visual_tokens`` after checking that it is what ``config`` gives each
    sample's units (``ModelConfig.llm_visual_tokens``); ``ValueError`` names the first
    sample that differs."""
    visual = config.llm_visual_tokens(shapes.encoder_units.astype(np.int64))
    bad = np.flatnonzero(shapes.llm_visual_tokens != visual)
    if bad.size:
        i = int(bad[0])
        newline = " + 1 newline" if config.decoder.image_newline and visual[i] else ""
        raise ValueError(
            f"sample {i} has llm_visual_tokens={shapes.llm_visual_tokens[i]} but "
            f"{shapes.encoder_units[i]} units x {config.vision.tokens_per_unit} tokens per "
            f"unit{newline} of the model = {visual[i]}: conform the shapes with "
            "ShapeScaler.for_model(config) first"
        )
    return visual


@dataclass(frozen=True)
class SampleLayout:
    """Position counts of one sample, in sequence order (see the module docstring)."""

    prompt_head: int
    visual: int
    prompt_tail: int
    answer: int

    @property
    def seq_len(self) -> int:
        return self.prompt_head + self.visual + self.prompt_tail + self.answer


def sample_layout(visual_tokens: int, text_tokens: int, target_tokens: int) -> SampleLayout:
    """The layout of a sample with ``visual_tokens`` placeholders and ``text_tokens`` text
    of which the last ``target_tokens`` are the answer."""
    if not 0 <= target_tokens < text_tokens:
        raise ValueError(
            f"a sample needs a prompt token before its answer: target_tokens={target_tokens} "
            f"must be in [0, text_tokens={text_tokens})"
        )
    prompt = text_tokens - target_tokens
    head = prompt // 2
    return SampleLayout(head, visual_tokens, prompt - head, target_tokens)


class PackedBatchSource:
    """What batch sources share: packing per-sample text into the LLM's inputs.

    Subclasses provide ``shapes``, ``config``, ``_sample_text(i) -> (token_ids,
    image_token_mask, labels)`` of one sample and ``_render_units(i, first, count) ->
    [count, C, H, W]``, units ``[first, first + count)`` of sample i.
    """

    shapes: SampleShapes
    config: ModelConfig

    def _sample_text(self, sample_id: int) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def _render_units(self, sample_id: int, first: int, count: int) -> Tensor:
        raise NotImplementedError

    def _no_pixels(self) -> Tensor:
        """The pixels of no unit (an encoder replica with an empty share)."""
        import torch

        v = self.config.vision
        return torch.zeros(0, v.channels, v.image_size_px, v.image_size_px)

    def _visual_items(self, sample_ids: list[int]) -> tuple | None:
        """Each sample's visual items, for a model with per-sample visual operations."""
        return None

    def visual_files(self, sample_id: int) -> list[str]:
        """The image files whose pixels sample ``sample_id``'s units are made from (none
        for synthesised pixels): what the trainer checks before the step uses them."""
        return []

    def pixel_values(
        self,
        sample_ids: np.ndarray | list[int],
        first_unit: np.ndarray | list[int] | None = None,
        num_units: np.ndarray | list[int] | None = None,
    ) -> Tensor:
        """``[U, C, H, W]`` float32: the units of ``sample_ids``, in that order; with
        ``first_unit`` / ``num_units`` (aligned with ``sample_ids``) only units
        ``[first_unit[k], first_unit[k] + num_units[k])`` of sample k (an encoder replica's
        pieces). Each unit is rendered alone, so a piece costs only its own units."""
        import torch

        ids = [int(i) for i in sample_ids]
        total = [int(self.shapes.encoder_units[i]) for i in ids]
        firsts = [0] * len(ids) if first_unit is None else [int(f) for f in first_unit]
        counts = total if num_units is None else [int(c) for c in num_units]
        if len(firsts) != len(ids) or len(counts) != len(ids):
            raise ValueError(
                f"first_unit and num_units must have one entry per sample id ({len(ids)}), "
                f"got {len(firsts)} and {len(counts)}"
            )
        parts = []
        for i, first, count, units in zip(ids, firsts, counts, total):
            if first < 0 or count < 0 or first + count > units:
                raise ValueError(
                    f"sample {i}: units [{first}, {first + count}) are out of its {units} units"
                )
            if count:
                parts.append(self._render_units(i, first, count))
        if not parts:
            return self._no_pixels()
        return torch.cat(parts)

    def text_inputs(self, sample_ids: np.ndarray | list[int]) -> TextInputs:
        """The packed LLM inputs of ``sample_ids``, in that order."""
        import torch

        ids = [int(i) for i in sample_ids]
        parts = [self._sample_text(i) for i in ids]
        lens = [int(tokens.shape[0]) for tokens, _, _ in parts]
        cu = torch.tensor([0, *np.cumsum(lens, dtype=np.int64).tolist()], dtype=torch.long)
        units = torch.tensor([int(self.shapes.encoder_units[i]) for i in ids], dtype=torch.long)
        items = self._visual_items(ids)
        if not parts:
            empty = torch.zeros(0, dtype=torch.long)
            return TextInputs(empty, empty.bool(), empty, cu, units, items)
        tokens, mask, labels = (torch.cat(t) for t in zip(*parts))
        return TextInputs(tokens, mask, labels, cu, units, items)

    def model_inputs(self, sample_ids: np.ndarray | list[int]) -> dict[str, Tensor]:
        """Keyword arguments of ``MultimodalModel.forward`` for ``sample_ids`` packed."""
        text = self.text_inputs(sample_ids)
        return {
            "pixel_values": self.pixel_values(sample_ids),
            "unit_counts_per_sample": text.unit_counts,
            "token_ids": text.token_ids,
            "image_token_mask": text.image_token_mask,
            "cu_seqlens": text.cu_seqlens,
            "labels": text.labels,
        }


class SyntheticBatch(PackedBatchSource):
    """Deterministic tensors for the samples of ``shapes`` (already conformed to ``config``,
    e.g. by :class:`ShapeScaler`): ``pixel_values(ids)``, ``text_inputs(ids)``.

    Sample indices are positions in ``shapes`` (the global batch, as in a ``Schedule``).
    """

    def __init__(self, shapes: SampleShapes, config: ModelConfig, seed: int = 0) -> None:
        visual = check_conformed(shapes, config)
        self.shapes = shapes
        self.config = config
        self.seed = seed
        self._layouts = [
            sample_layout(int(v), int(t), int(a))
            for v, t, a in zip(visual, shapes.text_tokens, shapes.target_tokens)
        ]
        too_long = [
            i for i, lay in enumerate(self._layouts) if lay.seq_len > config.decoder.max_seq_len
        ]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"sample {i} has {self._layouts[i].seq_len} positions, more than "
                f"DecoderConfig.max_seq_len={config.decoder.max_seq_len}"
            )

    def __len__(self) -> int:
        return len(self.shapes)

    def layout(self, sample_id: int) -> SampleLayout:
        return self._layouts[sample_id]

    def target_tokens(self) -> np.ndarray:
        """(N,) int64: target tokens of every sample (its answer length)."""
        return np.array([lay.answer for lay in self._layouts], dtype=np.int64)

    def _render_units(self, sample_id: int, first: int, count: int) -> Tensor:
        """Smooth per-channel sinusoidal patterns (random frequencies and phases), so the
        encoder sees structured images rather than noise. Units ``[first, first +
        count)``; the random draws cover all of the sample's units, so a unit looks the
        same whichever piece renders it."""
        import torch

        v = self.config.vision
        num_units = int(self.shapes.encoder_units[sample_id])
        rng = np.random.default_rng([self.seed, sample_id, _PIXEL_STREAM])
        freq = rng.uniform(0.5, 3.0, size=(num_units, v.channels, 2))[first : first + count]
        phase = rng.uniform(0.0, 2 * math.pi, size=(num_units, v.channels))[first : first + count]
        freq_t, phase_t = torch.from_numpy(freq), torch.from_numpy(phase)
        axis = torch.linspace(0.0, 1.0, v.image_size_px, dtype=torch.float64)
        y, x = axis[:, None], axis[None, :]  # [H, 1], [1, W]
        angle = 2 * math.pi * (freq_t[..., 0, None, None] * x + freq_t[..., 1, None, None] * y)
        return (0.5 * torch.sin(angle + phase_t[..., None, None])).float()  # [count, C, H, W]

    def _sample_text(self, sample_id: int) -> tuple[Tensor, Tensor, Tensor]:
        import torch

        lay = self._layouts[sample_id]
        rng = np.random.default_rng([self.seed, sample_id, _TOKEN_STREAM])
        # Text ids avoid IMAGE_TOKEN_ID so a placeholder is never mistaken for text.
        tokens = torch.from_numpy(rng.integers(1, self.config.decoder.vocab_size, lay.seq_len))
        visual_start = lay.prompt_head
        answer_start = lay.seq_len - lay.answer
        mask = torch.zeros(lay.seq_len, dtype=torch.bool)
        mask[visual_start : visual_start + lay.visual] = True
        tokens[mask] = IMAGE_TOKEN_ID
        labels = torch.full((lay.seq_len,), IGNORE_INDEX, dtype=torch.long)
        labels[answer_start:] = tokens[answer_start:]
        return tokens.long(), mask, labels
