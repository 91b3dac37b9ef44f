"""LLaVA-format records as inputs of a LLaVA-OneVision model (:class:`LlavaOnevisionRecords`).

One record (``{"image": ..., "conversations": [...]}``) becomes a
:class:`~dflop.batch.sample.ProcessedSample`. Single images become the processor's base
image + anyres crops (an ``"image"`` item with the original size), each image of a
multi-image record one tile (the model keeps the first crop of each); the text
``<image>`` markers become runs of the image token as long as the model's packing makes
them (:func:`dflop.models.hf.llava_onevision.family_from_config`; the LLM stage checks the
count against the model's own code at run time). Labels are the ``gpt`` turns' tokens.

Videos: more frames than the family's ``max_frames`` are sampled uniformly
(``round(linspace(0, n - 1, max_frames))``). Each frame goes through the image
processor's base view (the frame resized to the tile, the model's normalisation), which
is what the model's video processor does to a frame; the placeholder run is the model's
pooled tokens per frame plus one newline.

What every family's records share (reading sizes from headers, frames folders, the chat
template, lazy pixels) is in :mod:`dflop.models.hf.records`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dflop.batch.sample import ProcessedSample
from dflop.batch.visual import VisualItem
from dflop.data.families import image_shapes, video_shapes
from dflop.models.hf.records import (
    ChatTemplate,
    RecordInputs,
    frame_paths,
    header_size,
    image_paths,
    open_rgb,
)

__all__ = ["LlavaOnevisionRecords"]


class LlavaOnevisionRecords(RecordInputs):
    """LLaVA-format records as inputs of one LLaVA-OneVision model (see the module
    docstring).

    Args:
        config: the model's ``LlavaOnevisionConfig``.
        image_processor: the model's image processor (e.g. ``AutoImageProcessor`` of the
            checkpoint folder).
        encode: text to token ids (a tokenizer's ``encode``, or :func:`byte_encoder`).
        family: the model's shape rules
            (:func:`dflop.models.hf.llava_onevision.family_from_config`).
        template: the chat template (None: each turn's text as is).
    """

    def __init__(
        self,
        config: Any,
        image_processor: Any,
        encode: Callable[[str], list[int]],
        family: Any,
        template: ChatTemplate | None = None,
    ) -> None:
        super().__init__(config, image_processor, encode, template)
        self.family = family
        self.image_token = int(config.image_token_index)
        self.placeholder_ids = (self.image_token, int(config.video_token_index))

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
        first use (``ProcessedSample.pixels()``), the sizes come from the headers now."""
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if "video" in record:
            if "image" in record:
                raise ValueError(f"{where}: a record has 'image' or 'video', not both")
            videos = image_folder if video_folder is None else video_folder
            paths, items, runs = self._video(frame_paths(record, videos, where))
            marker, token = "<video>", self.placeholder_ids[1]
        else:
            paths = image_paths(record, image_folder, where)
            items, runs = self._images(paths, where)
            marker, token = "<image>", self.image_token
        tokens = self._tokens(record, [[token] * run for run in runs], marker, where)

        def load() -> Tensor:
            return self._pixels(paths, items, where)

        return self._sample(tokens, load if paths else None, items, lazy, paths)

    def model_fields(self, sample: ProcessedSample) -> dict[str, Tensor]:
        """The sample as keyword arguments of the unmodified
        ``LlavaOnevisionForConditionalGeneration`` (a batch of one, no batch dim on the
        1-D ``input_ids`` / ``labels``: add one, or pack samples with
        :class:`dflop.dp.PackingCollator`, which takes single-image and text-only samples:
        a multi-image sample's ``batch_num_images`` and a video's frames are per row)."""
        fields: dict[str, Tensor] = {"input_ids": sample.input_ids, "labels": sample.labels}
        kinds = {item.kind for item in sample.items}
        if not kinds:
            return fields
        pixels = sample.pixels()
        if kinds == {"video"}:
            fields["pixel_values_videos"] = pixels[None]
        elif kinds == {"image"}:
            item = sample.items[0]
            fields["pixel_values"] = pixels[None]
            fields["image_sizes"] = torch.tensor([[item.height_px, item.width_px]])
        else:  # multi-image: one base tile per image
            side = int(self.config.vision_config.image_size)
            fields["pixel_values"] = pixels[:, None]
            fields["image_sizes"] = torch.tensor([[side, side]] * sample.units)
            fields["batch_num_images"] = torch.tensor([sample.units])
        return fields

    def _video(self, frames: list[str]) -> tuple[list[str], tuple[VisualItem, ...], list[int]]:
        """(sampled frame paths, the video item, its placeholder run)."""
        units_a, tokens_a = video_shapes(self.family, len(frames))
        picks = np.round(np.linspace(0, len(frames) - 1, int(units_a[0]))).astype(int)
        return [frames[k] for k in picks], (VisualItem("video", len(picks)),), [int(tokens_a[0])]

    def _images(self, paths: list[str], where: str) -> tuple[tuple[VisualItem, ...], list[int]]:
        """(the images' items, their placeholder runs)."""
        family = self.family
        if len(paths) == 1:
            height, width = header_size(paths[0], where)
            units_a, tokens_a = image_shapes(family, width, height)
            return (VisualItem("image", int(units_a[0]), height, width),), [int(tokens_a[0])]
        # multi-image: the model keeps each image's first crop, plus a newline
        run = family.llm_tokens_per_tile + family.single_tile_newline_tokens
        return tuple(VisualItem("tile", 1) for _ in paths), [run] * len(paths)

    def _pixels(self, paths: list[str], items: tuple[VisualItem, ...], where: str) -> Tensor:
        images = [open_rgb(path, where) for path in paths]
        out = self.image_processor(images=images, return_tensors="pt")
        if len(images) > 1 or items[0].kind == "video":  # the base view of each
            return out["pixel_values"][:, 0]
        item = items[0]
        size = tuple(int(v) for v in out["image_sizes"][0])
        if size != (item.height_px, item.width_px):
            raise ValueError(
                f"{where}: {paths[0]} decodes to {size[0]} x {size[1]} px, its header says "
                f"{item.height_px} x {item.width_px}"
            )
        pixels = out["pixel_values"][0][: item.units]
        if pixels.shape[0] != item.units:
            raise ValueError(
                f"{where}: the image processor made {pixels.shape[0]} crops of {paths[0]}, "
                f"the model's rule {item.units}: does the processor match config.json?"
            )
        return pixels
