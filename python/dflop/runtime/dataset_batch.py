"""Real model inputs from the records of a LLaVA-style dataset.

:class:`DatasetBatch` is the dataset counterpart of
:class:`~dflop.runtime.synthetic_batch.SyntheticBatch`: the same :class:`BatchSource`
interface (``pixel_values(ids)``, ``text_inputs(ids)``, ``target_tokens()``, ``.shapes``),
but the pixels are decoded from the records' image files / video frames and the tokens
come from their conversations. It is built on every rank from the same raw records of one
global batch (the dicts or :class:`~dflop.data.dataset.RawSample` s the dataset readers
yield), and each call loads ONLY the requested samples: encoder ranks decode the pixels of
their share and never tokenise, LLM ranks tokenise theirs and never decode a pixel.

Shapes without loading
----------------------
Every rank needs the shapes of the whole batch (for the ``StepPlan``) but loads only its
share, so the shapes come from what the data profiler reads, never from pixels or tokens:
each record is described by :func:`dflop.data.describe.describe_sample` (image sizes from
file headers or size fields, frames counted in the frames folder, text tokens from a
:class:`~dflop.data.text_tokens.TextTokenCounter`, by default the character estimate), the
family's rules give its shape, and the :class:`ShapeScaler` maps it onto the model.
``shapes == scaler.scale(<profiled shape of the record>)``, so a planner sampling the
profiled distribution through the same scaler sees exactly these shapes.

Visual units (encoder ranks)
----------------------------
The family's tiling rule lists a sample's units; the scaler's count ``u`` of them is
taken uniformly (``round(linspace(0, n - 1, u))``, so the first unit is always kept), and
every unit is rendered at the model's ``image_size_px`` (bicubic), normalised to
``[-1, 1]`` (``x / 127.5 - 1``, SigLIP's mean/std of 0.5):

* anyres (LLaVA-OneVision) single image: the base image resized to a square, then the
  crops of the family's ``rows x cols`` grid (the image resized into the grid canvas
  keeping its aspect ratio and centred on black padding, as LLaVA's
  ``resize_and_pad_image``), row-major;
* dynamic (InternVL) single image: the thumbnail first (when the grid has > 1 tile), then
  the tiles of the image resized to the grid canvas;
* multi-image: the units of each image in turn (anyres: one per image; dynamic: each
  image tiled with ``max(1, max_tiles // num_images)`` tiles);
* video: the frames of its frames folder (image files, sorted by name), or the ``frames``
  list of paths; a video *file* cannot be decoded (dflop has no video decoder): extract
  its frames to a folder.

Images are decoded with Pillow, ``convert("RGB")`` (no EXIF rotation, as LLaVA's
loaders), then channels are taken cyclically when the model has ``channels != 3``. The
grid comes from the sizes the shape used (size fields win over the file, as in the
profiler), applied to the decoded image.

Text (LLM ranks)
----------------
A sample's ``T = text_tokens`` text positions of which ``A = target_tokens`` are targets
(the scaled budget: :class:`ShapeScaler` keeps the profiled answers' share) are laid out
as::

    [BOS] [turn 0] [turn 1] ...      visual placeholders inside the turns

The answer (``gpt``/``assistant``) turns get exactly ``A`` positions, split in proportion
to ``1 + counter(turn text)`` (largest remainder; the first answer gets at least one), all
of them content with labels; the other turns share the ``T - 1 - A`` others in the same
way (with no other turn, they pad the start after BOS). A non-answer turn with quota ``q
>= 2`` is a role token (``USER_TOKEN_ID``) plus ``q - 1`` content positions, with ``q = 1``
one content position. Content is the turn's tokens (a tokenizer's ids mapped into the
model's vocab as ``RESERVED + id % (vocab - RESERVED)``, or, without a tokenizer, the UTF-8
bytes as ``RESERVED + byte``): cut when longer, padded with ``END_TOKEN_ID`` when shorter.
Labels are the content ids (padding included: the end of an answer is a target) on answer
turns and -100 elsewhere, so a sample has exactly its shape's target tokens, known from
the records alone (no tokenisation).

Visual placeholders: the ``<image>``/``<video>`` occurrences of the conversation; item k
(image k; the video) goes where the k-th placeholder is when their counts agree, otherwise
all items go at the first placeholder; with no placeholder they are prepended to the first
turn's content. Each item takes ``units_of_item * tokens_per_unit`` positions with
``IMAGE_TOKEN_ID`` (placeholders are never cut by the text budget); with
``DecoderConfig.image_newline`` the item holding the sample's last unit takes one more,
for the newline row that follows the sample's features.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from dflop.data.dataset import RawSample
from dflop.data.describe import ImageSizeCache, SampleDescriptor, SampleError, describe_sample
from dflop.data.families import FamilySpec, get_family, tiling_rule
from dflop.data.image_header import FRAME_FILE_EXTENSIONS
from dflop.data.reader import (
    RecordSet,
    check_loadable,
    descriptor_shapes,
    frames_folder_problem,
    image_paths,
    read_records,
)
from dflop.data.shapes import Modality, SampleShapes
from dflop.data.text_tokens import (
    ANSWER_ROLES,
    VISUAL_PLACEHOLDERS,
    TextTokenCounter,
    is_answer_turn,
    load_local_tokenizer,
    make_text_counter,
)
from dflop.errors import InputTypeError
from dflop.models.config import ModelConfig
from dflop.models.decoder import IGNORE_INDEX
from dflop.runtime.synthetic_batch import (
    IMAGE_TOKEN_ID,
    PackedBatchSource,
    ShapeScaler,
)

__all__ = [
    "ANSWER_ROLES",
    "ASSISTANT_TOKEN_ID",
    "BOS_TOKEN_ID",
    "END_TOKEN_ID",
    "RESERVED_TOKEN_IDS",
    "USER_TOKEN_ID",
    "DatasetBatch",
    "DatasetSampleError",
    "RecordSet",
    "clear_caches",
    "read_records",
]

BOS_TOKEN_ID = 1
"""First position of every sample."""
END_TOKEN_ID = 2
"""Pads a turn whose tokens are fewer than its quota (a target on assistant turns)."""
USER_TOKEN_ID = 3
"""Role token of a non-assistant turn (human, system, ...)."""
ASSISTANT_TOKEN_ID = 4
"""Reserved (answer turns carry no role token: their positions are the targets)."""
RESERVED_TOKEN_IDS = 5
"""Ids below this are special (``IMAGE_TOKEN_ID`` = 0 and the ones above); text ids follow."""

PIXEL_CACHE_BYTES = 64 << 20
"""Per-process cache of rendered units (by file, tiling and model size), least recently
used first out."""

_PLACEHOLDER_SPLIT = re.compile("(" + "|".join(re.escape(p) for p in VISUAL_PLACEHOLDERS) + ")")
_SLOT = -1  # marks a placeholder in a turn's content stream


class DatasetSampleError(ValueError):
    """A record of the batch cannot be turned into tensors; the message names the dataset
    file and the sample index (or the batch position of a plain dict)."""


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class _Unit:
    """One visual unit to render: ``kind`` ``"full"`` (the image resized to a square),
    ``"anyres"`` / ``"dynamic"`` (crop ``index`` of a ``rows x cols`` grid canvas)."""

    path: str
    kind: str
    rows: int = 1
    cols: int = 1
    index: int = 0
    item: int = 0
    """The visual item (image k of the sample; 0 for a video) the unit belongs to."""


@dataclass
class _Plan:
    where: str
    descriptor: SampleDescriptor
    turns: list[tuple[bool, str]]
    """(is_answer, text) per turn."""
    units: list[_Unit] = field(default_factory=list)
    """The selected units, in encoding order."""
    quotas: list[int] = field(default_factory=list)
    lead_pad: int = 0
    """Non-target positions after BOS when no turn is a prompt."""
    slot_items: list[list[int]] = field(default_factory=list)
    """Per placeholder occurrence (conversation order): the items placed there."""
    prepend_items: list[int] = field(default_factory=list)
    """Items placed at the start of the first turn (no placeholder in the text)."""
    target_tokens: int = 0


# --------------------------------------------------------------------------- tokenizers


def _text_encoder(tokenizer: Any, vocab_size: int) -> tuple[str, Callable[[str], list[int]]]:
    """``(method, encode)``: text -> model token ids (>= RESERVED_TOKEN_IDS)."""
    span = vocab_size - RESERVED_TOKEN_IDS
    if tokenizer is None:

        def encode_bytes(text: str) -> list[int]:
            return [RESERVED_TOKEN_IDS + b % span for b in text.encode("utf-8")]

        return "bytes", encode_bytes
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    if isinstance(tokenizer, (str, os.PathLike)):
        name = os.fspath(tokenizer)
        tokenizer = load_local_tokenizer(tokenizer, "tokenizer=None for byte-level tokens")
    encode = getattr(tokenizer, "encode", None)
    if callable(encode):
        try:
            encode("", add_special_tokens=False)
            kwargs: dict[str, Any] = {"add_special_tokens": False}
        except TypeError:
            kwargs = {}
        raw = lambda text: encode(text, **kwargs)  # noqa: E731
    elif callable(tokenizer):
        raw = tokenizer
    else:
        raise InputTypeError(
            "tokenizer must be None, a local tokenizer folder, an object with encode(), or "
            f"a callable text -> list of ids; got {type(tokenizer).__name__}"
        )

    def encode_ids(text: str) -> list[int]:
        return [RESERVED_TOKEN_IDS + int(i) % span for i in raw(text)]

    return f"tokenizer:{name}", encode_ids


# --------------------------------------------------------------------------- pixels


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(
            "decoding dataset images needs Pillow: pip install pillow "
            "(or train on shapes only with --data synthetic / SyntheticBatch)"
        ) from exc
    return Image


class _UnitCache:
    """Rendered units ``[C, S, S]`` by (file identity, tiling, model size); bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple, Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Tensor | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
            return hit

    def put(self, key: tuple, value: Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()
            self._items[key] = value
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.numel() * dropped.element_size()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


_UNIT_CACHE = _UnitCache(PIXEL_CACHE_BYTES)
_HEADER_CACHE = ImageSizeCache()


def clear_caches() -> None:
    """Empty this process's caches of rendered units and image header sizes."""
    global _HEADER_CACHE
    _UNIT_CACHE.clear()
    _HEADER_CACHE = ImageSizeCache()


def _to_tensor(image: Any, channels: int) -> Tensor:
    array = np.asarray(image.convert("RGB"), dtype=np.float32)  # [S, S, 3]
    if channels != 3:
        array = array[..., [c % 3 for c in range(channels)]]
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1))) / 127.5 - 1.0


