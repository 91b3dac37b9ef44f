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
import torch.nn.functional as F
from torch import Tensor, nn

from dflop.data.families import FamilySpec
from dflop.models.decoder import IGNORE_INDEX, merge_visual_features, next_token_targets
from dflop.models.hf.common import (
    StageTree,
    carve,
    checkpoint_keys,
    has_weights,
    load_stage_weights,
    materialize,
    packed_decoder_inputs,
    require_transformers,
    write_index,
    write_shard,
)
from dflop.models.spec import ModelSpec, VisualItem

__all__ = ["LlavaOnevisionSpec", "family_from_config"]

_VISION = "model.vision_tower"
_TEXT = "model.language_model"


def _tokens_per_unit(config: Any) -> int:
    """Features per unit: the tower's patches (minus the first with the ``default``
    selection strategy, which drops a CLS position the model assumes)."""
    side = config.vision_config.image_size // config.vision_config.patch_size
    return side * side - int(config.vision_feature_select_strategy == "default")


def family_from_config(config: Any) -> FamilySpec:
    """The shape rules (:class:`~dflop.data.families.FamilySpec`) of a LLaVA-OneVision
    config: tile and feature sizes from its vision config, the anyres grids from
    ``image_grid_pinpoints`` (which must be every ``r x c`` grid of tiles up to a square
    maximum, as in the released models), ``anyres_max_N`` from ``vision_aspect_ratio``,
    2x2-pooled video frames and one newline per video, as the model's code does."""
    vision = config.vision_config
    tile = vision.image_size
    side = tile // vision.patch_size
    tokens = _tokens_per_unit(config)
    pinpoints = sorted((int(h), int(w)) for h, w in config.image_grid_pinpoints)
    grid = max(max(h, w) for h, w in pinpoints) // tile
    full = sorted((tile * r, tile * c) for r in range(1, grid + 1) for c in range(1, grid + 1))
    if pinpoints != full:
        raise ValueError(
            f"image_grid_pinpoints {config.image_grid_pinpoints} are not all grids of "
            f"{tile} px tiles up to {grid} x {grid}: dflop's anyres rule needs them"
        )
    aspect = str(config.vision_aspect_ratio)
    if not aspect.startswith("anyres_max_") or not aspect[len("anyres_max_") :].isdigit():
        raise ValueError(f"vision_aspect_ratio={aspect!r}: expected 'anyres_max_<N>'")
    return FamilySpec(
        name="llava-ov",
        tiling="anyres",
        tile_px=tile,
        encoder_tokens_per_tile=tokens,
        llm_tokens_per_tile=tokens,
        feature_side=side,
        max_grid=grid,
        llm_max_crops=int(aspect[len("anyres_max_") :]),
        downsample_threshold=1.1,
        newline_tokens_per_row=1,
        single_tile_newline_tokens=1,
        video_encoder_tokens_per_frame=tokens,
        video_tokens_per_frame=((side + 1) // 2) ** 2,
        video_extra_tokens=1,
    )


class LlavaOnevisionSpec(ModelSpec):
    """A LLaVA-OneVision model from its ``LlavaOnevisionConfig`` (random init for a seed)
    or a local checkpoint folder (``checkpoint_dir``, safetensors in the HF layout)."""

    def __init__(self, config: Any, checkpoint_dir: str | None = None) -> None:
        transformers = require_transformers()
        self.model_class = transformers.LlavaOnevisionForConditionalGeneration
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
        self.max_seq_len = int(config.text_config.max_position_embeddings)

    def architecture(self) -> tuple[Any, Any]:
        """SigLIP (the layers up to ``vision_feature_layer``) with the 2-layer projector,
        and the Qwen2 decoder, from the config."""
        from dflop.data.costs import EncoderConfig, LLMConfig

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
        head_dim = getattr(text, "head_dim", None)
        llm = LLMConfig(
            name=f"{self.name}.text",
            hidden_size=text.hidden_size,
            num_layers=self.llm_layers,
            intermediate_size=text.intermediate_size,
            num_heads=text.num_attention_heads,
            num_kv_heads=text.num_key_value_heads,
            vocab_size=text.vocab_size,
            head_dim=None
            if head_dim in (None, text.hidden_size // text.num_attention_heads)
            else int(head_dim),
        )
        return encoder, llm

    def dataset_inputs(self) -> Any:
        """The converter of LLaVA-format records for this model: the checkpoint folder's
        image processor (``preprocessor_config.json``) and tokenizer when it has them;
        else a processor built from the config (tile size, grids; the processor class's
        default normalisation) and :func:`~dflop.models.hf.records.byte_encoder`."""
        from dflop.models.hf.common import local_image_processor, local_tokenizer
        from dflop.models.hf.records import LlavaOnevisionRecords, byte_encoder

        processor = local_image_processor(self.checkpoint_dir)
        if processor is None:
            module = require_transformers().models.llava_onevision
            side = self.config.vision_config.image_size
            processor = module.image_processing_pil_llava_onevision.LlavaOnevisionImageProcessorPil(
                size={"height": side, "width": side},
                crop_size={"height": side, "width": side},
                image_grid_pinpoints=self.config.image_grid_pinpoints,
            )
        tokenizer = local_tokenizer(self.checkpoint_dir)
        if tokenizer is not None:

            def encode(text: str) -> list[int]:
                return tokenizer.encode(text, add_special_tokens=False)

        else:
            encode = byte_encoder(
                self.config.text_config.vocab_size,
                (int(self.config.image_token_index), int(self.config.video_token_index)),
            )
        return LlavaOnevisionRecords(self.config, processor, encode)

    # ------------------------------------------------------------------ building

    def _full_model(self, seed: int, meta: bool) -> nn.Module:
        if meta:
            with torch.device("meta"):
                return self.model_class(self.config)
        torch.manual_seed(seed)
        return self.model_class(self.config)

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

    def build_stage(
        self,
        info: Any,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        tp_group: Any = None,
        tp_size: int = 1,
    ) -> nn.Module:
        """This rank's stage: from ``checkpoint_dir`` when it holds weights (only this
        stage's tensors are read), else the weights of the full model built for ``seed``
        (``torch.manual_seed(seed)`` then the transformers constructor: identical on every
        rank)."""
        if tp_size != 1:
            raise ValueError(
                f"tensor parallelism (tp={tp_size}) is not supported for Hugging Face models "
                "yet: use a layout with encoder_tp=1 and llm_tp=1"
            )
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        if tied and info.module == "llm" and info.is_first_stage != info.is_last_stage:
            raise ValueError(
                "tie_word_embeddings=True with the LLM split over pipeline stages is not "
                "supported yet: use llm_pp=1"
            )
        first, end = info.layer_range
        from_checkpoint = self.checkpoint_dir is not None and has_weights(self.checkpoint_dir)
        full = self._full_model(seed, meta=from_checkpoint)
        paths = self.stage_paths(info.module, first, end, info.is_first_stage, info.is_last_stage)
        tree = carve(full, paths)
        if from_checkpoint:
            keys = checkpoint_keys(full)
            materialize(full, tree)
            load_stage_weights(tree, self.checkpoint_dir, keys)
        del full
        cls = LlavaOnevisionEncoderStage if info.module == "encoder" else LlavaOnevisionLLMStage
        stage = cls(self.config, tree, first, end, info.is_first_stage, info.is_last_stage)
        return stage.to(device=device, dtype=dtype)

    def save_shard(
        self, folder: str, filename: str, state_dict: dict[str, Tensor]
    ) -> dict[str, str]:
        """Write a part of the model's ``state_dict`` (e.g. one stage's) to
        ``folder/filename`` under the checkpoint's keys; returns its ``weight_map``."""
        with torch.device("meta"):
            keys = checkpoint_keys(self.model_class(self.config))
        unknown = sorted(set(state_dict) - set(keys))
        if unknown:
            raise ValueError(f"cannot save {unknown[0]!r}: the model has no such tensor")
        return write_shard(folder, filename, {keys[n]: t for n, t in state_dict.items()})

    def finish_checkpoint(self, folder: str, weight_map: dict[str, str], seed: int = 0) -> None:
        """Complete a checkpoint whose trained tensors :meth:`save_shard` wrote: the
        tensors no stage holds (the tower's layers past ``vision_feature_layer`` and its
        post-layernorm, which never reach the loss) as they started (from
        ``checkpoint_dir``, else the init for ``seed``), the index and ``config.json``."""
        with torch.device("meta"):
            meta = self.model_class(self.config)
        keys = checkpoint_keys(meta)
        missing = sorted(name for name, key in keys.items() if key not in weight_map)
        if missing:
            from_checkpoint = self.checkpoint_dir is not None and has_weights(self.checkpoint_dir)
            full = self._full_model(seed, meta=from_checkpoint)
            tree = carve(full, missing)
            if from_checkpoint:
                materialize(full, tree)
                load_stage_weights(tree, self.checkpoint_dir, keys)
            start = tree.state_dict()
            weight_map = {
                **weight_map,
                **self.save_shard(folder, "model-untrained.safetensors", start),
            }
        write_index(folder, weight_map)
        self.config.save_pretrained(folder)

    def save_checkpoint(self, folder: str, state_dict: dict[str, Tensor], seed: int = 0) -> None:
        """Write the full model's ``state_dict`` (all stages' together) as a Hugging Face
        checkpoint folder (loadable with ``from_pretrained``); see
        :meth:`finish_checkpoint` for the tensors it lacks."""
        self.finish_checkpoint(
            folder, self.save_shard(folder, "model-00000.safetensors", state_dict), seed
        )


class _Stage(nn.Module):
    def __init__(
        self, config: Any, tree: StageTree, first: int, end: int, first_stage: bool, last: bool
    ) -> None:
        super().__init__()
        self.config = config
        self.first_layer, self.end_layer = first, end
        self.has_embed, self.has_head = first_stage, last
        # The tree's children ("model", "lm_head") become this module's, so that
        # state_dict() keys are the full model's.
        for name, child in tree.named_children():
            self.add_module(name, child)

    def _layers(self, root: str) -> list[nn.Module]:
        layers = self.get_submodule(f"{root}.layers") if self.end_layer > self.first_layer else None
        return [getattr(layers, str(i)) for i in range(self.first_layer, self.end_layer)]


class LlavaOnevisionEncoderStage(_Stage):
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


class LlavaOnevisionLLMStage(_Stage):
    """Qwen2 decoder layers ``[first, end)`` over packed samples; token embedding, the
    model's per-sample visual operations and ``image_newline`` on the first stage, final
    norm and head on the last."""

    visual_newline = None

    @property
    def hidden_size(self) -> int:
        return self.config.text_config.hidden_size

    def embed(self, token_ids: Tensor) -> Tensor:
        if not self.has_embed:
            raise ValueError("this LLM stage has no token embedding (not the first stage)")
        return self.get_submodule(f"{_TEXT}.embed_tokens")(token_ids)

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

    def merge_visual(
        self, input_embeds: Tensor, features: Tensor, text: Any, rows_per_sample: list[int]
    ) -> Tensor:
        if text.visual_items is None:
            raise ValueError(
                "LLaVA-OneVision needs each sample's visual items (TextInputs.visual_items) "
                "for its per-sample operations"
            )
        mask = text.image_token_mask
        cu = text.cu_seqlens.tolist()
        counts = torch.cat((mask.new_zeros(1, dtype=torch.long), mask.long().cumsum(0)))
        parts = []
        for k, (rows, sample) in enumerate(zip(features.split(rows_per_sample), zip(cu, cu[1:]))):
            if rows.shape[0] == 0:
                continue
            visual = self.visual_rows(rows, text.visual_items[k])
            placeholders = int(counts[sample[1]] - counts[sample[0]])
            if placeholders != visual.shape[0]:
                raise ValueError(
                    f"packed sample {k} has {placeholders} visual placeholder tokens but "
                    f"the model makes {visual.shape[0]} visual rows from its items "
                    f"{text.visual_items[k]}: the placeholders must follow the model's rule"
                )
            parts.append(visual)
        if not parts:
            return input_embeds
        return merge_visual_features(input_embeds, mask, torch.cat(parts))

    def hidden_states(self, input_embeds: Tensor, cu_seqlens: Tensor) -> Tensor:
        tokens = input_embeds.shape[0]
        text_config = self.config.text_config
        positions, mask, kwargs = packed_decoder_inputs(
            text_config, cu_seqlens, tokens, input_embeds.device
        )
        h = input_embeds[None]
        rotary = self.get_submodule(f"{_TEXT}.rotary_emb")
        position_embeddings = rotary(h, positions)
        for layer in self._layers(_TEXT):
            h = layer(
                h,
                attention_mask=mask,
                position_ids=positions,
                position_embeddings=position_embeddings,
                **kwargs,
            )
            h = h[0] if isinstance(h, tuple) else h
        return h[0]

    def forward(self, input_embeds: Tensor, cu_seqlens: Tensor) -> Tensor:
        return self.hidden_states(input_embeds, cu_seqlens)

    def loss(
        self, input_embeds: Tensor, cu_seqlens: Tensor, labels: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Next-token cross-entropy within each packed sample, summed (float32 logits, as
        transformers' loss), and the number of targets."""
        if not self.has_head:
            raise ValueError("this LLM stage has no head (not the last stage)")
        x = self.hidden_states(input_embeds, cu_seqlens)
        targets = next_token_targets(labels.to(x.device), cu_seqlens.to(x.device))
        keep = targets != IGNORE_INDEX
        hidden = self.get_submodule(f"{_TEXT}.norm")(x[keep])
        logits = self.get_submodule("lm_head")(hidden)
        sum_loss = F.cross_entropy(logits.float(), targets[keep], reduction="sum")
        return sum_loss, keep.sum()
