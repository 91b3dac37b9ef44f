"""Model-family shape rules: how a raw sample (image sizes, video frames, text) becomes a shape.

The rules are *data*: one frozen :class:`FamilySpec` per model family, interpreted by the
tiling rule it names (``FamilySpec.tiling``: one :class:`TilingRule` object per rule in
:data:`TILING_RULES`, found by :func:`tiling_rule`) and the pure, numpy-vectorised
functions below. Both the embedded synthetic workload
(:mod:`dflop.data.synthetic`) and the data profiler turn raw sample descriptors into
:class:`~dflop.data.shapes.SampleShapes` through :func:`shapes_from_descriptors`, so there
is exactly one implementation of each rule.

Families
--------
``"llava-ov"`` -- LLaVA-OneVision, SigLIP at 384 px, ``anyres_max_9``:

* Single image: the image is fitted to the best grid among ``1x1 .. 6x6`` crops of 384 px
  (:func:`anyres_grid`: maximise the effective resolution after downscaling the image to
  fit the grid, then minimise the wasted area; the first candidate wins exact ties, with
  candidates ordered columns-major ``(1,1), (1,2), .., (6,6)`` as ``(cols, rows)``). The
  encoder runs on the base image plus every crop: ``1 + rows * cols`` tiles (2 to 37) of
  729 tokens (27 x 27). The LLM sees the base image's 729 tokens plus the grid features
  (``27 rows x 27 cols`` per crop), unpadded back to the image's aspect ratio, bilinearly
  downsampled when they exceed ``llm_max_crops`` (9) crops' worth by more than a factor
  ``downsample_threshold`` (1.1) in scale, plus one newline token per feature row
  (:func:`anyres_llm_tokens`). A 2304 x 2304 page costs the encoder 37 tiles but the LLM
  only 7,371 tokens.
* Multi-image: every image is one 384 px tile: 729 encoder tokens, 729 + 1 (newline) LLM
  tokens.
* Video: at most 32 frames (uniformly sampled when longer), 729 encoder tokens per frame,
  2x2 pooling to 196 LLM tokens per frame, plus one newline token per video.

``"internvl"`` -- InternVL 1.5/2-style dynamic tiling, InternViT at 448 px:

* Single image: tiles of 448 px on the grid ``(cols, rows)`` with ``min_tiles <= cols * rows
  <= max_tiles`` (12) whose aspect ratio is closest to the image's (an exact tie goes to
  the larger grid when the image's area exceeds half of the grid's pixel area), plus a
  448 px thumbnail when there is more than one tile (:func:`dynamic_tiles`). 1,025 encoder
  tokens per tile (InternViT encodes a CLS token with the 32 x 32 patches of 14 px and
  drops it only afterwards), 256 LLM tokens per tile after pixel shuffle, plus
  ``<img>``/``</img>``.
* Multi-image: each image is tiled with ``max(1, max_tiles // num_images)`` tiles.
* Video: at most 32 frames, one 448 px tile (256 LLM tokens) per frame, plus
  ``<img>``/``</img>`` per frame.

Text-only samples cost the encoder nothing in every family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from dflop.data.shapes import Modality, SampleShapes
from dflop.errors import InputTypeError

__all__ = [
    "FAMILIES",
    "TILING_RULES",
    "AnyresTiling",
    "DynamicTiling",
    "FamilySpec",
    "ImageUnit",
    "NativeTiling",
    "TilingRule",
    "anyres_grid",
    "anyres_llm_tokens",
    "dynamic_tiles",
    "get_family",
    "image_shapes",
    "multi_image_shapes",
    "native_grid",
    "native_patches",
    "native_video_patches",
    "shapes_from_descriptors",
    "tiling_rule",
    "video_shapes",
]

_DEDUPE_MIN_IMAGES = 256


@dataclass(frozen=True)
class FamilySpec:
    """Shape rules of one model family (all token counts are per tile/frame unless noted).

    Attributes:
        name: registry name (``get_family(name)``).
        tiling: the name of its rule in :data:`TILING_RULES`: ``"anyres"``
            (LLaVA-NeXT/OneVision grid of crops + base image), ``"dynamic"`` (InternVL
            closest-aspect-ratio tiling + thumbnail) or ``"native"`` (Qwen-VL: the image
            resized to multiples of ``patch_px x merge_size`` within ``[min_pixels,
            max_pixels]``, one unit of all its patches; a video one unit per
            ``temporal_patch`` frames). A string, as shape files and plans store it.
        tile_px: side of one square tile in pixels (384 for SigLIP-384, 448 for InternViT).
        encoder_tokens_per_tile: tokens the vision encoder runs on per tile (729 = 27^2,
            1025 = 32^2 + InternViT's CLS token).
        llm_tokens_per_tile: tokens per tile the LLM sees after projection (729; 256 after
            InternVL's pixel shuffle).
        feature_side: anyres only: features per tile side after projection (27).
        max_grid: anyres only: grids ``1x1 .. max_grid x max_grid`` are considered (6).
        llm_max_crops: anyres only: ``anyres_max_N``'s N, the number of crops' worth of
            grid features the LLM receives at most (9).
        downsample_threshold: anyres only: the grid features are downsampled when their
            linear scale over ``llm_max_crops`` crops' worth exceeds this (1.1).
        newline_tokens_per_row: anyres only: tokens appended to every feature row (1).
        single_tile_newline_tokens: tokens appended to an image processed as one tile
            (multi-image samples in LLaVA-OneVision get one newline token each).
        min_tiles: dynamic only: fewest tiles of a grid (1).
        max_tiles: dynamic only: most tiles of a grid (12).
        use_thumbnail: dynamic only: add a thumbnail tile when the grid has > 1 tile.
        image_extra_tokens: LLM tokens added around every image (``<img>``, ``</img>``).
        multi_image_max_tiles_split: dynamic only: in multi-image samples each image gets
            ``max(1, max_tiles // num_images)`` tiles; if False (anyres families) every
            image is exactly one tile.
        max_frames: videos longer than this are uniformly sampled down to it (32).
        video_encoder_tokens_per_frame: encoder tokens per video frame (729 / 1025).
        video_tokens_per_frame: LLM tokens per frame after pooling (196 = 14^2 after 2x2
            bilinear pooling of 27^2; 256 for InternVL).
        video_extra_tokens: LLM tokens added once per video (LLaVA's newline: 1).
        frame_extra_tokens: LLM tokens added per frame (InternVL's ``<img>``/``</img>``: 2).
        patch_px, merge_size, min_pixels, max_pixels, temporal_patch: native only: the
            patch side, the merger's side (``merge_size^2`` patches per LLM token), the
            image resize bounds and the frames per video unit.
        video_min_pixels, video_max_pixels: native only: a video frame's resize bounds
            (Qwen2-VL's video processor: 128 x 28^2 to 768 x 28^2). A video whose first
            frame's size is known (frames as image files) is patched at that size within
            these bounds; otherwise at the nominal ``video_encoder_tokens_per_frame``.
    """

    name: str
    tiling: str
    tile_px: int
    encoder_tokens_per_tile: int
    llm_tokens_per_tile: int
    feature_side: int = 27
    max_grid: int = 6
    llm_max_crops: int = 9
    downsample_threshold: float = 1.1
    newline_tokens_per_row: int = 1
    single_tile_newline_tokens: int = 0
    min_tiles: int = 1
    max_tiles: int = 12
    use_thumbnail: bool = True
    image_extra_tokens: int = 0
    multi_image_max_tiles_split: bool = False
    max_frames: int = 32
    video_encoder_tokens_per_frame: int = 729
    video_tokens_per_frame: int = 196
    video_extra_tokens: int = 0
    frame_extra_tokens: int = 0
    patch_px: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    temporal_patch: int = 2
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28

    def __post_init__(self) -> None:
        if not isinstance(self.tiling, str) or self.tiling not in TILING_RULES:
            raise ValueError(
                f"FamilySpec.tiling={self.tiling!r} is not one of {', '.join(TILING_RULES)}"
            )
        positive = (
            "tile_px",
            "encoder_tokens_per_tile",
            "llm_tokens_per_tile",
            "feature_side",
            "max_grid",
            "llm_max_crops",
            "min_tiles",
            "max_tiles",
            "max_frames",
            "video_encoder_tokens_per_frame",
            "video_tokens_per_frame",
            "patch_px",
            "merge_size",
            "min_pixels",
            "max_pixels",
            "temporal_patch",
            "video_min_pixels",
            "video_max_pixels",
        )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "tiling", "use_thumbnail", "multi_image_max_tiles_split"):
                continue
            if f.name == "downsample_threshold":
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(
                        f"FamilySpec.downsample_threshold={value!r} must be finite and > 0"
                    )
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise InputTypeError(f"FamilySpec.{f.name}={value!r} must be an int")
            lowest = 1 if f.name in positive else 0
            if value < lowest:
                raise ValueError(f"FamilySpec.{f.name}={value} must be >= {lowest}")
        if self.min_tiles > self.max_tiles:
            raise ValueError(
                f"FamilySpec.min_tiles={self.min_tiles} exceeds max_tiles={self.max_tiles}"
            )


# --------------------------------------------------------------------------- tiling rules


@dataclass(frozen=True)
class ImageUnit:
    """One encoder unit of a sample's images as a renderer cuts it
    (:meth:`TilingRule.image_units`): ``kind`` ``"full"`` (image ``item`` resized to one
    tile) or ``"anyres"`` / ``"dynamic"`` (crop ``index``, row-major, of image ``item``
    laid on a ``rows x cols`` grid canvas of tiles, as that rule lays it)."""

    item: int
    kind: str
    rows: int = 1
    cols: int = 1
    index: int = 0


class TilingRule:
    """How one ``FamilySpec.tiling`` turns images and videos into encoder units and LLM
    tokens: one object per rule in :data:`TILING_RULES`, found by :func:`tiling_rule`.
    The methods take a :class:`FamilySpec` of the rule and validated arrays (the public
    functions below validate, then call them).

    The defaults are the tile rules' (anyres, dynamic): units of ``tile_px`` tiles of
    ``encoder_tokens_per_tile`` tokens, multi-image samples by
    ``multi_image_max_tiles_split``, a video one unit per sampled frame.
    """

    name: str = ""
    video_frame_sizes: bool = False
    """Whether a video's units depend on its frame size (else the nominal
    ``video_encoder_tokens_per_frame``)."""

    def image_shapes(
        self, spec: FamilySpec, w: np.ndarray, h: np.ndarray, max_tiles: object | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(encoder units, LLM visual tokens)`` of single images (widths ``w``, heights
        ``h``: (N,) float64); ``max_tiles`` a tile limit (int or (N,)) where the rule has
        one."""
        raise NotImplementedError

    def multi_image_shapes(
        self,
        spec: FamilySpec,
        idx: np.ndarray,
        w: np.ndarray,
        h: np.ndarray,
        count: np.ndarray,
        num_samples: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(encoder units, LLM visual tokens)`` per sample of multi-image samples: image
        ``k`` (``w[k]`` x ``h[k]``) belongs to sample ``idx[k]``, sample ``s`` has
        ``count[s]`` images."""
        if not spec.multi_image_max_tiles_split:
            per_image_tokens = (
                spec.llm_tokens_per_tile + spec.single_tile_newline_tokens + spec.image_extra_tokens
            )
            return count, count * per_image_tokens
        per_image_limit = np.maximum(1, spec.max_tiles // np.maximum(count[idx], 1))
        units_k, tokens_k = self.image_shapes(spec, w, h, max_tiles=per_image_limit)
        units = np.bincount(idx, weights=units_k, minlength=num_samples).astype(np.int64)
        tokens = np.bincount(idx, weights=tokens_k, minlength=num_samples).astype(np.int64)
        return units, tokens

    def image_unit_tokens(self, spec: FamilySpec, w: np.ndarray, h: np.ndarray) -> np.ndarray:
        """Encoder tokens of one unit of each image, (N,) int64."""
        return np.full(w.shape, spec.encoder_tokens_per_tile, dtype=np.int64)

    def video_shapes(
        self,
        spec: FamilySpec,
        frames: np.ndarray,
        frame_width_px: object | None = None,
        frame_height_px: object | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(encoder units, LLM visual tokens)`` of videos of ``frames`` sampled frames
        (at most ``max_frames`` each), their frame sizes when known (read only by a rule
        with :attr:`video_frame_sizes`)."""
        tokens = (
            frames * (spec.video_tokens_per_frame + spec.frame_extra_tokens)
            + spec.video_extra_tokens
        )
        return frames, tokens

    def video_unit_tokens(
        self,
        spec: FamilySpec,
        num_videos: int,
        frame_width_px: np.ndarray | None = None,
        frame_height_px: np.ndarray | None = None,
    ) -> np.ndarray:
        """Encoder tokens of one unit of each of ``num_videos`` videos, (N,) int64."""
        return np.full(num_videos, spec.video_encoder_tokens_per_frame, dtype=np.int64)

    def image_units(
        self, spec: FamilySpec, sizes: list[tuple[float, float]], multi_image: bool
    ) -> list[ImageUnit]:
        """Every encoder unit of one sample's images (``(width_px, height_px)`` each; a
        ``multi_image`` sample or a single image), in encoding order: what a renderer of
        fixed-size tiles cuts (:class:`~dflop.runtime.dataset_batch.DatasetBatch`)."""
        raise NotImplementedError


class AnyresTiling(TilingRule):
    """LLaVA-NeXT/OneVision: a single image is its base image plus the crops of its best
    anyres grid (:func:`anyres_grid`, :func:`anyres_llm_tokens`); a multi-image sample's
    images one base tile each."""

    name = "anyres"

    def image_shapes(
        self, spec: FamilySpec, w: np.ndarray, h: np.ndarray, max_tiles: object | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        inverse = None
        if w.shape[0] > _DEDUPE_MIN_IMAGES:
            # Real and synthetic data repeat sizes a lot (640x480, 1920x1080, ...): apply
            # the rules once per distinct integer size.
            wi = w.astype(np.int64)
            hi = h.astype(np.int64)
            if (wi == w).all() and (hi == h).all() and max(wi.max(), hi.max()) < 2**31:
                keys, inverse = np.unique((wi << 32) | hi, return_inverse=True)
                w = (keys >> 32).astype(np.float64)
                h = (keys & 0xFFFFFFFF).astype(np.float64)
        rows, cols = anyres_grid(w, h, tile_px=spec.tile_px, max_grid=spec.max_grid)
        units = 1 + rows * cols
        tokens = anyres_llm_tokens(w, h, rows, cols, spec)
        if inverse is not None:
            inverse = inverse.reshape(-1)
            units, tokens = units[inverse], tokens[inverse]
        return units, tokens

    def image_units(
        self, spec: FamilySpec, sizes: list[tuple[float, float]], multi_image: bool
    ) -> list[ImageUnit]:
        if multi_image:
            return [ImageUnit(k, "full") for k in range(len(sizes))]
        w, h = sizes[0]
        rows_a, cols_a = anyres_grid(w, h, tile_px=spec.tile_px, max_grid=spec.max_grid)
        rows, cols = int(rows_a[0]), int(cols_a[0])
        grid = [ImageUnit(0, "anyres", rows, cols, k) for k in range(rows * cols)]
        return [ImageUnit(0, "full"), *grid]


class DynamicTiling(TilingRule):
    """InternVL: each image on the closest-aspect grid of ``tile_px`` tiles plus a
    thumbnail (:func:`dynamic_tiles`); in multi-image samples with
    ``multi_image_max_tiles_split`` each image gets ``max(1, max_tiles // images)`` tiles."""

    name = "dynamic"

    def image_shapes(
        self, spec: FamilySpec, w: np.ndarray, h: np.ndarray, max_tiles: object | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        _, _, tiles = dynamic_tiles(
            w,
            h,
            tile_px=spec.tile_px,
            min_tiles=spec.min_tiles,
            max_tiles=spec.max_tiles if max_tiles is None else max_tiles,
            use_thumbnail=spec.use_thumbnail,
        )
        return tiles, tiles * spec.llm_tokens_per_tile + spec.image_extra_tokens

    def image_units(
        self, spec: FamilySpec, sizes: list[tuple[float, float]], multi_image: bool
    ) -> list[ImageUnit]:
        return _dynamic_units(spec, sizes, multi_image)


class NativeTiling(TilingRule):
    """Qwen-VL: an image is one unit of all its patches at its resized size
    (:func:`native_grid`), ``merge_size^2`` patches per LLM token; a video one unit per
    ``temporal_patch`` frames, patched at its frame size when known.

    :meth:`image_units`: a renderer of fixed-size tiles cuts a native image as the
    dynamic rule does (a thumbnail and a grid of ``tile_px`` tiles)."""

    name = "native"
    video_frame_sizes = True

    def image_shapes(
        self, spec: FamilySpec, w: np.ndarray, h: np.ndarray, max_tiles: object | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        patches = native_patches(spec, w, h)
        tokens = patches // spec.merge_size**2 + spec.image_extra_tokens
        return np.ones_like(patches), tokens

    def multi_image_shapes(
        self,
        spec: FamilySpec,
        idx: np.ndarray,
        w: np.ndarray,
        h: np.ndarray,
        count: np.ndarray,
        num_samples: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        _, tokens_k = self.image_shapes(spec, w, h)
        tokens = np.bincount(idx, weights=tokens_k, minlength=num_samples).astype(np.int64)
        return count, tokens

    def image_unit_tokens(self, spec: FamilySpec, w: np.ndarray, h: np.ndarray) -> np.ndarray:
        return native_patches(spec, w, h)

    def video_shapes(
        self,
        spec: FamilySpec,
        frames: np.ndarray,
        frame_width_px: object | None = None,
        frame_height_px: object | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        units = -(-frames // spec.temporal_patch)
        if frame_width_px is None or frame_height_px is None:
            per_unit = np.full(frames.shape, spec.video_tokens_per_frame, dtype=np.int64)
        else:
            patches = native_video_patches(spec, frame_width_px, frame_height_px)
            per_unit = patches // spec.merge_size**2
        return units, units * per_unit + spec.video_extra_tokens

    def video_unit_tokens(
        self,
        spec: FamilySpec,
        num_videos: int,
        frame_width_px: np.ndarray | None = None,
        frame_height_px: np.ndarray | None = None,
    ) -> np.ndarray:
        if frame_width_px is None or frame_height_px is None:
            return super().video_unit_tokens(spec, num_videos)
        return native_video_patches(spec, frame_width_px, frame_height_px)

    def image_units(
        self, spec: FamilySpec, sizes: list[tuple[float, float]], multi_image: bool
    ) -> list[ImageUnit]:
        return _dynamic_units(spec, sizes, multi_image)


def _dynamic_units(
    spec: FamilySpec, sizes: list[tuple[float, float]], multi_image: bool
) -> list[ImageUnit]:
    """Each image's thumbnail (first, so that a cap keeps it) and dynamic grid tiles."""
    limit = spec.max_tiles
    if multi_image and spec.multi_image_max_tiles_split:
        limit = max(1, spec.max_tiles // len(sizes))
    units: list[ImageUnit] = []
    for k, (w, h) in enumerate(sizes):
        rows_a, cols_a, tiles_a = dynamic_tiles(
            w,
            h,
            tile_px=spec.tile_px,
            min_tiles=spec.min_tiles,
            max_tiles=limit,
            use_thumbnail=spec.use_thumbnail,
        )
        rows, cols, tiles = int(rows_a[0]), int(cols_a[0]), int(tiles_a[0])
        grid = [ImageUnit(k, "dynamic", rows, cols, j) for j in range(rows * cols)]
        if tiles > rows * cols:
            grid.insert(0, ImageUnit(k, "full"))
        units.extend(grid)
    return units


TILING_RULES: dict[str, TilingRule] = {
    rule.name: rule for rule in (AnyresTiling(), DynamicTiling(), NativeTiling())
}
"""The tiling rules by name: the values ``FamilySpec.tiling`` may take."""


def tiling_rule(spec: FamilySpec | str) -> TilingRule:
    """The :class:`TilingRule` of a family (a :class:`FamilySpec` or a family name)."""
    return TILING_RULES[get_family(spec).tiling]


LLAVA_OV = FamilySpec(
    name="llava-ov",
    tiling="anyres",
    tile_px=384,
    encoder_tokens_per_tile=729,
    llm_tokens_per_tile=729,
    feature_side=27,
    max_grid=6,
    llm_max_crops=9,
    downsample_threshold=1.1,
    newline_tokens_per_row=1,
    single_tile_newline_tokens=1,
    image_extra_tokens=0,
    multi_image_max_tiles_split=False,
    max_frames=32,
    video_encoder_tokens_per_frame=729,
    video_tokens_per_frame=196,
    video_extra_tokens=1,
    frame_extra_tokens=0,
)

INTERNVL = FamilySpec(
    name="internvl",
    tiling="dynamic",
    tile_px=448,
    encoder_tokens_per_tile=1025,
    llm_tokens_per_tile=256,
    min_tiles=1,
    max_tiles=12,
    use_thumbnail=True,
    image_extra_tokens=2,
    multi_image_max_tiles_split=True,
    max_frames=32,
    video_encoder_tokens_per_frame=1025,
    video_tokens_per_frame=256,
    video_extra_tokens=0,
    frame_extra_tokens=2,
)

QWEN2_VL = FamilySpec(
    name="qwen2-vl",
    tiling="native",
    tile_px=448,  # nominal: a 448 x 448 image is 32 x 32 patches
    encoder_tokens_per_tile=1024,
    llm_tokens_per_tile=256,
    image_extra_tokens=2,  # <|vision_start|> ... <|vision_end|>
    max_frames=32,
    video_encoder_tokens_per_frame=1024,
    video_tokens_per_frame=256,
    video_extra_tokens=2,
    patch_px=14,
    merge_size=2,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 1280,
    temporal_patch=2,
)

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (LLAVA_OV, INTERNVL, QWEN2_VL)}
"""Registry of the built-in families, by name."""


def get_family(name: str | FamilySpec) -> FamilySpec:
    """The :class:`FamilySpec` called ``name`` (a spec is returned unchanged).

    Raises:
        ValueError: unknown name (the message lists the known names).
    """
    if isinstance(name, FamilySpec):
        return name
    if not isinstance(name, str):
        raise InputTypeError(f"family must be a str or FamilySpec, got {type(name).__name__}")
    try:
        return FAMILIES[name]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise ValueError(f"unknown family {name!r}; known families: {known}") from None


# --------------------------------------------------------------------------- helpers


def _as_sizes(
    width_px: object, height_px: object, names: tuple[str, str] = ("width_px", "height_px")
) -> tuple[np.ndarray, np.ndarray]:
    w = np.atleast_1d(np.asarray(width_px, dtype=np.float64))
    h = np.atleast_1d(np.asarray(height_px, dtype=np.float64))
    if w.shape != h.shape or w.ndim != 1:
        raise ValueError(
            f"{names[0]} and {names[1]} must be 1-D of equal length, got shapes {w.shape} "
            f"and {h.shape}"
        )
    for arg, arr in zip(names, (w, h)):
        bad = np.flatnonzero(~(np.isfinite(arr) & (arr >= 1)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{arg}[{i}]={arr[i].item()!r} must be a finite size >= 1 pixel")
    return w, h


def _as_int_array(arg: str, value: object, lowest: int) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(value))
    if arr.ndim != 1:
        raise ValueError(f"{arg} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating):
            raise InputTypeError(f"{arg} must hold integers, got dtype {arr.dtype}")
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{arg}[{i}]={arr[i].item()!r} is not an integer")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < lowest)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{arg}[{i}]={arr[i]} must be >= {lowest}")
    return arr


# --------------------------------------------------------------------------- anyres


def anyres_grid(
    width_px: object, height_px: object, *, tile_px: int = 384, max_grid: int = 6
) -> tuple[np.ndarray, np.ndarray]:
    """Best-fitting ``rows x cols`` grid of ``tile_px`` crops for each image (anyres).

    For every candidate grid ``(cols, rows)`` in ``1..max_grid`` squared, the image is
    scaled (up or down) to fit the grid's canvas keeping its aspect ratio; the effective
    resolution is the scaled image's pixel count (truncated to whole pixels), capped at
    the original pixel count. The best grid maximises the effective resolution, then
    minimises the wasted canvas area (canvas area - effective resolution); exact ties go
    to the first candidate in ``(cols, rows)`` order ``(1,1), (1,2), .., (max_grid,
    max_grid)``.

    Args:
        width_px, height_px: image sizes, scalars or 1-D arrays of equal length.

    Returns:
        ``(rows, cols)``, two (N,) int64 arrays.
    """
    w, h = _as_sizes(width_px, height_px)
    n = w.shape[0]
    if isinstance(max_grid, bool) or int(max_grid) != max_grid or max_grid < 1:
        raise ValueError(f"max_grid={max_grid!r} must be an int >= 1")
    if isinstance(tile_px, bool) or not tile_px > 0:
        raise ValueError(f"tile_px={tile_px!r} must be > 0")
    g = int(max_grid)
    tile = float(tile_px)
    area = w * h
    # Only 2 * max_grid of the max_grid^2 candidates can win: for a column count c, grids
    # taller than r*(c) (the fewest rows whose canvas no longer binds) keep the same scale,
    # hence the same effective resolution, with more waste; likewise for a row count r
    # and c*(r). The full scan's first best candidate lies in that set, so scanning the
    # set with the full scan's tie-break (its order) gives exactly the full scan's answer.
    # Scales use the same float expressions as the full scan: (count * tile_px) / size.
    best_eff = np.full(n, -1.0)
    best_waste = np.full(n, np.inf)
    best_order = np.zeros(n)
    for k in range(1, g + 1):
        for by_col in (True, False):
            if by_col:  # c = k, r = r*(k)
                own_scale = (k * tile) / w
                other = _fewest_reaching(own_scale, h, tile, k * h / w, g)
                scale = np.minimum(own_scale, (other * tile) / h)
                canvas = (k * tile) * (other * tile)
                order = (k - 1) * g + (other - 1)
            else:  # r = k, c = c*(k)
                own_scale = (k * tile) / h
                other = _fewest_reaching(own_scale, w, tile, k * w / h, g)
                scale = np.minimum((other * tile) / w, own_scale)
                canvas = (other * tile) * (k * tile)
                order = (other - 1) * g + (k - 1)
            eff = np.minimum(np.floor(w * scale) * np.floor(h * scale), area)
            waste = canvas - eff
            better = (eff > best_eff) | (
                (eff == best_eff)
                & ((waste < best_waste) | ((waste == best_waste) & (order < best_order)))
            )
            best_eff = np.where(better, eff, best_eff)
            best_waste = np.where(better, waste, best_waste)
            best_order = np.where(better, order, best_order)
    best = best_order.astype(np.int64)
    return best % g + 1, best // g + 1


def _fewest_reaching(
    own_scale: np.ndarray, other_px: np.ndarray, tile: float, estimate: np.ndarray, g: int
) -> np.ndarray:
    """Fewest tiles ``i`` in ``1..g`` along the other axis with ``(i * tile) / other_px >=
    own_scale`` (``g`` when none), as float64 counts.

    ``estimate`` is the real-number answer's argument (``ceil`` of it is exact up to float
    error); a +-1 fix-up with the exact float comparison makes it exact.
    """
    guess = np.clip(np.ceil(estimate), 1, g)
    too_few = ((guess * tile) / other_px < own_scale) & (guess < g)
    guess = guess + too_few
    can_lower = (guess > 1) & (((guess - 1) * tile) / other_px >= own_scale)
    return guess - can_lower


def anyres_llm_tokens(
    width_px: object,
    height_px: object,
    rows: object,
    cols: object,
    spec: FamilySpec | str = "llava-ov",
) -> np.ndarray:
    """LLM visual tokens of single images tiled on a ``rows x cols`` anyres grid.

    ``llm_tokens_per_tile`` for the base image, plus the grid's ``feature_side * rows`` by
    ``feature_side * cols`` features unpadded to the image's aspect ratio (the padding
    the fit-to-canvas resize introduced is cut symmetrically; the kept extent is
    ``round(size * scale, 7)`` truncated), then -- when ``t = sqrt(H * W / (llm_max_crops *
    feature_side^2)) > downsample_threshold`` -- bilinearly resized to ``floor(H / t) x
    floor(W / t)``, plus ``newline_tokens_per_row`` per remaining row.

    Returns:
        (N,) int64 LLM visual tokens.
    """
    spec = get_family(spec)
    w, h = _as_sizes(width_px, height_px)
    rows_a = _as_int_array("rows", rows, 1)
    cols_a = _as_int_array("cols", cols, 1)
    side = spec.feature_side
    feat_h = (rows_a * side).astype(np.float64)
    feat_w = (cols_a * side).astype(np.float64)
    wider = (w / h) > (feat_w / feat_h)
    # Image wider than the grid: padding was added above/below; keep `new_h` rows.
    new_h = np.floor(np.round(h * (feat_w / w), 7))
    new_w = np.floor(np.round(w * (feat_h / h), 7))
    pad_h = np.floor_divide(feat_h - new_h, 2)
    pad_w = np.floor_divide(feat_w - new_w, 2)
    kept_h = np.where(wider, feat_h - 2 * np.maximum(pad_h, 0), feat_h)
    kept_w = np.where(wider, feat_w, feat_w - 2 * np.maximum(pad_w, 0))
    times = np.sqrt(kept_h * kept_w / (spec.llm_max_crops * side * side))
    down = times > spec.downsample_threshold
    safe_times = np.where(down, times, 1.0)
    out_h = np.where(down, np.floor_divide(kept_h, safe_times), kept_h)
    out_w = np.where(down, np.floor_divide(kept_w, safe_times), kept_w)
    grid_tokens = out_h * (out_w + spec.newline_tokens_per_row)
    return (spec.llm_tokens_per_tile + spec.image_extra_tokens + grid_tokens).astype(np.int64)


# --------------------------------------------------------------------------- dynamic


def _dynamic_ratios(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    ratios = {
        (c, r)
        for c in range(1, max_tiles + 1)
        for r in range(1, max_tiles + 1)
        if min_tiles <= c * r <= max_tiles
    }
    return sorted(ratios, key=lambda cr: (cr[0] * cr[1], cr[0]))


def dynamic_tiles(
    width_px: object,
    height_px: object,
    *,
    tile_px: int = 448,
    min_tiles: int = 1,
    max_tiles: object = 12,
    use_thumbnail: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """InternVL-style dynamic tiling of each image.

    Candidate grids ``(cols, rows)`` with ``min_tiles <= cols * rows <= max_tiles`` are
    scanned by increasing tile count (then by ``cols``); the grid whose aspect ratio
    ``cols / rows`` is closest to ``width / height`` wins; on an exact tie a later
    (larger) grid replaces the current one when the image's area exceeds half of the
    later grid's canvas area. A thumbnail tile is added when ``use_thumbnail`` and the grid
    has more than one tile.

    Args:
        max_tiles: an int, or a (N,) array of per-image limits (multi-image samples).

    Returns:
        ``(rows, cols, num_tiles)``: (N,) int64 arrays; ``num_tiles`` includes the thumbnail.
    """
    w, h = _as_sizes(width_px, height_px)
    n = w.shape[0]
    limit = np.broadcast_to(_as_int_array("max_tiles", max_tiles, 1), (n,))
    if min_tiles < 1:
        raise ValueError(f"min_tiles={min_tiles} must be >= 1")
    hi = int(limit.max()) if n else min_tiles
    aspect = w / h
    area = w * h
    best_diff = np.full(n, np.inf)
    rows = np.ones(n, dtype=np.int64)
    cols = np.ones(n, dtype=np.int64)
    for c, r in _dynamic_ratios(min_tiles, hi):
        allowed = c * r <= limit
        diff = np.abs(aspect - c / r)
        closer = allowed & (diff < best_diff)
        tie = allowed & (diff == best_diff) & (area > 0.5 * tile_px * tile_px * c * r)
        take = closer | tie
        best_diff = np.where(closer, diff, best_diff)
        rows[take] = r
        cols[take] = c
    num_tiles = rows * cols
    if use_thumbnail:
        num_tiles = num_tiles + (num_tiles > 1)
    return rows, cols, num_tiles


# --------------------------------------------------------------------------- per modality


def native_grid(
    spec: FamilySpec | str, width_px: object, height_px: object, *, video: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Native (Qwen-VL) images (``video``: video frames): ``(rows, cols)`` of patches after
    the processor's resize (``smart_resize``: each side rounded to a multiple of
    ``patch_px * merge_size``, then the area scaled into ``[min_pixels, max_pixels]``, or
    the video bounds, keeping the aspect ratio)."""
    spec = get_family(spec)
    w, h = _as_sizes(width_px, height_px)
    low, high = (
        (spec.video_min_pixels, spec.video_max_pixels)
        if video
        else (spec.min_pixels, spec.max_pixels)
    )
    factor = spec.patch_px * spec.merge_size
    h_bar = np.round(h / factor) * factor
    w_bar = np.round(w / factor) * factor
    big = h_bar * w_bar > high
    small = ~big & (h_bar * w_bar < low)
    beta = np.sqrt(h * w / high)
    h_bar = np.where(big, np.maximum(factor, np.floor(h / beta / factor) * factor), h_bar)
    w_bar = np.where(big, np.maximum(factor, np.floor(w / beta / factor) * factor), w_bar)
    beta = np.sqrt(low / (h * w))
    h_bar = np.where(small, np.ceil(h * beta / factor) * factor, h_bar)
    w_bar = np.where(small, np.ceil(w * beta / factor) * factor, w_bar)
    return (h_bar // spec.patch_px).astype(np.int64), (w_bar // spec.patch_px).astype(np.int64)


def native_patches(spec: FamilySpec | str, width_px: object, height_px: object) -> np.ndarray:
    """Native (Qwen-VL) images: patches (encoder tokens) of each image."""
    rows, cols = native_grid(spec, width_px, height_px)
    return rows * cols


def image_shapes(
    spec: FamilySpec | str,
    width_px: object,
    height_px: object,
    *,
    max_tiles: object | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Encoder units and LLM visual tokens of single-image samples.

    Args:
        spec: a :class:`FamilySpec` or a family name.
        width_px, height_px: image sizes (scalars or (N,) arrays).
        max_tiles: dynamic tiling only: override of ``spec.max_tiles`` (int or (N,)).

    Returns:
        ``(encoder_units, llm_visual_tokens)``, (N,) int64 each.
    """
    spec = get_family(spec)
    w, h = _as_sizes(width_px, height_px)
    return tiling_rule(spec).image_shapes(spec, w, h, max_tiles)


def multi_image_shapes(
    spec: FamilySpec | str,
    image_sample_index: object,
    width_px: object,
    height_px: object,
    num_samples: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample encoder units and LLM visual tokens of multi-image samples.

    Images are given flat (ragged layout): image ``k`` belongs to sample
    ``image_sample_index[k]`` in ``[0, num_samples)``. Anyres families make every image one
    tile (``encoder_tokens_per_tile`` / ``llm_tokens_per_tile +
    single_tile_newline_tokens``); dynamic families tile each image with ``max(1,
    max_tiles // images_in_its_sample)`` tiles.

    Returns:
        ``(encoder_units, llm_visual_tokens)``, (num_samples,) int64 each (0 for samples
        without images).
    """
    spec = get_family(spec)
    idx = _as_int_array("image_sample_index", image_sample_index, 0)
    w, h = _as_sizes(width_px, height_px)
    if idx.shape != w.shape:
        raise ValueError(
            f"image_sample_index has {idx.shape[0]} entries but width_px has {w.shape[0]}"
        )
    if idx.size and int(idx.max()) >= num_samples:
        i = int(np.argmax(idx >= num_samples))
        raise ValueError(
            f"image_sample_index[{i}]={idx[i]} is out of range [0, num_samples={num_samples})"
        )
    count = np.bincount(idx, minlength=num_samples).astype(np.int64)
    return tiling_rule(spec).multi_image_shapes(spec, idx, w, h, count, num_samples)


def native_video_patches(spec: FamilySpec | str, width_px: object, height_px: object) -> np.ndarray:
    """Native (Qwen-VL) videos: patches per unit (temporal patch) of frames of these sizes
    (0 x 0: unknown, the nominal ``video_encoder_tokens_per_frame``)."""
    spec = get_family(spec)
    w = np.atleast_1d(np.asarray(width_px, dtype=np.float64))
    h = np.atleast_1d(np.asarray(height_px, dtype=np.float64))
    known = (w > 0) & (h > 0)
    patches = np.full(w.shape, spec.video_encoder_tokens_per_frame, dtype=np.int64)
    if known.any():
        rows, cols = native_grid(spec, w[known], h[known], video=True)
        patches[known] = rows * cols
    return patches


def video_shapes(
    spec: FamilySpec | str,
    num_frames: object,
    frame_width_px: object | None = None,
    frame_height_px: object | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Encoder units (sampled frames) and LLM visual tokens of videos.

    ``num_frames`` is the number of frames available (after the sampling fps); videos with
    more than ``spec.max_frames`` are uniformly sampled down to ``max_frames``. Native
    families: one unit per ``temporal_patch`` frames (the last padded), patched at the
    frame size when given (:func:`native_video_patches`).

    Returns:
        ``(encoder_units, llm_visual_tokens)``, (N,) int64 each.
    """
    spec = get_family(spec)
    frames = np.minimum(_as_int_array("num_frames", num_frames, 1), spec.max_frames)
    return tiling_rule(spec).video_shapes(spec, frames, frame_width_px, frame_height_px)


def shapes_from_descriptors(
    spec: FamilySpec | str,
    modality: object,
    text_tokens: object,
    *,
    image_sample_index: object | None = None,
    image_width_px: object | None = None,
    image_height_px: object | None = None,
    video_num_frames: object | None = None,
    video_frame_width_px: object | None = None,
    video_frame_height_px: object | None = None,
    target_tokens: object | None = None,
) -> SampleShapes:
    """Shapes of N samples from raw descriptors, by the family's rules.

    Args:
        spec: a :class:`FamilySpec` or a family name.
        modality: (N,) :class:`Modality` codes.
        text_tokens: (N,) text tokens of each sample's conversation.
        image_sample_index, image_width_px, image_height_px: every image of the batch
            (ragged layout, see :func:`multi_image_shapes`). ``IMAGE`` samples must own
            exactly one image, ``MULTI_IMAGE`` samples at least one, others none.
        video_num_frames: (N,) frames available per sample; read for ``VIDEO`` samples only
            (must be >= 1 there).
        video_frame_width_px, video_frame_height_px: (N,) a video's frame size (0 when
            unknown); native families patch the frames at it.
        target_tokens: (N,) target (loss) tokens of each sample, at most its text tokens
            (None: :func:`~dflop.data.shapes.estimate_target_tokens`, flagged).

    Returns:
        :class:`SampleShapes` with ``tokens_per_unit`` 0 for text-only samples.
    """
    spec = get_family(spec)
    rule = tiling_rule(spec)
    mod = _as_int_array("modality", modality, 0).astype(np.int8)
    n = mod.shape[0]
    bad = np.flatnonzero(mod > Modality.VIDEO)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"modality[{i}]={mod[i]} is not a Modality code (0..{Modality.VIDEO})")
    text = _as_int_array("text_tokens", text_tokens, 0)
    if text.shape[0] != n:
        raise ValueError(f"text_tokens has {text.shape[0]} entries, expected {n} (modality)")

    units = np.zeros(n, dtype=np.int64)
    tokens = np.zeros(n, dtype=np.int64)
    per_unit = np.zeros(n, dtype=np.int64)

    given = [a is not None for a in (image_sample_index, image_width_px, image_height_px)]
    if any(given) and not all(given):
        raise ValueError(
            "image_sample_index, image_width_px and image_height_px must be given together"
        )
    if all(given):
        idx = _as_int_array("image_sample_index", image_sample_index, 0)
        w, h = _as_sizes(image_width_px, image_height_px, ("image_width_px", "image_height_px"))
        if idx.shape != w.shape:
            raise ValueError(
                f"image_sample_index has {idx.shape[0]} entries but image_width_px has {w.shape[0]}"
            )
        if idx.size and int(idx.max()) >= n:
            i = int(np.argmax(idx >= n))
            raise ValueError(f"image_sample_index[{i}]={idx[i]} is out of range [0, {n})")
    else:
        idx = np.zeros(0, dtype=np.int64)
        w = h = np.zeros(0)
    count = np.bincount(idx, minlength=n)
    is_single = mod == Modality.IMAGE
    is_multi = mod == Modality.MULTI_IMAGE
    wrong = np.flatnonzero(
        (is_single & (count != 1))
        | (is_multi & (count < 1))
        | (~is_single & ~is_multi & (count > 0))
    )
    if wrong.size:
        i = int(wrong[0])
        name = Modality.NAMES[int(mod[i])]
        raise ValueError(
            f"sample {i} ({name}) owns {count[i]} images in image_sample_index; "
            "image samples need exactly 1, multi_image samples >= 1, others 0"
        )

    if idx.size:
        single_img = is_single[idx]
        if single_img.any():
            s_units, s_tokens = image_shapes(spec, w[single_img], h[single_img])
            owners = idx[single_img]
            units[owners] = s_units
            tokens[owners] = s_tokens
        multi_img = ~single_img
        if multi_img.any():
            m_units, m_tokens = multi_image_shapes(
                spec, idx[multi_img], w[multi_img], h[multi_img], n
            )
            units[is_multi] = m_units[is_multi]
            tokens[is_multi] = m_tokens[is_multi]
        # The mean of the sample's images' units (the tile rules': every unit's tokens).
        unit_tokens = np.bincount(idx, weights=rule.image_unit_tokens(spec, w, h), minlength=n)
        has = count > 0
        per_unit[has] = np.round(unit_tokens[has] / count[has]).astype(np.int64)

    is_video = mod == Modality.VIDEO
    if is_video.any():
        if video_num_frames is None:
            raise ValueError("video_num_frames is required when some modality is VIDEO")
        frames = np.atleast_1d(np.asarray(video_num_frames))
        if frames.shape != (n,):
            raise ValueError(f"video_num_frames must have shape ({n},), got {frames.shape}")
        # Validate with global indices; only video samples' entries matter.
        checked = _as_int_array("video_num_frames", np.where(is_video, frames, 1), 1)
        vid = np.flatnonzero(is_video)
        sizes = (video_frame_width_px, video_frame_height_px)
        fw = fh = None
        if rule.video_frame_sizes and all(v is not None for v in sizes):
            fw = np.atleast_1d(np.asarray(video_frame_width_px, dtype=np.float64))[vid]
            fh = np.atleast_1d(np.asarray(video_frame_height_px, dtype=np.float64))[vid]
        v_units, v_tokens = video_shapes(spec, checked[vid], fw, fh)
        per_unit[vid] = rule.video_unit_tokens(spec, vid.shape[0], fw, fh)
        units[vid] = v_units
        tokens[vid] = v_tokens

    targets = None
    if target_tokens is not None:
        targets = _as_int_array("target_tokens", target_tokens, 0)
        if targets.shape != (n,):
            raise ValueError(f"target_tokens has {targets.shape[0]} entries, expected {n}")
    return SampleShapes(
        encoder_units=units,
        tokens_per_unit=per_unit,
        llm_visual_tokens=tokens,
        text_tokens=text,
        modality=mod,
        target_tokens=targets,
    )