def _anyres_canvas(image: Any, rows: int, cols: int, side: int, pil: Any) -> Any:
    """LLaVA's resize_and_pad_image into a ``cols*side x rows*side`` canvas."""
    target_w, target_h = cols * side, rows * side
    w, h = image.size
    scale_w, scale_h = target_w / w, target_h / h
    if scale_w < scale_h:
        new_w, new_h = target_w, min(int(np.ceil(h * scale_w)), target_h)
    else:
        new_h, new_w = target_h, min(int(np.ceil(w * scale_h)), target_w)
    resized = image.resize((max(new_w, 1), max(new_h, 1)), pil.Resampling.BICUBIC)
    canvas = pil.new("RGB", (target_w, target_h), (0, 0, 0))
    canvas.paste(resized, ((target_w - resized.size[0]) // 2, (target_h - resized.size[1]) // 2))
    return canvas


# --------------------------------------------------------------------------- the batch


class DatasetBatch(PackedBatchSource):
    """Tensors of one global batch of dataset records (see the module docstring).

    Args:
        samples: the batch's records, in global-batch order: :class:`RawSample` s (their
            folders and file/index are used) or plain dicts (folders from the arguments).
        config: the model (image size, channels, tokens per unit, vocab, max length).
        scaler: maps the records' family shapes onto the model (``ShapeScaler.for_model``).
        image_folder, video_folder: folders of plain-dict records' paths (default: the
            current directory; the video folder defaults to the image folder).
        tokenizer: ``None`` (UTF-8 bytes), a local Hugging Face tokenizer folder, an object
            with ``encode``, or a callable ``text -> list of ids``; only LLM ranks use it.
        seed: kept for interface parity with ``SyntheticBatch``: rendering is deterministic
            and does not depend on it.
        family: the shape rules (``"llava-ov"``, ``"internvl"`` or a ``FamilySpec``).
        text_counter: counts text tokens for the shapes' budget (default: the profiler's
            character estimate, which tokenises nothing).

    Raises:
        DatasetSampleError: a record cannot be described (bad fields, a missing image file
            or frames folder, a video file without extracted frames), naming the file and
            the sample index.
    """

    def __init__(
        self,
        samples: Sequence[RawSample | dict[str, Any]],
        config: ModelConfig,
        scaler: ShapeScaler,
        *,
        image_folder: str | os.PathLike[str] | None = None,
        video_folder: str | os.PathLike[str] | None = None,
        tokenizer: Any = None,
        seed: int = 0,
        family: str | FamilySpec = "llava-ov",
        text_counter: TextTokenCounter | None = None,
    ) -> None:
        vision = config.vision
        if (scaler.tokens_per_unit, scaler.visual_newline) != (
            vision.tokens_per_unit,
            config.decoder.image_newline,
        ):
            raise ValueError(
                f"the scaler has tokens_per_unit={scaler.tokens_per_unit} and "
                f"visual_newline={scaler.visual_newline}, the model {vision.tokens_per_unit} "
                f"and {config.decoder.image_newline}: use ShapeScaler.for_model(config)"
            )
        if config.decoder.vocab_size <= RESERVED_TOKEN_IDS:
            raise ValueError(
                f"DatasetBatch needs vocab_size > {RESERVED_TOKEN_IDS} (special tokens), got "
                f"{config.decoder.vocab_size}"
            )
        self.config = config
        self.scaler = scaler
        self.seed = seed
        self.spec = get_family(family)
        self.counter = text_counter if text_counter is not None else make_text_counter(None)
        self._tokenizer_arg = tokenizer
        self._encode: Callable[[str], list[int]] | None = None
        self.stats = {"units_rendered": 0, "images_decoded": 0, "samples_tokenised": 0}
        """What this instance loaded: rendered units (cache misses), decoded image files
        and tokenised samples."""
        images = os.fspath(image_folder) if image_folder is not None else "."
        videos = os.fspath(video_folder) if video_folder is not None else images
        raws = [_as_raw(s, i, images, videos) for i, s in enumerate(samples)]
        self.records = raws
        descriptors = [self._describe(raw, i) for i, raw in enumerate(raws)]
        self.shapes: SampleShapes = scaler.scale(descriptor_shapes(self.spec, descriptors))
        self._plans = [self._plan(i, raw, d) for i, (raw, d) in enumerate(zip(raws, descriptors))]
        too_long = np.flatnonzero(self.shapes.seq_len > config.decoder.max_seq_len)
        if too_long.size:
            i = int(too_long[0])
            raise ValueError(
                f"{self._plans[i].where}: {int(self.shapes.seq_len[i])} positions, more than "
                f"DecoderConfig.max_seq_len={config.decoder.max_seq_len}: lower the "
                "scaler's max_units_per_sample / max_text_tokens"
            )
        self._text_cache: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    # ------------------------------------------------------------------ public

    def __len__(self) -> int:
        return len(self._plans)

    def where(self, sample_id: int) -> str:
        """``file: sample I`` of a sample (its batch position for a plain dict)."""
        return self._plans[sample_id].where

    def target_tokens(self) -> np.ndarray:
        """(N,) int64: target tokens of every sample (known without tokenising)."""
        return np.array([p.target_tokens for p in self._plans], dtype=np.int64)

    # ------------------------------------------------------------------ describing

    def _describe(self, raw: RawSample, i: int) -> SampleDescriptor:
        where = _where(raw, i)
        try:
            d = describe_sample(raw, self.counter, _HEADER_CACHE)
            check_loadable(raw, d)
        except SampleError as err:
            raise DatasetSampleError(f"{where}: {err.reason}: {err.message}") from None
        return d

    def _plan(self, i: int, raw: RawSample, d: SampleDescriptor) -> _Plan:
        turns = [(is_answer_turn(str(t["from"])), t["value"]) for t in raw.data["conversations"]]
        plan = _Plan(_where(raw, i), d, turns)
        u = int(self.shapes.encoder_units[i])
        if d.modality != Modality.TEXT:
            full = self._all_units(raw, d)
            if u > len(full):  # pragma: no cover - the scaler never adds units
                raise DatasetSampleError(f"{plan.where}: {u} units wanted, {len(full)} available")
            picks = np.round(np.linspace(0, len(full) - 1, u)).astype(np.int64) if u else []
            plan.units = [full[int(k)] for k in picks]
        num_items = len(d.image_sizes_px) if d.modality != Modality.VIDEO else 1
        self._place_items(plan, num_items if d.modality != Modality.TEXT else 0)
        budget = int(self.shapes.text_tokens[i])
        targets = int(self.shapes.target_tokens[i])
        weights = [1 + self.counter.body(t) for _, t in turns]
        answers = [k for k, (ans, _) in enumerate(turns) if ans]
        others = [k for k, (ans, _) in enumerate(turns) if not ans]
        if targets and not answers:  # pragma: no cover - targets are counted from answers
            raise RuntimeError(f"{plan.where}: {targets} target tokens but no answer turn")
        plan.quotas = [0] * len(turns)
        pools = ((answers, targets, 0), (others, budget - 1 - targets, None))
        for members, pool, first in pools:
            if not members:
                continue
            for k, q in zip(members, _quotas(pool, [weights[k] for k in members], first)):
                plan.quotas[k] = q
        if not others:
            plan.lead_pad = budget - 1 - targets
        plan.target_tokens = targets
        return plan

    def _all_units(self, raw: RawSample, d: SampleDescriptor) -> list[_Unit]:
        """Every unit of the family's rule for the sample (before the scaler's cap)."""
        spec = self.spec
        if d.modality == Modality.VIDEO:
            return [_Unit("", "frame", index=k) for k in range(d.num_frames)]
        paths = image_paths(raw)  # one per size (describe_sample reads them together)
        multi = d.modality == Modality.MULTI_IMAGE
        units = tiling_rule(spec).image_units(spec, list(d.image_sizes_px), multi)
        return [_Unit(paths[u.item], u.kind, u.rows, u.cols, u.index, u.item) for u in units]

    def _place_items(self, plan: _Plan, num_items: int) -> None:
        slots = sum(
            1
            for _, text in plan.turns
            for piece in _PLACEHOLDER_SPLIT.split(text)
            if piece in VISUAL_PLACEHOLDERS
        )
        plan.slot_items = [[] for _ in range(slots)]
        items = list(range(num_items))
        if not items:
            return
        if slots == num_items:
            plan.slot_items = [[k] for k in items]
        elif slots:
            plan.slot_items[0] = items
        else:
            plan.prepend_items = items

    # ------------------------------------------------------------------ pixels

    def _render_units(self, sample_id: int, first: int, count: int) -> Tensor:
        """Units ``[first, first + count)`` of a sample, ``[count, C, H, W]`` in ``[-1,
        1]``: only the files those units come from are decoded."""
        plan = self._plans[sample_id]
        v = self.config.vision
        units = plan.units[first : first + count]
        if not units:
            return torch.zeros(0, v.channels, v.image_size_px, v.image_size_px)
        out: list[Tensor | None] = [None] * len(units)
        missing: dict[str, list[tuple[int, tuple, _Unit]]] = {}  # by file: decode once
        for pos, unit in enumerate(self._file_units(sample_id, units)):
            key = (*_file_key(unit.path), unit.kind, unit.rows, unit.cols, unit.index)
            key = (*key, v.image_size_px, v.channels)
            hit = _UNIT_CACHE.get(key)
            if hit is not None:
                out[pos] = hit
            else:
                missing.setdefault(unit.path, []).append((pos, key, unit))
        for path, wanted in missing.items():
            image = self._decode(path, plan.where)
            canvases: dict[tuple[str, int, int], Any] = {}
            for pos, key, unit in wanted:
                tensor = _to_tensor(self._unit_image(image, unit, canvases), v.channels)
                self.stats["units_rendered"] += 1
                _UNIT_CACHE.put(key, tensor)
                out[pos] = tensor
        return torch.stack(out)  # type: ignore[arg-type]

    def _file_units(self, sample_id: int, units: list[_Unit]) -> list[_Unit]:
        """``units`` with a video's frame units mapped to their frame files (unit k of the
        descriptor's frames -> its file)."""
        plan = self._plans[sample_id]
        if plan.descriptor.modality != Modality.VIDEO:
            return units
        frames = _video_frame_paths(self.records[sample_id], plan.where)
        num_frames = max(plan.descriptor.num_frames, 1)
        return [
            _Unit(frames[min(len(frames) - 1, unit.index * len(frames) // num_frames)], "full")
            for unit in units
        ]

    def visual_files(self, sample_id: int) -> list[str]:
        units = self._file_units(sample_id, self._plans[sample_id].units)
        return list(dict.fromkeys(unit.path for unit in units))

    def _unit_image(self, image: Any, unit: _Unit, canvases: dict) -> Any:
        """The ``side x side`` PIL image of ``unit`` cut from the decoded ``image``."""
        pil = _pil()
        side = self.config.vision.image_size_px
        if unit.kind in ("full", "frame"):
            return image.resize((side, side), pil.Resampling.BICUBIC)
        grid = (unit.kind, unit.rows, unit.cols)
        canvas = canvases.get(grid)
        if canvas is None:
            if unit.kind == "anyres":
                canvas = _anyres_canvas(image, unit.rows, unit.cols, side, pil)
            else:
                size = (unit.cols * side, unit.rows * side)
                canvas = image.resize(size, pil.Resampling.BICUBIC)
            canvases[grid] = canvas
        r, c = divmod(unit.index, unit.cols)
        return canvas.crop((c * side, r * side, (c + 1) * side, (r + 1) * side))

    def _decode(self, path: str, where: str) -> Any:
        from dflop.safe_io import check_regular_file

        pil = _pil()
        try:
            check_regular_file(path, "image")  # a file swapped for a pipe must not block
            with pil.open(path) as image:
                image.load()
                rgb = image.convert("RGB")
        except (OSError, ValueError, SyntaxError) as exc:  # PIL raises these for bad files
            raise DatasetSampleError(f"{where}: cannot decode image {path!r}: {exc}") from None
        self.stats["images_decoded"] += 1
        return rgb

    # ------------------------------------------------------------------ text

    def _sample_text(self, sample_id: int) -> tuple[Tensor, Tensor, Tensor]:
        hit = self._text_cache.get(sample_id)
        if hit is not None:
            return hit
        if self._encode is None:
            _, self._encode = _text_encoder(self._tokenizer_arg, self.config.decoder.vocab_size)
        plan = self._plans[sample_id]
        tpu = self.config.vision.tokens_per_unit
        per_item = np.bincount([u.item for u in plan.units], minlength=1) * tpu
        if plan.units and self.config.decoder.image_newline:
            per_item[plan.units[-1].item] += 1  # the newline row follows the last unit
        tokens: list[int] = [BOS_TOKEN_ID] + [END_TOKEN_ID] * plan.lead_pad
        labels: list[int] = [IGNORE_INDEX] * (1 + plan.lead_pad)
        mask: list[bool] = [False] * (1 + plan.lead_pad)

        def visual(items: list[int]) -> None:
            n = int(sum(int(per_item[k]) for k in items if k < len(per_item)))
            tokens.extend([IMAGE_TOKEN_ID] * n)
            labels.extend([IGNORE_INDEX] * n)
            mask.extend([True] * n)

        slot = 0
        for k, ((is_answer, text), quota) in enumerate(zip(plan.turns, plan.quotas)):
            stream: list[int] = []  # token ids, _SLOT at placeholders
            for piece in _PLACEHOLDER_SPLIT.split(text):
                if piece in VISUAL_PLACEHOLDERS:
                    stream.append(_SLOT)
                elif piece:
                    stream.extend(self._encode(piece))
            role = quota >= 2 and not is_answer
            content = quota - 1 if role else quota
            if role:
                tokens.append(USER_TOKEN_ID)
                labels.append(IGNORE_INDEX)
                mask.append(False)
            if k == 0 and plan.prepend_items:
                visual(plan.prepend_items)
            taken = 0
            for t in stream:
                if t == _SLOT:
                    visual(plan.slot_items[slot])
                    slot += 1
                elif taken < content:
                    tokens.append(t)
                    labels.append(t if is_answer else IGNORE_INDEX)
                    mask.append(False)
                    taken += 1
            pad = content - taken
            tokens.extend([END_TOKEN_ID] * pad)
            labels.extend([END_TOKEN_ID if is_answer else IGNORE_INDEX] * pad)
            mask.extend([False] * pad)
        result = (
            torch.tensor(tokens, dtype=torch.long),
            torch.tensor(mask, dtype=torch.bool),
            torch.tensor(labels, dtype=torch.long),
        )
        expected = int(self.shapes.seq_len[sample_id])
        if result[0].numel() != expected:  # pragma: no cover - a bug, not a data problem
            raise RuntimeError(
                f"{plan.where}: laid out {result[0].numel()} positions, the shape says {expected}"
            )
        self.stats["samples_tokenised"] += 1
        self._text_cache[sample_id] = result
        return result


# --------------------------------------------------------------------------- helpers


def _as_raw(sample: RawSample | dict[str, Any], i: int, images: str, videos: str) -> RawSample:
    if isinstance(sample, RawSample):
        return sample
    return RawSample("", i, sample, images, videos)


def _where(raw: RawSample, i: int) -> str:
    if raw.source:
        return raw.where
    ident = raw.data.get("id") if isinstance(raw.data, dict) else None
    return f"batch sample {i}" + (f" (id {ident!r})" if ident is not None else "")


def _video_frame_paths(raw: RawSample, where: str) -> list[str]:
    """The frame files of a video sample: the ``frames`` list of paths, else the image files
    of the frames folder, sorted by name."""
    problem = frames_folder_problem(raw)
    if problem is not None:
        raise DatasetSampleError(f"{where}: {problem}")
    frames = raw.data.get("frames")
    if isinstance(frames, list):
        return [os.path.join(raw.video_folder, f) for f in frames]
    path = os.path.join(raw.video_folder, raw.data["video"])
    with os.scandir(path) as entries:
        names = sorted(
            e.name
            for e in entries
            if e.name.lower().endswith(FRAME_FILE_EXTENSIONS) and e.is_file()
        )
    if not names:
        raise DatasetSampleError(f"{where}: frames folder {path!r} holds no image files")
    return [os.path.join(path, n) for n in names]


def _file_key(path: str) -> tuple[str, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (path, -1, -1)
    return (os.path.abspath(path), st.st_mtime_ns, st.st_size)


def _quotas(budget: int, weights: list[int], first: int | None) -> list[int]:
    """Split ``budget`` positions over turns in proportion to ``weights`` (> 0; largest
    remainder, earlier turns first on ties); turn ``first`` gets at least one."""
    total = sum(weights)
    quotas = [budget * w // total for w in weights]
    rest = budget - sum(quotas)
    order = sorted(range(len(weights)), key=lambda k: (-(budget * weights[k] % total), k))
    for k in order[:rest]:
        quotas[k] += 1
    if first is not None and quotas[first] == 0 and budget > 0:
        donor = max(range(len(quotas)), key=lambda k: (quotas[k], -k))
        quotas[donor] -= 1
        quotas[first] += 1
    return quotas
