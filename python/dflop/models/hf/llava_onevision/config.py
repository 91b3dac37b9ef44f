"""What a LLaVA-OneVision config says about shapes: the features per visual unit and the
family's shape rules (:class:`~dflop.data.families.FamilySpec`, ``tiling="anyres"``). No
torch, no transformers: any object with the config's attributes will do."""

from __future__ import annotations

from typing import Any

from dflop.data.families import FamilySpec

__all__ = ["family_from_config", "tokens_per_unit"]


def tokens_per_unit(config: Any) -> int:
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
    tokens = tokens_per_unit(config)
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
