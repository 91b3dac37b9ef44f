"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``) under dflop's runtime.

A patch-sequence encoder: a visual *unit* is one temporal slice of an item (an image, or
one temporal patch of 2 frames of a video) of ``h x w`` patches, of any size. The vision
tower attends within each slice only (transformers' ``get_vision_attention_seqlens``
per ``t``) and its rotary positions depend only on the slice's ``(h, w)``, so encoding a
unit alone gives what the whole tower gives, and the runtime may split a sample's units
over encoder replicas. Pixels are one row per patch (``C x temporal x patch x patch``
values, as the Qwen2-VL processor makes them); encoder stages pass ``[patches, embed_dim]``;
the last one runs the 2 x 2 patch merger, so every 4 patches send one feature row to the
LLM (``token_merge = 4``).

LLM stages run the Qwen2 decoder over packed samples with the model's 3-D multimodal
rotary positions (mRoPE), computed per sample by the model's own ``get_rope_index`` from
its tokens and its items' grids and concatenated, so positions restart per sample; no
attention crosses samples. The first LLM stage scatters each sample's merged features
into its placeholder positions, checking their count.

Qwen2.5-VL adds window attention to the tower: the patches are reordered into windows
(per temporal slice, so still per unit) after the patch embedding, most blocks attend
within a window and ``fullatt_block_indexes`` within the whole slice, and the merged
features are put back in patch order after the merger. A video's temporal positions use
one second per temporal patch (``second_per_grid_ts`` is not carried yet).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dflop.models.hf.base import HFSpec, HFStage, decoder_architecture
from dflop.models.hf.common import require_transformers
from dflop.models.hf.qwen2_vl.config import family_from_config
from dflop.models.hf.qwen2_vl.config import video_pixels as _video_pixels

__all__ = [
    "Qwen25VLEncoderStage",
    "Qwen25VLLLMStage",
    "Qwen25VLSpec",
    "Qwen2VLEncoderStage",
    "Qwen2VLLLMStage",
    "Qwen2VLSpec",
]

_VISION = "model.visual"
_TEXT = "model.language_model"


