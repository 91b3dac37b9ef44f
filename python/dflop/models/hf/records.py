"""LLaVA-format records as inputs of a Hugging Face model: the images through the model's
own image processor, the visual placeholders counted by the model's shape rule.

:func:`llava_onevision_sample` turns one record (``{"image": ..., "conversations": [...]}``)
into a :class:`~dflop.runtime.processed_batch.ProcessedSample`: single images become the
processor's base image + anyres crops (an ``"image"`` item with the original size), each
image of a multi-image record one tile (the model keeps the first crop of each), and the
text ``<image>`` markers become runs of the image token as long as the model's packing
makes them (:func:`dflop.models.hf.llava_onevision.family_from_config`; the LLM stage checks
the count against the model's own code at run time). Labels are the ``gpt`` turns' tokens.
Video records are not handled yet (``ValueError``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from dflop.data.families import image_shapes
from dflop.models.decoder import IGNORE_INDEX
from dflop.models.spec import VisualItem
from dflop.runtime.processed_batch import ProcessedSample

__all__ = ["byte_encoder", "llava_onevision_sample"]

_ANSWER_ROLES = ("gpt", "assistant")


def byte_encoder(vocab_size: int, reserved: tuple[int, ...]) -> Callable[[str], list[int]]:
    """A tokenizer stand-in for tiny models: UTF-8 bytes mapped into ``[0, vocab_size)``
    minus the ``reserved`` ids (the visual placeholders)."""
    usable = [i for i in range(vocab_size) if i not in set(reserved)]

    def encode(text: str) -> list[int]:
        return [usable[b % len(usable)] for b in text.encode("utf-8")]

    return encode


def _image_paths(record: dict[str, Any], image_folder: str, where: str) -> list[str]:
    image = record.get("image")
    if image is None:
        return []
    names = [image] if isinstance(image, str) else list(image)
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: 'image' must be a path or a list of paths")
    return [os.path.join(image_folder, n) for n in names]


def llava_onevision_sample(
    record: dict[str, Any],
    *,
    config: Any,
    image_processor: Any,
    encode: Callable[[str], list[int]],
    image_folder: str = "",
    where: str = "record",
) -> ProcessedSample:
    """One LLaVA-format record as LLaVA-OneVision inputs (see the module docstring).
    ``encode`` maps text to token ids (a tokenizer's, or :func:`byte_encoder`)."""
    from PIL import Image

    from dflop.models.hf.llava_onevision import family_from_config

    if "video" in record:
        raise ValueError(f"{where}: video records are not supported by this converter yet")
    family = family_from_config(config)
    paths = _image_paths(record, image_folder, where)
    images = []
    for path in paths:
        try:
            with Image.open(path) as im:
                images.append(im.convert("RGB"))
        except (OSError, ValueError) as err:
            raise ValueError(f"{where}: cannot decode {path}: {err}") from err
    pixels, items, runs = None, (), []
    if images:
        out = image_processor(images=images, return_tensors="pt")
        if len(images) == 1:
            height, width = (int(v) for v in out["image_sizes"][0])
            units_a, tokens_a = image_shapes(family, width, height)
            units = int(units_a[0])
            pixels = out["pixel_values"][0][:units]
            if pixels.shape[0] != units:
                raise ValueError(
                    f"{where}: the image processor made {pixels.shape[0]} crops of "
                    f"{path}, the model's rule {units}: does the processor match config.json?"
                )
            items = (VisualItem("image", units, height, width),)
            runs = [int(tokens_a[0])]
        else:  # multi-image: the model keeps each image's first crop, plus a newline
            pixels = out["pixel_values"][:, 0]
            items = tuple(VisualItem("tile", 1) for _ in images)
            runs = [family.llm_tokens_per_tile + family.single_tile_newline_tokens] * len(images)
    image_token = int(config.image_token_index)
    turns = record.get("conversations") or []
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: 'conversations' must be a non-empty list of turns")
    texts = [str(turn.get("value", "")) for turn in turns]
    markers = sum(text.count("<image>") for text in texts)
    # Image k goes at the k-th marker when the counts agree, else all of them at the first
    # marker (or before the first turn's text without one), as dflop's DatasetBatch does.
    groups = [[run] for run in runs] if markers == len(runs) else [runs] if runs else []
    if runs and markers == 0:
        texts[0] = "<image>" + texts[0]
    ids: list[int] = []
    labels: list[int] = []
    for turn, text in zip(turns, texts):
        answer = turn.get("from") in _ANSWER_ROLES
        for p, piece in enumerate(text.split("<image>")):
            if p > 0 and groups:
                run = sum(groups.pop(0))
                ids += [image_token] * run
                labels += [IGNORE_INDEX] * run
            tokens = encode(piece)
            ids += tokens
            labels += tokens if answer else [IGNORE_INDEX] * len(tokens)
    return ProcessedSample(
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(labels, dtype=torch.long),
        pixels,
        items,
        (image_token, int(config.video_token_index)),
    )
