"""LLaVA-format records as inputs of an InternVL model (:class:`InternVLRecords`).

One record (``{"image": ..., "conversations": [...]}``) becomes a
:class:`~dflop.batch.sample.ProcessedSample`, laid out as transformers'
``InternVLProcessor`` lays out a prompt:

* each image goes through the model's image processor with ``crop_to_patches`` (its
  closest-aspect grid of tiles, then a thumbnail when the grid has more than one tile);
  at its ``<image>`` marker, ``<img>``, ``tokens_per_tile`` ``<IMG_CONTEXT>`` tokens per
  tile, ``</img>`` (the processor's ``replace_image_token``). The tile count comes from
  the image's header size by the family's rule
  (:func:`dflop.models.hf.internvl.family_from_config`) and is checked against the
  processor's when the pixels are made;
* the images of a multi-image record are tiled with ``max_patches = max(1, max_patches //
  images)`` each (InternVL's training recipe; the processor alone would give each image
  its full ``max_patches``);
* a video (a frames folder or a ``frames`` list): more frames than the family's
  ``max_frames`` are sampled uniformly (``round(linspace(0, n - 1, max_frames))``), each
  frame resized to one tile by the image processor (no cropping: what the video
  processor does to a frame); at its ``<video>`` marker, ``Frame1: <img>...</img>``,
  ``\\nFrame2: <img>...</img>``, ... (the processor's ``replace_video_token``: the
  ``FrameN:`` labels are text, encoded as the rest of the turn).

Only the ``<IMG_CONTEXT>`` tokens take visual features (``placeholder_ids``); labels are
the ``gpt`` turns' tokens. What every family's records share (reading sizes from headers,
frames folders, the chat template, lazy pixels) is in :mod:`dflop.models.hf.records`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from torch import Tensor

from dflop.batch.sample import ProcessedSample
from dflop.batch.visual import VisualItem
from dflop.data.families import dynamic_tiles
from dflop.models.hf.records import (
    ChatTemplate,
    RecordInputs,
    frame_paths,
    header_size,
    image_paths,
    open_rgb,
)

__all__ = ["InternVLRecords"]


class InternVLRecords(RecordInputs):
    """LLaVA-format records as inputs of one InternVL model (see the module docstring).

    Args:
        config: the model's ``InternVLConfig``.
        image_processor: the model's image processor (``GotOcr2ImageProcessor``, e.g.
            ``AutoImageProcessor`` of the checkpoint folder).
        encode: text to token ids (a tokenizer's ``encode``, or :func:`byte_encoder`).
        family: the model's shape rules
            (:func:`dflop.models.hf.internvl.family_from_config`).
        template: the chat template (None: each turn's text as is).
        wrap: the ``(<img>, </img>)`` token ids.
    """

    def __init__(
        self,
        config: Any,
        image_processor: Any,
        encode: Callable[[str], list[int]],
        family: Any,
        template: ChatTemplate | None = None,
        *,
        wrap: tuple[int, int],
    ) -> None:
        super().__init__(config, image_processor, encode, template)
        self.family = family
        self.image_token = int(config.image_token_id)
        self.placeholder_ids = (self.image_token,)
        self.wrap = (int(wrap[0]), int(wrap[1]))

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
        defaults to the image folder). ``lazy``: the pixels are decoded and processed on
        first use (``ProcessedSample.pixels()``), the tile counts come from the headers
        now."""
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if "video" in record:
            if "image" in record:
                raise ValueError(f"{where}: a record has 'image' or 'video', not both")
            videos = image_folder if video_folder is None else video_folder
            paths = self.frames(frame_paths(record, videos, where))
            items: tuple[VisualItem, ...] = (VisualItem("video", len(paths)),)
            tokens = self._tokens(record, [self.video_run(len(paths))], "<video>", where)

            def load_frames() -> Tensor:
                return self._frame_pixels(paths, where)

            return self._sample(tokens, load_frames, items, lazy, paths)
        paths = image_paths(record, image_folder, where)
        limit = self.max_tiles(len(paths))
        items = tuple(self._image_item(path, limit, where) for path in paths)
        runs = [self.image_run(item.units) for item in items]
        tokens = self._tokens(record, runs, "<image>", where)

        def load() -> Tensor:
            return self._image_pixels(paths, items, limit, where)

        return self._sample(tokens, load if paths else None, items, lazy, paths)

    def model_fields(self, sample: ProcessedSample) -> dict[str, Tensor]:
        """The sample as keyword arguments of the unmodified
        ``InternVLForConditionalGeneration`` (1-D ``input_ids`` / ``labels``: add a batch
        dim): its tiles and frames in order are the model's ``pixel_values``."""
        fields: dict[str, Tensor] = {"input_ids": sample.input_ids, "labels": sample.labels}
        if sample.items:
            fields["pixel_values"] = sample.pixels()
        return fields

    # ------------------------------------------------------------------ layout

    def max_tiles(self, images: int) -> int:
        """Tiles (thumbnail aside) each image of a sample of ``images`` images may take:
        ``max(1, max_patches // images)``."""
        return max(1, self.family.max_tiles // max(images, 1))

    def image_run(self, tiles: int) -> list[int]:
        """An image's tokens: ``<img>``, ``tokens_per_tile`` ``<IMG_CONTEXT>`` per tile,
        ``</img>`` (``InternVLProcessor.replace_image_token``)."""
        start, end = self.wrap
        return [start, *[self.image_token] * (self.family.llm_tokens_per_tile * tiles), end]

    def video_run(self, frames: int) -> list[int]:
        """A video's tokens: ``Frame{i}: <img>...</img>`` per frame, joined by newlines
        (``InternVLProcessor.replace_video_token``; the labels and newlines are text)."""
        start, end = self.wrap
        frame = [start, *[self.image_token] * self.family.video_tokens_per_frame, end]
        run: list[int] = []
        for i in range(frames):
            label = ("\n" if i else "") + f"Frame{i + 1}: "
            run += list(self.encode(label)) + frame
        return run

    def frames(self, frames: list[str]) -> list[str]:
        """At most the family's ``max_frames``, sampled uniformly."""
        limit = self.family.max_frames
        if len(frames) <= limit:
            return frames
        picks = np.round(np.linspace(0, len(frames) - 1, limit)).astype(int)
        return [frames[k] for k in picks]

    def _image_item(self, path: str, limit: int, where: str) -> VisualItem:
        height, width = header_size(path, where)
        family = self.family
        _, _, tiles = dynamic_tiles(
            width,
            height,
            tile_px=family.tile_px,
            min_tiles=family.min_tiles,
            max_tiles=limit,
            use_thumbnail=family.use_thumbnail,
        )
        return VisualItem("image", int(tiles[0]), height, width)

    # ------------------------------------------------------------------ pixels

    def _image_pixels(
        self, paths: list[str], items: tuple[VisualItem, ...], limit: int, where: str
    ) -> Tensor:
        images = [open_rgb(path, where) for path in paths]
        for path, image, item in zip(paths, images, items):
            if (image.height, image.width) != (item.height_px, item.width_px):
                raise ValueError(
                    f"{where}: {path} decodes to {image.height} x {image.width} px, its "
                    f"header says {item.height_px} x {item.width_px}"
                )
        out = self.image_processor(
            images=images, crop_to_patches=True, max_patches=limit, return_tensors="pt"
        )
        made = [int(n) for n in out["num_patches"]]
        expected = [item.units for item in items]
        if made != expected:
            raise ValueError(
                f"{where}: the image processor made {made} tiles of {paths}, the model's "
                f"rule {expected}: does the processor match config.json?"
            )
        return out["pixel_values"]

    def _frame_pixels(self, frames: list[str], where: str) -> Tensor:
        images = [open_rgb(path, where) for path in frames]
        out = self.image_processor(images=images, crop_to_patches=False, return_tensors="pt")
        return out["pixel_values"]
