"""What every family's record converter shares: LLaVA-format records
(``{"image": ..., "conversations": [...]}``) as inputs of a Hugging Face model, the
images through the model's own image processor, the visual placeholders counted by the
model's shape rule. Each family's converter (``models/hf/<family>/records.py``, e.g.
:class:`dflop.models.hf.llava_onevision.records.LlavaOnevisionRecords`) subclasses
:class:`RecordInputs` and turns one record into a
:class:`~dflop.batch.sample.ProcessedSample`.

The token ids and placeholder runs need only the image sizes (read from the file headers
by Pillow, :func:`header_size`, the size the decoded image will have), so every rank
knows every sample's shape cheaply; the pixels are decoded and processed only when a rank
asks for them (``lazy=True``), so an encoder rank processes only its own share.

Videos are read from a folder of frame images (sorted by name) or the record's
``frames`` list of paths (:func:`frame_paths`; dflop decodes no video files).

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

import torch
from torch import Tensor

from dflop.batch.sample import ProcessedSample
from dflop.batch.visual import VisualItem
from dflop.data.image_header import FRAME_FILE_EXTENSIONS
from dflop.data.text_tokens import TextTokenCounter, is_answer_turn
from dflop.models.decoder import IGNORE_INDEX
from dflop.safe_io import check_regular_file

__all__ = [
    "ChatTemplate",
    "RecordInputs",
    "byte_encoder",
    "frame_paths",
    "header_size",
    "image_paths",
    "open_rgb",
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


def image_paths(record: dict[str, Any], image_folder: str, where: str) -> list[str]:
    """The record's image files (its ``image`` path or list of paths, under the folder);
    empty for a record without images."""
    image = record.get("image")
    if image is None:
        return []
    names = [image] if isinstance(image, str) else image
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: 'image' must be a path or a non-empty list of paths")
    return [os.path.join(image_folder, n) for n in names]


def frame_paths(record: dict[str, Any], video_folder: str, where: str) -> list[str]:
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


def open_rgb(path: str, where: str) -> Any:
    """The decoded image as an RGB PIL image (a ValueError naming ``where`` if it cannot
    be read)."""
    from PIL import Image

    try:
        check_regular_file(path, "image")  # never open a pipe (it blocks)
        with Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: cannot decode {path}: {err}") from err


def header_size(path: str, where: str) -> tuple[int, int]:
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
