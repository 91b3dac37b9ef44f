"""What an InternVL config and its image processor say about shapes: the tile size, the
tokens per tile before and after the pixel shuffle, and the family's shape rules
(:class:`~dflop.data.families.FamilySpec`, ``tiling="dynamic"``). No torch, no
transformers: any objects with the config's and the processor's attributes will do."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dflop.data.families import INTERNVL, FamilySpec

__all__ = [
    "encoder_tokens_per_tile",
    "family_from_config",
    "patch_side",
    "processor_tiles",
    "shuffle_scale",
    "tile_px",
    "tokens_per_tile",
]


def _square(value: Any, name: str) -> int:
    """A side given as an int or a square ``(h, w)`` pair (InternVL's vision config keeps
    both forms)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or int(value[0]) != int(value[1]):
            raise ValueError(f"vision_config.{name}={value!r}: dflop supports square tiles")
        return int(value[0])
    return int(value)


def tile_px(config: Any) -> int:
    """The side of one tile in pixels (``vision_config.image_size``)."""
    return _square(config.vision_config.image_size, "image_size")


def patch_side(config: Any) -> int:
    """Patches per tile side (``image_size // patch_size``)."""
    patch = _square(config.vision_config.patch_size, "patch_size")
    tile = tile_px(config)
    if tile % patch:
        raise ValueError(f"vision_config.image_size={tile} is not a multiple of patch {patch}")
    return tile // patch


def shuffle_scale(config: Any) -> int:
    """``1 / downsample_ratio``: the pixel shuffle folds ``scale x scale`` patches into
    one LLM token (2 in the released models)."""
    ratio = float(config.downsample_ratio)
    scale = round(1 / ratio) if ratio > 0 else 0
    if scale < 1 or abs(scale * ratio - 1) > 1e-9:
        raise ValueError(
            f"downsample_ratio={config.downsample_ratio}: dflop supports 1 / N (0.5 in the "
            "released models)"
        )
    side = patch_side(config)
    if side % scale:
        raise ValueError(
            f"{side} patches per tile side do not fold by the pixel shuffle's {scale} "
            f"(downsample_ratio={config.downsample_ratio})"
        )
    return scale


def encoder_tokens_per_tile(config: Any) -> int:
    """Tokens the vision tower runs on per tile: the patches plus its CLS token."""
    return patch_side(config) ** 2 + 1


def tokens_per_tile(config: Any) -> int:
    """LLM tokens per tile: the patches after the pixel shuffle (the CLS token dropped,
    the ``default`` feature selection)."""
    return (patch_side(config) // shuffle_scale(config)) ** 2


def processor_tiles(image_processor: Any) -> tuple[int, int, int]:
    """``(tile px, min patches, max patches)`` of an InternVL image processor
    (``GotOcr2ImageProcessor``: ``size``, ``min_patches``, ``max_patches``)."""
    size = image_processor.size
    height = size["height"] if isinstance(size, dict) else getattr(size, "height", None)
    width = size["width"] if isinstance(size, dict) else getattr(size, "width", None)
    if height is None or width is None or int(height) != int(width):
        raise ValueError(f"the image processor's size={size!r}: expected a square height x width")
    return int(height), int(image_processor.min_patches), int(image_processor.max_patches)


def family_from_config(config: Any, image_processor: Any) -> FamilySpec:
    """The shape rules (:class:`~dflop.data.families.FamilySpec`, ``tiling="dynamic"``)
    of an InternVL config and its image processor, as transformers' ``InternVLProcessor``
    and model make them:

    * a single image: the processor's ``crop_to_patches`` (the closest-aspect grid of
      ``min_patches .. max_patches`` tiles, plus a thumbnail when the grid has more than
      one tile), ``tokens_per_tile`` LLM tokens per tile, ``<img>`` / ``</img>`` around
      them;
    * a multi-image sample: each image tiled the same way with ``max(1, max_patches //
      images)`` tiles (InternVL's training recipe; the converter passes that
      ``max_patches`` to the processor);
    * a video: every frame one tile (its CLS and patches through the tower), each frame's
      tokens inside ``<img>`` / ``</img>``.

    The tile size must be the same in the config and the processor."""
    tile = tile_px(config)
    size, low, high = processor_tiles(image_processor)
    if size != tile:
        raise ValueError(
            f"the image processor's tiles are {size} px, the model's vision_config.image_size "
            f"{tile}: they must agree"
        )
    encoder, llm = encoder_tokens_per_tile(config), tokens_per_tile(config)
    return replace(
        INTERNVL,
        name="internvl",
        tile_px=tile,
        encoder_tokens_per_tile=encoder,
        llm_tokens_per_tile=llm,
        min_tiles=low,
        max_tiles=high,
        use_thumbnail=True,
        image_extra_tokens=2,
        multi_image_max_tiles_split=True,
        video_encoder_tokens_per_frame=encoder,
        video_tokens_per_frame=llm,
        video_extra_tokens=0,
        frame_extra_tokens=2,
    )
