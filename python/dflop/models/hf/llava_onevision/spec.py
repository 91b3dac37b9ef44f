"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``) under dflop's runtime.

Encoder stages run the SigLIP tower's layers up to ``vision_feature_layer`` (the layers
after it and the post-layernorm never reach the LLM, as in the model), the last one the
projector; every visual unit (a base image or anyres crop, a multi-image tile, a video
frame) is one row group of ``(image_size // patch_size)^2`` features. LLM stages run the
Qwen2 decoder's layers on samples packed into one sequence (positions restart per sample,
no attention across samples). The first LLM stage does what the model does per sample
once all of a sample's units are there, with the model's own code
(``pack_image_features``: anyres unpadding, ``anyres_max_N`` downsampling and a newline
per feature row; one newline after a multi-image tile; ``apply_pooling`` of video frames
and one newline per video), then scatters the rows into the placeholder positions.

Tensor parallelism and tied word embeddings split over pipeline stages are not supported
yet (both raise a clear error).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dflop.batch.visual import VisualItem
from dflop.models.hf.base import HFSpec, HFStage, decoder_architecture
from dflop.models.hf.common import require_transformers
from dflop.models.hf.llava_onevision.config import family_from_config
from dflop.models.hf.llava_onevision.config import tokens_per_unit as _tokens_per_unit

__all__ = ["LlavaOnevisionEncoderStage", "LlavaOnevisionLLMStage", "LlavaOnevisionSpec"]

_VISION = "model.vision_tower"
_TEXT = "model.language_model"


class LlavaOnevisionSpec(HFSpec):
    """A LLaVA-OneVision model from its ``LlavaOnevisionConfig`` (random init for a seed)
    or a local checkpoint folder (``checkpoint_dir``, safetensors in the HF layout)."""

    def __init__(self, config: Any, checkpoint_dir: str | None = None) -> None:
        transformers = require_transformers()
        self.model_class = transformers.LlavaOnevisionForConditionalGeneration
        self.projector_prefixes = ("model.multi_modal_projector.",)
        if getattr(config, "model_type", None) != "llava_onevision":
            raise ValueError(
                f"config.model_type={getattr(config, 'model_type', None)!r}: expected "
                "'llava_onevision'"
            )
        layer = config.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError(
                f"vision_feature_layer={layer!r}: dflop supports one feature layer (an int)"
            )
        vision = config.vision_config
        total = vision.num_hidden_layers
        used = layer if layer >= 0 else total + 1 + layer
        if not 1 <= used <= total:
            raise ValueError(
                f"vision_feature_layer={layer} selects hidden state {used} of a {total}-layer "
                "tower: it must select a layer's output (1..num_hidden_layers)"
            )
        if config._attn_implementation is None:
            config._attn_implementation = "sdpa"
        self.config = config
        self.checkpoint_dir = checkpoint_dir
        self.name = "llava_onevision"
        self.encoder_layers = used
        self.llm_layers = config.text_config.num_hidden_layers
        self.tokens_per_unit = _tokens_per_unit(config)
        self.visual_newline = None  # the model's own per-sample rule (merge_visual checks)
        self.family = family_from_config(config)
        self.image_shape = (vision.num_channels, vision.image_size, vision.image_size)
        self.encoder_stage = LlavaOnevisionEncoderStage
        self.llm_stage = LlavaOnevisionLLMStage
        self.max_seq_len = int(config.text_config.max_position_embeddings)

    def architecture(self) -> tuple[Any, Any]:
        """SigLIP (the layers up to ``vision_feature_layer``) with the 2-layer projector,
        and the Qwen2 decoder, from the config."""
        from dflop.data.costs import EncoderConfig

        vision, text = self.config.vision_config, self.config.text_config
        encoder = EncoderConfig(
            name=f"{self.name}.vision",
            hidden_size=vision.hidden_size,
            num_layers=self.encoder_layers,
            intermediate_size=vision.intermediate_size,
            num_heads=vision.num_attention_heads,
            tokens_per_unit=self.tokens_per_unit,
            patch_px=vision.patch_size,
            projector_hidden_size=text.hidden_size,
            default_family="llava-ov",
        )
        llm = decoder_architecture(f"{self.name}.text", text, self.llm_layers)
        return encoder, llm

    def image_processor(self) -> Any:
        """The checkpoint folder's image processor (``preprocessor_config.json``), else
        one built from the config (tile size, grids; the processor class's default
        normalisation)."""
        from dflop.models.hf.common import local_image_processor

        processor = local_image_processor(self.checkpoint_dir)
        if processor is None:
            module = require_transformers().models.llava_onevision
            side = self.config.vision_config.image_size
            processor = module.image_processing_pil_llava_onevision.LlavaOnevisionImageProcessorPil(
                size={"height": side, "width": side},
                crop_size={"height": side, "width": side},
                image_grid_pinpoints=self.config.image_grid_pinpoints,
            )
        return processor

    def dataset_inputs(self) -> Any:
        """The converter of LLaVA-format records for this model: the checkpoint folder's
        image processor (``preprocessor_config.json``) and tokenizer when it has them;
        else a processor built from the config (tile size, grids; the processor class's
        default normalisation) and :func:`~dflop.models.hf.records.byte_encoder`."""
        from dflop.models.hf.llava_onevision.records import LlavaOnevisionRecords

        processor = self.image_processor()
        config = self.config
        encode, template = self.text_encoding(
            (int(config.image_token_index), int(config.video_token_index))
        )
        return LlavaOnevisionRecords(self.config, processor, encode, self.family, template)

    # ------------------------------------------------------------------ building

    def stage_paths(self, module: str, first: int, end: int, first_stage: bool, last: bool):
        """The full model's paths (modules or parameters) a stage holds."""
        if module == "encoder":
            paths = [f"{_VISION}.embeddings"] if first_stage else []
            paths += [f"{_VISION}.encoder.layers.{i}" for i in range(first, end)]
            return paths + (["model.multi_modal_projector"] if last else [])
        paths = [f"{_TEXT}.embed_tokens", "model.image_newline"] if first_stage else []
        paths += [f"{_TEXT}.layers.{i}" for i in range(first, end)]
        paths.append(f"{_TEXT}.rotary_emb")
        return paths + ([f"{_TEXT}.norm", "lm_head"] if last else [])


