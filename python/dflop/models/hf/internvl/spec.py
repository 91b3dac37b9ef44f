"""InternVL (``InternVLForConditionalGeneration``, InternVL 2.5 / 3 in the Hugging Face
layout) under dflop's runtime.

A visual *unit* is one 448 px tile (a dynamic-tiling crop or thumbnail of an image, or a
video frame). Encoder stages run the InternViT tower's layers up to
``vision_feature_layer`` on ``[U, 1 + patches, hidden]`` (its CLS token included, as the
model runs it); the last one drops the CLS token, applies the model's own pixel shuffle
(``downsample_ratio``: 2 x 2 patches into one token of 4x the width) and the projector
(LayerNorm + 2-layer MLP), sending ``patches / 4`` feature rows per tile to the LLM
(``token_merge = 4`` over the spec's ``tokens_per_unit`` patches). Every tile is encoded
alone by the model too, so the runtime may split a sample's tiles over encoder replicas.

LLM stages run the decoder (Qwen2 in InternVL 2.5 / 3) over samples packed into one
sequence (positions restart per sample, no attention across samples). The first LLM
stage scatters each sample's feature rows into its ``<IMG_CONTEXT>`` positions in order,
checking their count (the ``<img>`` / ``</img>`` around them are ordinary tokens).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from dflop.models.hf.base import HFSpec, HFStage, decoder_architecture
from dflop.models.hf.common import require_transformers
from dflop.models.hf.internvl.config import (
    encoder_tokens_per_tile,
    family_from_config,
    patch_side,
    shuffle_scale,
    tile_px,
)

__all__ = ["InternVLEncoderStage", "InternVLLLMStage", "InternVLSpec"]

_VISION = "model.vision_tower"
_TEXT = "model.language_model"
_PROJECTOR = "model.multi_modal_projector"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
"""The normalisation of the released InternVL checkpoints' image processors."""
DEFAULT_MAX_PATCHES = 12
"""The released checkpoints' ``max_patches`` (dynamic tiles per image, thumbnail aside)."""


def feature_layers(config: Any) -> tuple[int, bool]:
    """``(tower layers that run, whether the tower's final layernorm applies)`` for the
    config's ``vision_feature_layer``: -1 is the tower's ``last_hidden_state`` (all
    layers, then its ``layernorm``, an identity with ``use_mean_pooling``), ``k`` (or
    ``k - layers - 1`` counted from the end) the output of layer ``k``."""
    layer = config.vision_feature_layer
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(
            f"vision_feature_layer={layer!r}: dflop supports one feature layer (an int)"
        )
    vision = config.vision_config
    total = int(vision.num_hidden_layers)
    if layer == -1:
        return total, not bool(vision.use_mean_pooling)
    used = layer if layer >= 0 else total + 1 + layer
    if not 1 <= used <= total:
        raise ValueError(
            f"vision_feature_layer={layer} selects hidden state {used} of a {total}-layer "
            "tower: it must select a layer's output (1..num_hidden_layers)"
        )
    return used, False


