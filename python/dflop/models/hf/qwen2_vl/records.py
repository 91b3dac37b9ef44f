"""LLaVA-format records as inputs of a Qwen2-VL / Qwen2.5-VL model (:class:`QwenVLRecords`).

What every family's records share (reading sizes from headers, frames folders, the chat
template, lazy pixels) is in :mod:`dflop.models.hf.records`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from torch import Tensor

from dflop.batch.sample import ProcessedSample
from dflop.batch.visual import VisualItem
from dflop.data.families import native_grid
from dflop.models.hf.records import (
    ChatTemplate,
    RecordInputs,
    frame_paths,
    header_size,
    image_paths,
    open_rgb,
)

__all__ = ["QwenVLRecords"]


class QwenVLRecords(RecordInputs):
    """LLaVA-format records as inputs of one Qwen2-VL / Qwen2.5-VL model.

    Images: each resized by the model's processor (``smart_resize``: the family's
    ``native_grid``, computed from the header size) and cut into patches; at its
    ``<image>`` marker ``<|vision_start|>``, one image token per ``merge_size^2``
    patches, ``<|vision_end|>``.

    Videos (a frames folder or a ``frames`` list; at most the family's ``max_frames``,
    sampled uniformly, the last repeated to an even count as the video processor pads):
    every frame resized within the family's video bounds to the first frame's
    grid, cut into patches by the image processor, and two consecutive frames joined into
    one temporal patch (the ``C x 2 x P x P`` layout of Qwen2-VL's video processor), so a
    video of ``n`` frames is ``n / 2`` units; ``<|vision_start|>``, one video token per
    ``merge_size^2`` patches, ``<|vision_end|>``.
    """

    def __init__(
        self,
        config: Any,
        image_processor: Any,
        encode: Callable[[str], list[int]],
        family: Any,
        template: ChatTemplate | None = None,
    ) -> None:
        import copy

        super().__init__(config, image_processor, encode, template)
        self.family = family
        self.placeholder_ids = (int(config.image_token_id), int(config.video_token_id))
        self.wrap = (int(config.vision_start_token_id), int(config.vision_end_token_id))
        self.frame_processor = copy.deepcopy(image_processor)  # frames: the video bounds
        self.frame_processor.size = {
            "shortest_edge": int(family.video_min_pixels),
            "longest_edge": int(family.video_max_pixels),
        }

    def sample(
        self,
        record: dict[str, Any],
        *,
        image_folder: str = "",
        video_folder: str | None = None,
        where: str = "record",
        lazy: bool = False,
    ) -> ProcessedSample:
        """One record as model inputs (paths relative to the folders; the video folder
        defaults to the image folder). ``lazy``: the pixels are processed on first use;
        the grids come from the headers."""
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        start, end = self.wrap
        merge = self.family.merge_size**2
        if "video" in record:
            if "image" in record:
                raise ValueError(f"{where}: a record has 'image' or 'video', not both")
            videos = image_folder if video_folder is None else video_folder
            frames = self._frames(frame_paths(record, videos, where))
            item = self._video_item(frames, where)
            items = (item,)
            tokens_per_video = item.units * item.unit_tokens // merge
            runs = [[start, *[self.placeholder_ids[1]] * tokens_per_video, end]]
            tokens = self._tokens(record, runs, "<video>", where)

            def load() -> Tensor:
                return self._video_pixels(frames, item, where)

            return self._sample(tokens, load, items, lazy, frames)
        paths = image_paths(record, image_folder, where)
        images = tuple(self._image_item(path, where) for path in paths)
        runs = [
            [start, *[self.placeholder_ids[0]] * (item.unit_tokens // merge), end]
            for item in images
        ]
        tokens = self._tokens(record, runs, "<image>", where)

        def load_images() -> Tensor:
            out = self.image_processor(
                images=[open_rgb(path, where) for path in paths], return_tensors="pt"
            )
            self._check_grids(out, [item.grid_thw for item in images], where)
            return out["pixel_values"]

        return self._sample(tokens, load_images if paths else None, images, lazy, paths)

    def _image_item(self, path: str, where: str) -> VisualItem:
        height, width = header_size(path, where)
        rows, cols = (int(a[0]) for a in native_grid(self.family, width, height))
        return VisualItem("image", 1, height, width, grid_thw=(1, rows, cols))

    def _frames(self, frames: list[str]) -> list[str]:
        """At most ``max_frames`` sampled uniformly, padded to whole temporal patches by
        repeating the last."""
        limit, step = self.family.max_frames, self.family.temporal_patch
        if len(frames) > limit:
            picks = np.round(np.linspace(0, len(frames) - 1, limit)).astype(int)
            frames = [frames[k] for k in picks]
        return frames + [frames[-1]] * (-len(frames) % step)

    def _video_item(self, frames: list[str], where: str) -> VisualItem:
        height, width = header_size(frames[0], where)
        rows, cols = (int(a[0]) for a in native_grid(self.family, width, height, video=True))
        units = len(frames) // self.family.temporal_patch
        return VisualItem("video", units, height, width, grid_thw=(units, rows, cols))

    def _video_pixels(self, frames: list[str], item: VisualItem, where: str) -> Tensor:
        images = [open_rgb(path, where) for path in frames]
        sizes = {im.size for im in images}
        if len(sizes) > 1:
            raise ValueError(f"{where}: the video's frames differ in size: {sorted(sizes)}")
        out = self.frame_processor(images=images, return_tensors="pt")
        _, rows, cols = item.grid_thw
        self._check_grids(out, [(1, rows, cols)] * len(images), where)
        step = self.family.temporal_patch
        channels = int(self.config.vision_config.in_channels)
        patch = int(self.config.vision_config.patch_size)
        # Each frame's patch rows hold the frame repeated over the temporal axis
        # [C, step, P, P]; keep one copy per frame and join ``step`` frames per patch.
        per_frame = out["pixel_values"].view(len(images), rows * cols, channels, step, patch, patch)
        own = per_frame[:, :, :, 0]  # [frames, patches, C, P, P]
        grouped = own.view(item.units, step, rows * cols, channels, patch, patch)
        joined = grouped.permute(0, 2, 3, 1, 4, 5)  # [units, patches, C, step, P, P]
        return joined.reshape(item.units * rows * cols, channels * step * patch * patch)

    @staticmethod
    def _check_grids(out: Any, expected: list[tuple[int, int, int]], where: str) -> None:
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"]]
        if grids != expected:
            raise ValueError(
                f"{where}: the image processor made patch grids {grids}, the model's rule "
                f"{expected}: does the processor match the model?"
            )
