"""LLaVA-format records as inputs of a Hugging Face model: the images through the model's
own image processor, the visual placeholders counted by the model's shape rule.

:class:`LlavaOnevisionRecords` turns one record (``{"image": ..., "conversations": [...]}``)
into a :class:`~dflop.batch.sample.ProcessedSample`. Single images become the
processor's base image + anyres crops (an ``"image"`` item with the original size), each
image of a multi-image record one tile (the model keeps the first crop of each); the text
``<image>`` markers become runs of the image token as long as the model's packing makes
them (:func:`dflop.models.hf.llava_onevision.family_from_config`; the LLM stage checks the
count against the model's own code at run time). Labels are the ``gpt`` turns' tokens.

The token ids and placeholder runs need only the image sizes (read from the file headers
by Pillow, the size the decoded image will have), so every rank knows every sample's
shape cheaply; the pixels are decoded and processed only when a rank asks for them
(``lazy=True``), so an encoder rank processes only its own share.

Videos are read from a folder of frame images (sorted by name) or the record's
``frames`` list of paths (dflop decodes no video files); more frames than the family's
``max_frames`` are sampled uniformly (``round(linspace(0, n - 1, max_frames))``). Each
frame goes through the image processor's base view (the frame resized to the tile, the
model's normalisation), which is what the model's video processor does to a frame; the
placeholder run is the model's pooled tokens per frame plus one newline.

Text: with a tokenizer that has ChatML's ``<|im_start|>`` / ``<|im_end|>`` tokens (the
Qwen2-based LLaVA-OneVision and Qwen2-VL), the conversation is laid out as their chat
template does (:class:`ChatTemplate`: a system turn, then ``<|im_start|>role\n text
<|im_end|>\n`` per turn; the answers' text and their ``<|im_end|>\n`` are the labels).
Otherwise (:func:`byte_encoder` for tiny test models) each turn's text is encoded as is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dflop.batch.sample import ProcessedSample
from dflop.batch.visual import VisualItem
from dflop.data.families import image_shapes, video_shapes
from dflop.data.image_header import FRAME_FILE_EXTENSIONS
from dflop.data.text_tokens import TextTokenCounter, is_answer_turn
from dflop.models.decoder import IGNORE_INDEX
from dflop.safe_io import check_regular_file

__all__ = [
    "ChatTemplate",
    "LlavaOnevisionRecords",
    "QwenVLRecords",
    "RecordInputs",
    "byte_encoder",
]

_CHAT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class ChatTemplate:
    """ChatML token ids (the chat template of Qwen2-based models): a system turn first
    (unless the conversation has its own), then every turn as ``header(role)``, its text,
    ``footer``."""

    system: tuple[int, ...]
    headers: dict[str, tuple[int, ...]]
    footer: tuple[int, ...]

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, system_prompt: str = DEFAULT_SYSTEM_PROMPT):
        """The template of a tokenizer with ``<|im_start|>`` and ``<|im_end|>`` as single
        tokens, else None."""
        unknown = getattr(tokenizer, "unk_token_id", None)
        for token in ("<|im_start|>", "<|im_end|>"):
            found = tokenizer.convert_tokens_to_ids(token)
            if found is None or found == unknown:
                return None

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(
            system=ids(f"<|im_start|>system\n{system_prompt}<|im_end|>\n"),
            headers={
                role: ids(f"<|im_start|>{role}\n") for role in ("system", "user", "assistant")
            },
            footer=ids("<|im_end|>\n"),
        )

    def header(self, speaker: str) -> tuple[int, ...]:
        """The header of a LLaVA speaker (``human``/``gpt``; ``system``; others as user)."""
        speaker = speaker.lower()
        role = "system" if speaker == "system" else _CHAT_ROLES.get(speaker, "user")
        return self.headers[role]


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
    names = [image] if isinstance(image, str) else image
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: 'image' must be a path or a non-empty list of paths")
    return [os.path.join(image_folder, n) for n in names]


def _frame_paths(record: dict[str, Any], video_folder: str, where: str) -> list[str]:
    """A video's frame files: the ``frames`` list, else the images of its frames folder."""
    frames = record.get("frames")
    if isinstance(frames, list) and frames and all(isinstance(f, str) for f in frames):
        return [os.path.join(video_folder, f) for f in frames]
    video = record.get("video")
    if not isinstance(video, str) or not video:
        raise ValueError(f"{where}: 'video' must be a frames folder path, got {video!r:.80}")
    folder = os.path.join(video_folder, video)
    if not os.path.isdir(folder):
        raise ValueError(
            f"{where}: {folder!r} is not a frames folder (dflop decodes no video files: "
            "extract its frames to a folder, or list them in 'frames')"
        )
    names = sorted(
        n
        for n in os.listdir(folder)
        if n.lower().endswith(FRAME_FILE_EXTENSIONS) and os.path.isfile(os.path.join(folder, n))
    )  # a named pipe called x.jpg is not a frame (opening it would block)
    if not names:
        raise ValueError(f"{where}: frames folder {folder!r} holds no image files")
    return [os.path.join(folder, n) for n in names]


