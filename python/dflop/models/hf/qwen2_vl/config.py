"""What a Qwen2-VL / Qwen2.5-VL config and its processors say about shapes: the family's
shape rules (:class:`~dflop.data.families.FamilySpec`, ``tiling="native"``) and a video
frame's pixel bounds. No torch, no transformers: the processor is passed in."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from dflop.data.families import QWEN2_VL, FamilySpec

__all__ = ["family_from_config", "video_pixels"]


def family_from_config(
    config: Any, image_processor: Any, video_bounds: tuple[int, int], name: str
) -> FamilySpec:
    """The shape rules of a model and its image processor (``tiling="native"``), called
    ``name``: patch and merge sizes from the config (the processor must agree), the image
    resize bounds from the processor, the video frames' from ``video_bounds``."""
    vision = config.vision_config
    for key, value in (
        ("patch_size", vision.patch_size),
        ("merge_size", vision.spatial_merge_size),
        ("temporal_patch_size", vision.temporal_patch_size),
    ):
        if int(getattr(image_processor, key)) != int(value):
            raise ValueError(
                f"the image processor's {key}={getattr(image_processor, key)} differs from "
                f"the model's {value}"
            )
    return replace(
        QWEN2_VL,
        name=name,
        patch_px=int(vision.patch_size),
        merge_size=int(vision.spatial_merge_size),
        temporal_patch=int(vision.temporal_patch_size),
        min_pixels=int(image_processor.size["shortest_edge"]),
        max_pixels=int(image_processor.size["longest_edge"]),
        video_min_pixels=video_bounds[0],
        video_max_pixels=video_bounds[1],
    )


def video_pixels(checkpoint_dir: str | None) -> tuple[int, int]:
    """(min, max) pixels of a video frame: the folder's video processor config
    (``video_preprocessor_config.json``, its ``size``), else Qwen2-VL's video processor
    defaults (128 x 28 x 28 to 768 x 28 x 28)."""
    if checkpoint_dir is not None:
        path = os.path.join(checkpoint_dir, "video_preprocessor_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                size = json.load(f).get("size") or {}
            if "shortest_edge" in size and "longest_edge" in size:
                return int(size["shortest_edge"]), int(size["longest_edge"])
    return 128 * 28 * 28, 768 * 28 * 28
