"""One visual input of a sample (an image, a tile, a video), as a model's per-sample visual
operations need it: :class:`VisualItem`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VisualItem"]


@dataclass(frozen=True)
class VisualItem:
    """One visual input of a sample, as the model's per-sample operations need it.

    Attributes:
        kind: ``"image"`` (a single image, tiled by the model's own rule: LLaVA-OneVision's
            base image plus anyres crops), ``"tile"`` (an image encoded as one unit, e.g.
            each image of a multi-image sample) or ``"video"`` (one unit per frame).
        units: encoder units of the item (tiles or frames).
        height_px, width_px: the original image size (what the model's unpadding uses);
            0 when the model does not need it.
        grid_thw: a patch-sequence encoder's (Qwen-VL) grid of the item in patches:
            ``t`` units (an image 1, a video one per temporal patch) of ``h x w``
            patches each; None for fixed-size units.
    """

    kind: str
    units: int
    height_px: int = 0
    width_px: int = 0
    grid_thw: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("image", "tile", "video"):
            raise ValueError(f"VisualItem.kind={self.kind!r} must be 'image', 'tile' or 'video'")
        if self.units < 1:
            raise ValueError(f"VisualItem.units={self.units} must be >= 1")
        if self.height_px < 0 or self.width_px < 0:
            raise ValueError(
                f"VisualItem size {self.height_px}x{self.width_px} must not be negative"
            )
        if self.grid_thw is not None:
            grid = tuple(int(v) for v in self.grid_thw)
            if len(grid) != 3 or min(grid) < 1 or grid[0] != self.units:
                raise ValueError(
                    f"VisualItem.grid_thw={self.grid_thw!r} must be 3 positive sizes with "
                    f"t = units ({self.units})"
                )
            object.__setattr__(self, "grid_thw", grid)

    @property
    def unit_tokens(self) -> int:
        """Encoder tokens (patches) of each unit of a gridded item."""
        if self.grid_thw is None:
            raise ValueError("a VisualItem without grid_thw has the model's fixed unit size")
        return self.grid_thw[1] * self.grid_thw[2]