def _open_rgb(path: str, where: str) -> Any:
    from PIL import Image

    try:
        check_regular_file(path, "image")  # never open a pipe (it blocks)
        with Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: cannot decode {path}: {err}") from err


def _header_size(path: str, where: str) -> tuple[int, int]:
    """(height, width) of the decoded image, from its header (Pillow opens lazily)."""
    from PIL import Image

    try:
        check_regular_file(path, "image")
        with Image.open(path) as im:
            width, height = im.size
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: cannot read {path}: {err}") from err
    return int(height), int(width)


class RecordInputs:
    """What the record converters share: the text layout and the token counter.
    Subclasses set ``family``, ``placeholder_ids`` and implement :meth:`sample`."""

    family: Any
    placeholder_ids: tuple[int, ...]

    def __init__(
        self,
        config: Any,
        image_processor: Any,
        encode: Callable[[str], list[int]],
        template: ChatTemplate | None = None,
    ) -> None:
        self.config = config
        self.image_processor = image_processor
        self.encode = encode
        self.template = template

    def sample(
        self,
        record: dict[str, Any],
        *,
        image_folder: str = "",
        video_folder: str | None = None,
        where: str = "record",
        lazy: bool = False,
    ) -> ProcessedSample:
        raise NotImplementedError

    def _sample(
        self,
        ids_labels: tuple[list[int], list[int]],
        load: Callable[[], Tensor] | None,
        items: tuple[VisualItem, ...],
        lazy: bool,
        files: list[str],
    ) -> ProcessedSample:
        ids, labels = ids_labels
        return ProcessedSample(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(labels, dtype=torch.long),
            None if load is None or lazy else load(),
            items,
            self.placeholder_ids,
            load=load if load is not None and lazy else None,
            files=tuple(dict.fromkeys(files)),
        )

    def _tokens(
        self, record: dict[str, Any], runs: list[list[int]], marker: str, where: str
    ) -> tuple[list[int], list[int]]:
        """Token ids and labels: each turn's text encoded, each item's ``runs`` entry (its
        placeholder ids) at its marker."""
        turns = record.get("conversations")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
            raise ValueError(f"{where}: 'conversations' must be a non-empty list of turns")
        texts = [str(turn.get("value", "")) for turn in turns]
        markers = sum(text.count(marker) for text in texts)
        # Image k goes at the k-th marker when the counts agree, else all of them at the
        # first marker (or before the first turn's text without one), as DatasetBatch does.
        groups = [[run] for run in runs] if markers == len(runs) else [runs] if runs else []
        if runs and markers == 0:
            texts[0] = marker + texts[0]
        template = self.template
        ids: list[int] = []
        labels: list[int] = []
        if template is not None and turns[0].get("from") != "system":
            ids += template.system
            labels += [IGNORE_INDEX] * len(template.system)
        for turn, text in zip(turns, texts):
            answer = is_answer_turn(turn.get("from"))
            if template is not None:
                header = template.header(str(turn.get("from")))
                ids += header
                labels += [IGNORE_INDEX] * len(header)
            for p, piece in enumerate(text.split(marker)):
                if p > 0 and groups:
                    run = [t for item in groups.pop(0) for t in item]
                    ids += run
                    labels += [IGNORE_INDEX] * len(run)
                tokens = list(self.encode(piece))
                ids += tokens
                labels += tokens if answer else [IGNORE_INDEX] * len(tokens)
            if template is not None:  # an answer's end of turn is a target too
                ids += template.footer
                labels += list(template.footer) if answer else [IGNORE_INDEX] * len(template.footer)
        return ids, labels

    def text_counter(self) -> TextTokenCounter:
        """Counts a record's text and target tokens as :meth:`sample` lays them out, for
        profiling a dataset under this model (the template's tokens per turn: its headers'
        mean; an answer's targets: its text and the template's end of turn)."""
        per_turn = per_conversation = per_answer = 0
        if self.template is not None:
            headers = [len(h) for h in self.template.headers.values()]
            per_turn = round(sum(headers) / len(headers)) + len(self.template.footer)
            per_conversation = len(self.template.system)
            per_answer = len(self.template.footer)
        return TextTokenCounter(
            "model-encoder",
            lambda text: len(self.encode(text)),
            tokens_per_turn=per_turn,
            tokens_per_conversation=per_conversation,
            target_tokens_per_answer=per_answer,
        )


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
            paths, items, runs = self._video(_frame_paths(record, videos, where))
            marker, token = "<video>", self.placeholder_ids[1]
        else:
            paths = _image_paths(record, image_folder, where)
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
            height, width = _header_size(paths[0], where)
            units_a, tokens_a = image_shapes(family, width, height)
            return (VisualItem("image", int(units_a[0]), height, width),), [int(tokens_a[0])]
        # multi-image: the model keeps each image's first crop, plus a newline
        run = family.llm_tokens_per_tile + family.single_tile_newline_tokens
        return tuple(VisualItem("tile", 1) for _ in paths), [run] * len(paths)

    def _pixels(self, paths: list[str], items: tuple[VisualItem, ...], where: str) -> Tensor:
        images = [_open_rgb(path, where) for path in paths]
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
            frames = self._frames(_frame_paths(record, videos, where))
            item = self._video_item(frames, where)
            items = (item,)
            tokens_per_video = item.units * item.unit_tokens // merge
            runs = [[start, *[self.placeholder_ids[1]] * tokens_per_video, end]]
            tokens = self._tokens(record, runs, "<video>", where)

            def load() -> Tensor:
                return self._video_pixels(frames, item, where)

            return self._sample(tokens, load, items, lazy, frames)
        paths = _image_paths(record, image_folder, where)
        images = tuple(self._image_item(path, where) for path in paths)
        runs = [
            [start, *[self.placeholder_ids[0]] * (item.unit_tokens // merge), end]
            for item in images
        ]
        tokens = self._tokens(record, runs, "<image>", where)

        def load_images() -> Tensor:
            out = self.image_processor(
                images=[_open_rgb(path, where) for path in paths], return_tensors="pt"
            )
            self._check_grids(out, [item.grid_thw for item in images], where)
            return out["pixel_values"]

        return self._sample(tokens, load_images if paths else None, images, lazy, paths)

    def _image_item(self, path: str, where: str) -> VisualItem:
        from dflop.data.families import native_grid

        height, width = _header_size(path, where)
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
        from dflop.data.families import native_grid

        height, width = _header_size(frames[0], where)
        rows, cols = (int(a[0]) for a in native_grid(self.family, width, height, video=True))
        units = len(frames) // self.family.temporal_patch
        return VisualItem("video", units, height, width, grid_thw=(units, rows, cols))

    def _video_pixels(self, frames: list[str], item: VisualItem, where: str) -> Tensor:
        images = [_open_rgb(path, where) for path in frames]
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