class InternVLSpec(HFSpec):
    """An InternVL model from its ``InternVLConfig`` (random init for a seed) or a local
    checkpoint folder (``checkpoint_dir``, safetensors in the HF layout, with its
    ``preprocessor_config.json`` and tokenizer when it has them)."""

    projector_prefixes = (f"{_PROJECTOR}.",)

    def __init__(self, config: Any, checkpoint_dir: str | None = None) -> None:
        transformers = require_transformers()
        if getattr(config, "model_type", None) != "internvl":
            raise ValueError(
                f"config.model_type={getattr(config, 'model_type', None)!r}: expected 'internvl'"
            )
        if config.vision_feature_select_strategy != "default":
            raise ValueError(
                f"vision_feature_select_strategy={config.vision_feature_select_strategy!r}: "
                "dflop supports 'default' (the CLS token dropped before the pixel shuffle)"
            )
        self.model_class = transformers.InternVLForConditionalGeneration
        if config._attn_implementation is None:
            config._attn_implementation = "sdpa"
        vision, text = config.vision_config, config.text_config
        self.config = config
        self.checkpoint_dir = checkpoint_dir
        self.name = "internvl"
        self.encoder_layers, _ = feature_layers(config)
        self.llm_layers = int(text.num_hidden_layers)
        side = patch_side(config)
        self.tokens_per_unit = side * side  # the patches (the CLS token is dropped)
        self.token_merge = shuffle_scale(config) ** 2
        self.visual_newline = None  # the model's own count (merge_visual checks it)
        tile = tile_px(config)
        self.image_shape = (int(vision.num_channels), tile, tile)
        self.max_seq_len = int(text.max_position_embeddings)
        self.encoder_stage = InternVLEncoderStage
        self.llm_stage = InternVLLLMStage
        self._processor = None
        self.family = family_from_config(config, self.image_processor())

    def architecture(self) -> tuple[Any, Any]:
        """InternViT (the layers up to ``vision_feature_layer``, CLS token included) with
        the pixel-shuffle projector, and the decoder, from the config."""
        from dflop.data.costs import EncoderConfig

        vision, text = self.config.vision_config, self.config.text_config
        merge = self.token_merge
        encoder = EncoderConfig(
            name=f"{self.name}.vision",
            hidden_size=int(vision.hidden_size),
            num_layers=self.encoder_layers,
            intermediate_size=int(vision.intermediate_size),
            num_heads=int(vision.num_attention_heads),
            tokens_per_unit=encoder_tokens_per_tile(self.config),
            patch_px=tile_px(self.config) // patch_side(self.config),
            projector_input_size=int(vision.hidden_size) * merge,
            projector_token_ratio=1.0 / merge,
            projector_hidden_size=int(text.hidden_size),
            default_family="internvl",
        )
        llm = decoder_architecture(f"{self.name}.text", text, self.llm_layers)
        return encoder, llm

    def image_processor(self) -> Any:
        """The checkpoint folder's image processor (``preprocessor_config.json``), else
        the released checkpoints' settings for the config's tile size:
        ``GotOcr2ImageProcessorPil``, bicubic, ImageNet normalisation, 1 to 12 tiles."""
        from dflop.models.hf.common import local_image_processor

        if self._processor is None:
            processor = local_image_processor(self.checkpoint_dir)
            if processor is None:
                module = require_transformers().models.got_ocr2.image_processing_pil_got_ocr2
                tile = tile_px(self.config)
                processor = module.GotOcr2ImageProcessorPil(
                    size={"height": tile, "width": tile},
                    crop_to_patches=True,
                    min_patches=1,
                    max_patches=DEFAULT_MAX_PATCHES,
                    image_mean=list(IMAGENET_MEAN),
                    image_std=list(IMAGENET_STD),
                )
            self._processor = processor
        return self._processor

    def image_wrap_ids(self) -> tuple[int, int]:
        """``(<img>, </img>)`` token ids: the folder's tokenizer's (its
        ``start_image_token`` / ``end_image_token``), else the two ids before
        ``image_token_id`` (as in the released checkpoints' vocabulary: 151665, 151666,
        ``<IMG_CONTEXT>`` 151667)."""
        from dflop.models.hf.common import local_tokenizer

        tokenizer = local_tokenizer(self.checkpoint_dir)
        image = int(self.config.image_token_id)
        if tokenizer is None:
            return image - 2, image - 1
        unknown = getattr(tokenizer, "unk_token_id", None)
        ids = []
        for attr, default in (("start_image_token", "<img>"), ("end_image_token", "</img>")):
            token = getattr(tokenizer, attr, None) or default
            found = tokenizer.convert_tokens_to_ids(token)
            if found is None or found == unknown:
                raise ValueError(
                    f"hf:{self.checkpoint_dir}: the tokenizer has no {token!r} token "
                    f"({attr}), which InternVL puts around each image's tokens"
                )
            ids.append(int(found))
        return ids[0], ids[1]

    def dataset_inputs(self) -> Any:
        """The converter of LLaVA-format records for this model: the checkpoint folder's
        image processor and tokenizer when it has them, else the released settings
        (:meth:`image_processor`) and :func:`~dflop.models.hf.records.byte_encoder`."""
        from dflop.models.hf.internvl.records import InternVLRecords

        wrap = self.image_wrap_ids()
        encode, template = self.text_encoding((int(self.config.image_token_id), *wrap))
        return InternVLRecords(
            self.config, self.image_processor(), encode, self.family, template, wrap=wrap
        )

    # ------------------------------------------------------------------ building

    def stage_paths(
        self, module: str, first: int, end: int, first_stage: bool, last: bool
    ) -> list[str]:
        """The full model's paths (modules or parameters) a stage holds."""
        if module == "encoder":
            paths = [f"{_VISION}.embeddings"] if first_stage else []
            paths += [f"{_VISION}.encoder.layer.{i}" for i in range(first, end)]
            if last:
                _, post_norm = feature_layers(self.config)
                paths += [f"{_VISION}.layernorm"] if post_norm else []
                paths.append(_PROJECTOR)
            return paths
        paths = [f"{_TEXT}.embed_tokens"] if first_stage else []
        paths += [f"{_TEXT}.layers.{i}" for i in range(first, end)]
        paths.append(f"{_TEXT}.rotary_emb")
        return paths + ([f"{_TEXT}.norm", "lm_head"] if last else [])