class LlavaOnevisionEncoderStage(HFStage):
    """SigLIP layers ``[first, end)``; pixels in on the first stage, projected features
    ``[U * tokens_per_unit, text hidden]`` out on the last."""

    @property
    def tokens_per_unit(self) -> int:
        return _tokens_per_unit(self.config)

    @property
    def hidden_size(self) -> int:
        return self.config.vision_config.hidden_size

    @property
    def output_size(self) -> int:
        return self.config.text_config.hidden_size

    def tensor_parallel_plan(self) -> dict[str, str]:
        """SigLIP: q/k/v and fc1 column-, out_proj and fc2 row-parallel; the projector's
        linear_1 column- and linear_2 row-parallel on the last stage."""
        plan: dict[str, str] = {}
        for i in range(self.first_layer, self.end_layer):
            base = f"{_VISION}.encoder.layers.{i}"
            qkv = ("q_proj", "k_proj", "v_proj")
            plan.update(self._linear_plan(f"{base}.self_attn", qkv, ("out_proj",)))
            plan.update(self._linear_plan(f"{base}.mlp", ("fc1",), ("fc2",)))
        if self.has_head:
            plan.update(
                self._linear_plan("model.multi_modal_projector", ("linear_1",), ("linear_2",))
            )
        return plan

    def tensor_parallel_sizes(self) -> list[tuple[str, int]]:
        vision = self.config.vision_config
        sizes = [
            ("vision_config.num_attention_heads", vision.num_attention_heads),
            ("vision_config.intermediate_size", vision.intermediate_size),
        ]
        if self.has_head:
            sizes.append(("text_config.hidden_size", self.config.text_config.hidden_size))
        return sizes

    def recompute_blocks(self) -> list[nn.Module]:
        return self._layers(f"{_VISION}.encoder")

    def forward(self, x: Tensor) -> Tensor:
        if self.has_embed:
            x = self.get_submodule(f"{_VISION}.embeddings")(x)
        for layer in self._layers(f"{_VISION}.encoder"):
            out = layer(x, None)
            x = out[0] if isinstance(out, tuple) else out
        if not self.has_head:
            return x
        if self.config.vision_feature_select_strategy == "default":
            x = x[:, 1:]
        return self.get_submodule("model.multi_modal_projector")(x).flatten(0, 1)


class LlavaOnevisionLLMStage(HFStage):
    """Qwen2 decoder layers ``[first, end)`` over packed samples; token embedding, the
    model's per-sample visual operations and ``image_newline`` on the first stage, final
    norm and head on the last."""

    visual_newline = None

    def visual_rows(self, features: Tensor, items: tuple[VisualItem, ...]) -> Tensor:
        """One sample's LLM visual rows from its units' projected features ``[sum units *
        tokens_per_unit, hidden]``, by the model's own per-sample code."""
        from transformers.models.llava_onevision.modeling_llava_onevision import (
            LlavaOnevisionModel,
        )

        per_unit = features.view(-1, self.tokens_per_unit, features.shape[-1])
        if sum(item.units for item in items) != per_unit.shape[0]:
            raise ValueError(
                f"the sample's visual items have {sum(i.units for i in items)} units, its "
                f"features {per_unit.shape[0]}"
            )
        newline = self.get_parameter("model.image_newline")
        aspect = self.config.vision_aspect_ratio
        rows = []
        for item, units in zip(items, per_unit.split([i.units for i in items])):
            if item.kind == "video":
                pooled = LlavaOnevisionModel.apply_pooling(self, units).flatten(0, 1)
                rows.append(torch.cat((pooled, newline[None].to(pooled.dtype))))
                continue
            if item.kind == "image" and units.shape[0] > 1 and item.height_px <= 0:
                raise ValueError("an anyres image item needs its height_px and width_px")
            size = torch.tensor([[item.height_px, item.width_px]])
            packed, _ = LlavaOnevisionModel.pack_image_features(
                self, [units], size, image_newline=newline, vision_aspect_ratio=aspect
            )
            rows.append(packed[0])
        return torch.cat(rows)

    @property
    def tokens_per_unit(self) -> int:
        return _tokens_per_unit(self.config)

    def forward(self, input_embeds: Tensor, cu_seqlens: Tensor) -> Tensor:
        return self.hidden_states(input_embeds, cu_seqlens)