class Qwen2VLSpec(HFSpec):
    """A Qwen2-VL model from its ``Qwen2VLConfig`` (random init for a seed) or a local
    checkpoint folder (``checkpoint_dir``, safetensors in the HF layout)."""

    model_type = "qwen2_vl"
    model_class_name = "Qwen2VLForConditionalGeneration"
    projector_prefixes = (f"{_VISION}.merger.",)

    def __init__(self, config: Any, checkpoint_dir: str | None = None) -> None:
        transformers = require_transformers()
        if getattr(config, "model_type", None) != self.model_type:
            raise ValueError(
                f"config.model_type={getattr(config, 'model_type', None)!r}: expected "
                f"{self.model_type!r}"
            )
        self.model_class = getattr(transformers, self.model_class_name)
        if config._attn_implementation is None:
            config._attn_implementation = "sdpa"
        vision, text = config.vision_config, config.text_config
        self.config = config
        self.checkpoint_dir = checkpoint_dir
        self.name = self.model_type
        self.encoder_layers = int(vision.depth)
        self.llm_layers = int(text.num_hidden_layers)
        self.tokens_per_unit = None  # units of any size
        self.token_merge = int(vision.spatial_merge_size) ** 2
        self.visual_newline = None
        self.image_shape = None
        self.max_seq_len = int(text.max_position_embeddings)
        self.encoder_stage = Qwen2VLEncoderStage
        self.llm_stage = Qwen2VLLLMStage
        self._processor = None
        self.family = self._family()

    def image_processor(self) -> Any:
        """The checkpoint folder's image processor, else the processor class's defaults
        for the config's patch, merge and temporal sizes."""
        from dflop.models.hf.common import local_image_processor

        if self._processor is None:
            processor = local_image_processor(self.checkpoint_dir)
            if processor is None:
                vision = self.config.vision_config
                module = require_transformers().models.qwen2_vl.image_processing_pil_qwen2_vl
                processor = module.Qwen2VLImageProcessorPil(
                    patch_size=vision.patch_size,
                    merge_size=vision.spatial_merge_size,
                    temporal_patch_size=vision.temporal_patch_size,
                )
            self._processor = processor
        return self._processor

    def _family(self) -> Any:
        """The shape rules of this model and its processor (``tiling="native"``): patch
        and merge sizes from the config, the resize bounds from the processor."""
        return family_from_config(
            self.config, self.image_processor(), self.video_pixels(), self.model_type
        )

    def profiled_encoder(
        self,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[nn.Module, tuple[int, int, int], int | None]:
        """The whole tower on units of a nominal square grid (the family's tile, at most
        the processor's largest image): pixels ``[U, 1, patches, patch values]``."""
        family = self.family
        side_px = min(family.tile_px, int(family.max_pixels**0.5))
        merge = family.merge_size
        side = max(merge, side_px // family.patch_px // merge * merge)
        tower = self.whole_module("encoder", seed=seed, device=device, dtype=dtype)
        vision = self.config.vision_config
        values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        return _NominalUnits(tower, side), (1, side * side, values), side * side

    def dataset_inputs(self) -> Any:
        """The converter of LLaVA-format records for this model: its image processor and
        the folder's tokenizer (else :func:`~dflop.models.hf.records.byte_encoder`)."""
        from dflop.models.hf.qwen2_vl.records import QwenVLRecords

        config = self.config
        encode, template = self.text_encoding(
            (
                config.image_token_id,
                config.video_token_id,
                config.vision_start_token_id,
                config.vision_end_token_id,
            )
        )
        return QwenVLRecords(self.config, self.image_processor(), encode, self.family, template)

    def video_pixels(self) -> tuple[int, int]:
        """(min, max) pixels of a video frame: the folder's video processor config
        (``video_preprocessor_config.json``, its ``size``), else Qwen2-VL's video
        processor defaults (128 x 28 x 28 to 768 x 28 x 28)."""
        return _video_pixels(self.checkpoint_dir)

    def architecture(self) -> tuple[Any, Any]:
        """The vision tower (``embed_dim`` wide, ``mlp_ratio`` MLP) with its patch merger
        (reads 4 patches of ``embed_dim``, one token per 4), and the Qwen2 decoder.
        ``tokens_per_unit`` is a 448 x 448 image's 1,024 patches (informational: costs
        use each sample's own)."""
        from dflop.data.costs import EncoderConfig

        vision, text = self.config.vision_config, self.config.text_config
        width, mlp = self._vision_width_and_mlp()
        merged = width * self.token_merge
        encoder = EncoderConfig(
            name=f"{self.name}.vision",
            hidden_size=width,
            num_layers=self.encoder_layers,
            intermediate_size=mlp,
            num_heads=vision.num_heads,
            tokens_per_unit=(448 // vision.patch_size) ** 2,
            patch_px=vision.patch_size,
            projector_input_size=merged,
            projector_token_ratio=1.0 / self.token_merge,
            projector_hidden_size=merged,
            default_family="llava-ov",
            frames_per_patch=vision.temporal_patch_size,
            learned_positions=False,  # 2D rotary positions
        )
        return encoder, decoder_architecture(f"{self.name}.text", text, self.llm_layers)

    def _vision_width_and_mlp(self) -> tuple[int, int]:
        """(tower width, MLP width as a 2-matrix MLP of the same parameters)."""
        vision = self.config.vision_config
        return vision.embed_dim, int(vision.embed_dim * vision.mlp_ratio)

    def stage_paths(
        self, module: str, first: int, end: int, first_stage: bool, last: bool
    ) -> list[str]:
        if module == "encoder":
            paths = [f"{_VISION}.patch_embed"] if first_stage else []
            paths += [f"{_VISION}.rotary_pos_emb"]
            paths += [f"{_VISION}.blocks.{i}" for i in range(first, end)]
            return paths + ([f"{_VISION}.merger"] if last else [])
        paths = [f"{_TEXT}.embed_tokens"] if first_stage else []
        paths += [f"{_TEXT}.layers.{i}" for i in range(first, end)]
        paths.append(f"{_TEXT}.rotary_emb")
        return paths + ([f"{_TEXT}.norm", "lm_head"] if last else [])


class _NominalUnits(nn.Module):
    """A patch-sequence tower called as a fixed-unit encoder (what the profiler times):
    ``[U, 1, side^2, patch values]`` in, merged features out."""

    def __init__(self, tower: nn.Module, side: int) -> None:
        super().__init__()
        self.tower = tower
        self.side = side

    def forward(self, pixels: Tensor) -> Tensor:
        units = pixels.shape[0]
        grid = torch.tensor([[1, self.side, self.side]] * units, device=pixels.device)
        return self.tower(pixels.reshape(-1, pixels.shape[-1]), grid)


class Qwen2VLEncoderStage(HFStage):
    """Vision blocks ``[first, end)`` over units of any size: patch rows in on the first
    stage, merged features ``[patches / 4, text hidden]`` out on the last."""

    tokens_per_unit = None

    @property
    def hidden_size(self) -> int:
        return self.config.vision_config.embed_dim

    mlp_linears: tuple[tuple[str, ...], tuple[str, ...]] = (("fc1",), ("fc2",))

    def tensor_parallel_plan(self) -> dict[str, str]:
        """The blocks' MLPs (column-, then row-parallel) and the merger's MLP; the
        attention stays replicated (its fused ``qkv`` projection interleaves q, k and v,
        which a column split would mix)."""
        colwise, rowwise = self.mlp_linears
        plan: dict[str, str] = {}
        for i in range(self.first_layer, self.end_layer):
            plan.update(self._linear_plan(f"{_VISION}.blocks.{i}.mlp", colwise, rowwise))
        if self.has_head:
            plan.update(self._linear_plan(f"{_VISION}.merger.mlp", ("0",), ("2",)))
        return plan

    def tensor_parallel_sizes(self) -> list[tuple[str, int]]:
        vision = self.config.vision_config
        mlp = (
            self.get_submodule(f"{_VISION}.blocks.{self.first_layer}.mlp")
            if (self.end_layer > self.first_layer)
            else None
        )
        sizes = []
        if mlp is not None:
            first = getattr(mlp, self.mlp_linears[0][0])
            sizes.append(("vision MLP width", int(first.out_features)))
        if self.has_head:
            merged = self.hidden_size * vision.spatial_merge_size**2
            sizes.append(("vision merger width", int(merged)))
        return sizes

    def recompute_blocks(self) -> list[nn.Module]:
        return list(self._blocks())

    def _blocks(self) -> list[Any]:
        if self.end_layer == self.first_layer:
            return []
        blocks = self.get_submodule(f"{_VISION}.blocks")
        return [getattr(blocks, str(i)) for i in range(self.first_layer, self.end_layer)]

    @property
    def output_size(self) -> int:
        return self.config.text_config.hidden_size

    def forward(self, x: Tensor, unit_grid: Tensor) -> Tensor:
        from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

        vision = self.config.vision_config
        grid = unit_grid.to(device=x.device, dtype=torch.long)
        if self.has_embed:
            x = self.get_submodule(f"{_VISION}.patch_embed")(x)
        positions = get_vision_position_ids(grid, vision.spatial_merge_size)
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, vision)
        rotary = self.get_submodule(f"{_VISION}.rotary_pos_emb")
        position_embeddings = rotary(x, positions)
        blocks = (
            self.get_submodule(f"{_VISION}.blocks") if self.end_layer > self.first_layer else None
        )
        for i in range(self.first_layer, self.end_layer):
            x = getattr(blocks, str(i))(
                x,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                position_embeddings=position_embeddings,
            )
        if not self.has_head:
            return x
        return self.get_submodule(f"{_VISION}.merger")(x)


class Qwen2VLLLMStage(HFStage):
    """Qwen2 decoder layers ``[first, end)`` over packed samples with per-sample mRoPE
    positions; token embedding and the visual scatter on the first stage, final norm and
    head on the last."""

    visual_newline = None
    model_class_name = "Qwen2VLModel"

    def position_ids(self, text: Any) -> Tensor:
        """``[3, T]``: each packed sample's mRoPE positions by the model's own
        ``get_rope_index`` (text positions restart per sample; an image's tokens take
        (t, h, w) positions after the text before it)."""
        model = getattr(require_transformers(), self.model_class_name)
        if text.visual_items is None:
            raise ValueError("Qwen2-VL needs each sample's visual items (their grids)")
        image_id, video_id = self.config.image_token_id, self.config.video_token_id
        cu = text.cu_seqlens.tolist()
        parts = []
        for k, (start, end) in enumerate(zip(cu, cu[1:])):
            ids = text.token_ids[start:end][None]
            kinds = (ids == image_id).int() + 2 * (ids == video_id).int()
            items = text.visual_items[k]
            grids = {
                kind: torch.tensor([item.grid_thw for item in items if item.kind == name])
                for kind, name in ((1, "image"), (2, "video"))
            }
            pos, _ = model.get_rope_index(
                self,
                ids,
                kinds,
                image_grid_thw=grids[1].reshape(-1, 3) if len(grids[1]) else None,
                video_grid_thw=grids[2].reshape(-1, 3) if len(grids[2]) else None,
            )
            parts.append(pos[:, 0])
        return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)

    def get_vision_position_ids(self, *args: Any, **kwargs: Any) -> Tensor:
        # get_rope_index calls it on the model; it uses nothing of the model.
        model = getattr(require_transformers(), self.model_class_name)
        return model.get_vision_position_ids(self, *args, **kwargs)

    def _rotary_positions(self, packed: Tensor, position_ids: Tensor | None) -> Tensor:
        if position_ids is None:  # text only (e.g. profiling): the three axes agree
            return packed[None].expand(3, -1, -1)
        return position_ids.to(packed.device)[:, None, :]

    def forward(self, input_embeds: Tensor, cu_seqlens: Tensor) -> Tensor:
        return self.hidden_states(input_embeds, cu_seqlens)


# ----------------------------------------------------------------------- Qwen2.5-VL


class Qwen25VLEncoderStage(Qwen2VLEncoderStage):
    """Qwen2.5-VL's tower: window attention (see the module docstring)."""

    mlp_linears = (("gate_proj", "up_proj"), ("down_proj",))

    @property
    def hidden_size(self) -> int:
        return self.config.vision_config.hidden_size

    def forward(self, x: Tensor, unit_grid: Tensor) -> Tensor:
        from transformers.utils.generic import get_max_seqlen
        from transformers.vision_utils import (
            get_vision_attention_seqlens,
            get_vision_position_ids,
            get_vision_window_index,
        )

        vision = self.config.vision_config
        merge = vision.spatial_merge_size
        grid = unit_grid.to(device=x.device, dtype=torch.long)
        positions = get_vision_position_ids(grid, merge)
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, vision)
        window_index, cu_window = get_vision_window_index(
            grid,
            spatial_merge_size=merge,
            window_size=vision.window_size,
            patch_size=vision.patch_size,
        )
        window_index = window_index.to(x.device)
        cu_window = cu_window.to(x.device)
        max_window = get_max_seqlen(cu_window, vision, kwargs={}, kwarg_name="max_window_seqlen")

        def windowed(t: Tensor) -> Tensor:  # patch order -> window order
            return t.reshape(t.shape[0] // merge**2, merge**2, -1)[window_index].reshape(
                t.shape[0], -1
            )

        if self.has_embed:  # later stages receive the window order
            x = windowed(self.get_submodule(f"{_VISION}.patch_embed")(x))
        rotary = self.get_submodule(f"{_VISION}.rotary_pos_emb")
        position_embeddings = tuple(windowed(f) for f in rotary(x, positions))
        full = set(vision.fullatt_block_indexes)
        for i, block in zip(range(self.first_layer, self.end_layer), self._blocks()):
            x = block(
                x,
                cu_seqlens=cu_seqlens if i in full else cu_window,
                max_seqlen=max_seqlen if i in full else max_window,
                position_embeddings=position_embeddings,
            )
        if not self.has_head:
            return x
        merged = self.get_submodule(f"{_VISION}.merger")(x)
        return merged[torch.argsort(window_index)]


class Qwen25VLLLMStage(Qwen2VLLLMStage):
    model_class_name = "Qwen2_5_VLModel"


class Qwen25VLSpec(Qwen2VLSpec):
    """A Qwen2.5-VL model (``Qwen2_5_VLConfig``), as :class:`Qwen2VLSpec`."""

    model_type = "qwen2_5_vl"
    model_class_name = "Qwen2_5_VLForConditionalGeneration"

    def __init__(self, config: Any, checkpoint_dir: str | None = None) -> None:
        super().__init__(config, checkpoint_dir)
        self.encoder_stage = Qwen25VLEncoderStage
        self.llm_stage = Qwen25VLLLMStage

    def _vision_width_and_mlp(self) -> tuple[int, int]:
        # A SwiGLU MLP (3 matrices) counted as a 2-matrix MLP of the same parameters.
        vision = self.config.vision_config
        return vision.hidden_size, vision.intermediate_size * 3 // 2