class InternVLEncoderStage(HFStage):
    """InternViT layers ``[first, end)``: pixels ``[U, C, S, S]`` in on the first stage,
    ``[U, 1 + patches, hidden]`` between stages, projected features ``[U * patches / 4,
    text hidden]`` out on the last."""

    @property
    def tokens_per_unit(self) -> int:
        """Tokens per tile between encoder stages: the patches and the CLS token."""
        return encoder_tokens_per_tile(self.config)

    @property
    def hidden_size(self) -> int:
        return int(self.config.vision_config.hidden_size)

    @property
    def output_size(self) -> int:
        return int(self.config.text_config.hidden_size)

    def _shards_attention(self) -> bool:
        # q/k RMSNorms over the whole width (InternViT-6B's use_qk_norm) need every head.
        return not bool(self.config.vision_config.use_qk_norm)

    def tensor_parallel_plan(self) -> dict[str, str]:
        """InternViT: q/k/v and fc1 column-, projection_layer and fc2 row-parallel (the
        attention stays replicated with ``use_qk_norm``, whose norms span all heads); the
        projector's linear_1 column- and linear_2 row-parallel on the last stage."""
        plan: dict[str, str] = {}
        for i in range(self.first_layer, self.end_layer):
            base = f"{_VISION}.encoder.layer.{i}"
            if self._shards_attention():
                qkv = ("q_proj", "k_proj", "v_proj")
                plan.update(self._linear_plan(f"{base}.attention", qkv, ("projection_layer",)))
            plan.update(self._linear_plan(f"{base}.mlp", ("fc1",), ("fc2",)))
        if self.has_head:
            plan.update(self._linear_plan(_PROJECTOR, ("linear_1",), ("linear_2",)))
        return plan

    def tensor_parallel_sizes(self) -> list[tuple[str, int]]:
        vision = self.config.vision_config
        sizes = [("vision_config.intermediate_size", int(vision.intermediate_size))]
        if self._shards_attention():
            sizes.insert(0, ("vision_config.num_attention_heads", int(vision.num_attention_heads)))
        if self.has_head:
            sizes.append(("text_config.hidden_size", int(self.config.text_config.hidden_size)))
        return sizes

    def use_local_heads(self, tp_size: int) -> None:
        """The attention reshapes by its head count and width: the local ones once q/k/v
        are column-parallel."""
        if not self._shards_attention():
            return
        for layer in self._tower_layers():
            attention = layer.attention
            attention.num_heads //= tp_size
            attention.embed_dim //= tp_size

    def recompute_blocks(self) -> list[nn.Module]:
        return list(self._tower_layers())

    def _tower_layers(self) -> list[Any]:
        if self.end_layer == self.first_layer:
            return []
        layers = self.get_submodule(f"{_VISION}.encoder.layer")
        return [getattr(layers, str(i)) for i in range(self.first_layer, self.end_layer)]

    def forward(self, x: Tensor) -> Tensor:
        if self.has_embed:
            embeddings = self.get_submodule(f"{_VISION}.embeddings")
            x = embeddings(x.to(embeddings.patch_embeddings.projection.weight.dtype))
        for layer in self._tower_layers():
            out = layer(x)
            x = out[0] if isinstance(out, tuple) else out
        if not self.has_head:
            return x
        from transformers.models.internvl.modeling_internvl import InternVLModel

        _, post_norm = feature_layers(self.config)
        if post_norm:
            x = self.get_submodule(f"{_VISION}.layernorm")(x)
        x = x[:, 1:]  # the CLS token ("default" feature selection)
        side = patch_side(self.config)
        x = x.reshape(x.shape[0], side, side, x.shape[-1])
        x = InternVLModel.pixel_shuffle(self, x, scale_factor=self.config.downsample_ratio)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        return self.get_submodule(_PROJECTOR)(x).flatten(0, 1)


class InternVLLLMStage(HFStage):
    """Decoder layers ``[first, end)`` over packed samples; token embedding and the
    visual scatter on the first stage, final norm and head on the last."""

    visual_newline = None

    def forward(self, input_embeds: Tensor, cu_seqlens: Tensor) -> Tensor:
        return self.hidden_states(input_embeds, cu_seqlens)
