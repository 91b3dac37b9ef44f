"""The reference multimodal model: ``VisionTower`` features scattered into a ``Decoder``'s
packed token embeddings, loss on text tokens only."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflop.models.config import ModelConfig, model_config
from dflop.models.decoder import IGNORE_INDEX, Decoder, DeviceLike, merge_visual_features
from dflop.models.vision import VisionTower

__all__ = ["MultimodalModel", "build_model", "check_visual_layout", "merge_visual_features"]


def check_visual_layout(
    image_token_mask: Tensor,
    cu_seqlens: Tensor,
    unit_counts_per_sample: Tensor,
    tokens_per_unit: int,
    num_units: int,
    newline_tokens: int = 0,
) -> None:
    """Raise ``ValueError`` unless sample i has exactly ``unit_counts_per_sample[i] *
    tokens_per_unit`` placeholder positions (plus ``newline_tokens`` if it has units) and
    the counts sum to ``num_units`` (so every sample's features land inside that sample).
    One host synchronisation."""
    if image_token_mask.dtype != torch.bool or image_token_mask.dim() != 1:
        raise ValueError(
            f"image_token_mask must be a 1-D bool tensor [T], got dtype={image_token_mask.dtype} "
            f"shape={tuple(image_token_mask.shape)}"
        )
    counts = unit_counts_per_sample.tolist()
    if len(counts) != cu_seqlens.numel() - 1:
        raise ValueError(
            f"unit_counts_per_sample has {len(counts)} entries but cu_seqlens describes "
            f"{cu_seqlens.numel() - 1} samples"
        )
    if sum(counts) != num_units:
        raise ValueError(
            f"unit_counts_per_sample sums to {sum(counts)} but pixel_values has {num_units} units"
        )
    cumulative = torch.cat(
        (image_token_mask.new_zeros(1, dtype=torch.long), image_token_mask.cumsum(0))
    )
    per_sample = (cumulative[cu_seqlens[1:]] - cumulative[cu_seqlens[:-1]]).tolist()
    for i, (placeholders, units) in enumerate(zip(per_sample, counts)):
        newline = newline_tokens if units > 0 else 0
        if placeholders != units * tokens_per_unit + newline:
            raise ValueError(
                f"sample {i} has {placeholders} image placeholder positions but "
                f"unit_counts_per_sample[{i}]={units} units x {tokens_per_unit} tokens per unit "
                + (f"+ {newline} newline " if newline else "")
                + f"= {units * tokens_per_unit + newline}"
            )


class MultimodalModel(nn.Module):
    """Vision tower + decoder over one packed microbatch.

    Input contract of ``forward`` (T = packed tokens, U = visual units, n = samples):

    - ``pixel_values``: ``[U, C, H, W]`` float, the units of all samples concatenated in
      sample order (sample 0's units first), each unit a tile or frame of
      ``image_size_px`` square. ``U`` may be 0 (text-only microbatch; the encoder is
      skipped).
    - ``unit_counts_per_sample``: ``LongTensor[n]``, units per sample (0 for text-only).
    - ``token_ids``: ``LongTensor[T]``, the packed token ids. Ids at placeholder positions
      are ignored (any valid id, e.g. an image token id).
    - ``image_token_mask``: ``BoolTensor[T]``, True at image placeholder positions; sample i
      has exactly ``unit_counts_per_sample[i] * tokens_per_unit`` of them, filled with its
      units' projected features in order (unit-major, then patch row-major), plus one
      for the ``image_newline`` row after them when the sample has units and
      ``DecoderConfig.image_newline`` is set (``ModelConfig.llm_visual_tokens``).
    - ``cu_seqlens``: ``LongTensor[n + 1]``, cumulative sample lengths, 0 .. T.
    - ``labels``: ``LongTensor[T]``, aligned with ``token_ids``; -100 = no loss. Positions
      under ``image_token_mask`` never count (forced to -100). Shifted within each sample.

    Returns ``(sum_loss, num_target_tokens)``: summed next-token cross-entropy (float32
    0-dim) and the number of target tokens (int64 0-dim). Normalise by the global count
    of target tokens across microbatches and ranks.
    """

    def __init__(self, vision: VisionTower, decoder: Decoder, *, check_inputs: bool = True) -> None:
        super().__init__()
        if vision.projector_config.hidden != decoder.config.hidden:
            raise ValueError(
                f"ProjectorConfig.hidden={vision.projector_config.hidden} must equal "
                f"DecoderConfig.hidden={decoder.config.hidden}"
            )
        self.vision = vision
        self.decoder = decoder
        self.check_inputs = check_inputs

    @property
    def config(self) -> ModelConfig:
        return ModelConfig(
            self.vision.vision_config, self.vision.projector_config, self.decoder.config
        )

    def input_embeds(
        self,
        pixel_values: Tensor,
        unit_counts_per_sample: Tensor,
        token_ids: Tensor,
        image_token_mask: Tensor,
        cu_seqlens: Tensor,
    ) -> Tensor:
        """The decoder's packed input ``[T, hidden]``: token embeddings with visual features
        at the placeholder positions."""
        if self.check_inputs:
            check_visual_layout(
                image_token_mask,
                cu_seqlens,
                unit_counts_per_sample,
                self.vision.tokens_per_unit,
                pixel_values.shape[0],
                newline_tokens=int(self.decoder.config.image_newline),
            )
        embeds = self.decoder.embed(token_ids)
        if pixel_values.shape[0] == 0:
            return embeds
        features = self.vision(pixel_values)
        if self.decoder.image_newline is not None:
            rows = unit_counts_per_sample * self.vision.tokens_per_unit
            features = self.decoder.append_visual_newlines(features, rows.tolist())
        return merge_visual_features(embeds, image_token_mask, features)

    def forward(
        self,
        pixel_values: Tensor,
        unit_counts_per_sample: Tensor,
        token_ids: Tensor,
        image_token_mask: Tensor,
        cu_seqlens: Tensor,
        labels: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """``(sum_loss, num_target_tokens)``; see the class docstring for the inputs."""
        embeds = self.input_embeds(
            pixel_values, unit_counts_per_sample, token_ids, image_token_mask, cu_seqlens
        )
        labels = labels.masked_fill(image_token_mask.to(labels.device), IGNORE_INDEX)
        return self.decoder.loss(embeds, cu_seqlens, labels)

    def init_weights(self, seed: int) -> None:
        """Deterministic, name-keyed init (identical for any stage split)."""
        self.vision.init_weights(seed)
        self.decoder.init_weights(seed)


def build_model(
    preset_or_config: str | ModelConfig,
    seed: int = 0,
    *,
    device: DeviceLike = None,
    dtype: torch.dtype | None = None,
) -> MultimodalModel:
    """Build and deterministically initialise the reference model.

    ``preset_or_config``: a name accepted by ``model_config`` (``"tiny"``, ``"small"``,
    ``"siglip-400m+llm-7b"`` …) or a ``ModelConfig``. The same seed gives the same
    weights on the same device type. ``device="meta"`` builds without memory (e.g. to count
    parameters); nothing is initialised then.
    """
    config = (
        model_config(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    )
    config.validate()
    kw = {"device": device, "dtype": dtype}
    model = MultimodalModel(
        VisionTower(config.vision, config.projector, **kw), Decoder(config.decoder, **kw)
    )
    model.init_weights(seed)  # skips meta tensors
    return model
