"""One dataset record -> its raw descriptors: what the data profiler, the dataset reader
and the training data all read of a sample.

:func:`describe_sample` turns a record (:class:`~dflop.data.dataset.RawSample`) into a
:class:`SampleDescriptor` (modality, text and target tokens, image sizes, video frames),
or raises :class:`SampleError` with one of the :data:`REASONS` a sample is skipped for.
Image sizes come from the record's size fields, else from the files' headers through an
:class:`ImageSizeCache` (repeated paths are read once). What each field becomes, and how
paths and special files are treated: :mod:`dflop.data.profiler`.

Users: :class:`~dflop.data.reader.DatasetReader` (the one walk over a dataset's records),
:func:`~dflop.data.profiler.profile_dataset` (through the reader) and
:class:`~dflop.runtime.dataset_batch.DatasetBatch`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dflop.data.dataset import RawSample
from dflop.data.image_header import (
    FRAME_FILE_EXTENSIONS,
    ImageHeaderError,
    NotARegularFileError,
    count_frame_files,
    read_image_size,
)
from dflop.data.shapes import Modality
from dflop.data.text_tokens import TextTokenCounter
from dflop.errors import bounded_repr
from dflop.safe_io import path_repr

__all__ = [
    "MAX_EXAMPLES_PER_REASON",
    "REASONS",
    "ImageSizeCache",
    "SampleDescriptor",
    "SampleError",
    "describe_sample",
]

MAX_EXAMPLES_PER_REASON = 5
_IMAGE_CACHE_MAX = 1 << 20

REASONS: dict[str, str] = {
    "invalid_json": "the JSONL line is not valid JSON",
    "not_an_object": "the sample is not a JSON object",
    "missing_conversations": "no 'conversations' field",
    "bad_conversations": "'conversations' is not a non-empty list of {from, value} turns",
    "bad_image_field": "'image' is not a path or a non-empty list of paths",
    "bad_video_field": "'video' is not a path",
    "image_and_video": "the sample has both 'image' and 'video'",
    "bad_size_metadata": "size fields are malformed or do not match the images",
    "bad_frame_metadata": "'num_frames'/'frames' is malformed",
    "missing_image": "an image file does not exist",
    "not_a_regular_file": "an image or frame path is a folder, named pipe, device or socket, "
    "not a regular file (refused before opening: reading a named pipe blocks forever)",
    "outside_folder": "an image or video path is absolute or leads outside its image / video "
    "folder (symlinks resolved); allowed with allow_outside_paths (--allow-outside-paths)",
    "unreadable_image": "an image header cannot be parsed (corrupt or unsupported format)",
    "missing_video": "the video file or frames folder does not exist",
    "empty_frames_folder": "the video frames folder holds no image files",
    "video_without_frame_count": "a video file without frame-count metadata (no decoder)",
    "tokenizer_error": "the tokenizer failed on the text",
    "too_long": "longer than max_seq_len and not cut (dflop.data.length)",
}
"""Reasons a sample is skipped, with what they mean."""


class SampleError(Exception):
    """A sample cannot be profiled: ``reason`` (a key of :data:`REASONS`) and a message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class SampleDescriptor:
    """Raw descriptors of one sample (input of the family's shape rules).

    Attributes:
        modality: a :class:`Modality` code.
        text_tokens: text tokens of the conversation.
        target_tokens: its target (loss) tokens (:mod:`dflop.data.text_tokens`).
        image_sizes_px: ``(width_px, height_px)`` of each image (empty unless an image
            modality).
        num_frames: frames available (video only; 1 otherwise).
        frame_size_px: ``(width_px, height_px)`` of a video's first frame when its frames
            are image files (a frames folder or a ``frames`` list), else None.
    """

    modality: int
    text_tokens: int
    image_sizes_px: tuple[tuple[int, int], ...] = ()
    num_frames: int = 1
    frame_size_px: tuple[int, int] | None = None
    target_tokens: int = 0


def _as_size(value: Any) -> tuple[int, int] | None:
    if isinstance(value, dict):
        value = (value.get("width"), value.get("height"))
    if isinstance(value, (list, tuple)) and len(value) == 2:
        w, h = value
        if all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1 and v == int(v)
            for v in (w, h)
        ):
            return int(w), int(h)
    return None


def _metadata_sizes(data: dict[str, Any], num_images: int) -> list[tuple[int, int]] | None:
    """Image sizes from the sample's size fields; None when it has none."""
    for key in ("image_size", "image_sizes"):
        if data.get(key) is None:
            continue
        value = data[key]
        one = _as_size(value)
        if one is not None and key == "image_size":
            sizes = [one]
        elif isinstance(value, (list, tuple)):
            sizes = [_as_size(v) for v in value]
            if any(s is None for s in sizes):
                raise SampleError(
                    "bad_size_metadata",
                    f"{key}={bounded_repr(value)} must be [width, height] pairs of integers >= 1",
                )
        else:
            raise SampleError(
                "bad_size_metadata", f"{key}={bounded_repr(value)} must be [width, height] (pixels)"
            )
        if len(sizes) != num_images:
            raise SampleError(
                "bad_size_metadata",
                f"{key} gives {len(sizes)} size(s) for {num_images} image(s)",
            )
        return sizes  # type: ignore[return-value]
    if data.get("width") is not None or data.get("height") is not None:
        w, h = data.get("width"), data.get("height")
        if not isinstance(w, list):
            w, h = [w], [h]
        if not isinstance(h, list) or len(w) != len(h):
            raise SampleError(
                "bad_size_metadata",
                f"width={bounded_repr(data.get('width'))} and "
                f"height={bounded_repr(data.get('height'))} must both be ints or lists of "
                "equal length",
            )
        sizes = [_as_size((a, b)) for a, b in zip(w, h)]
        if any(s is None for s in sizes):
            raise SampleError(
                "bad_size_metadata",
                f"width={bounded_repr(data.get('width'))}, "
                f"height={bounded_repr(data.get('height'))} must be integers >= 1",
            )
        if len(sizes) != num_images:
            raise SampleError(
                "bad_size_metadata",
                f"width/height give {len(sizes)} size(s) for {num_images} image(s)",
            )
        return sizes  # type: ignore[return-value]
    return None


class ImageSizeCache:
    """Header sizes by resolved path (failures cached too), bounded."""

    def __init__(self) -> None:
        self._sizes: dict[str, tuple[int, int] | SampleError] = {}

    def size(self, path: str) -> tuple[int, int]:
        hit = self._sizes.get(path)
        if hit is None:
            hit = self._read(path)
            if len(self._sizes) >= _IMAGE_CACHE_MAX:
                self._sizes.clear()
            self._sizes[path] = hit
        if isinstance(hit, SampleError):
            raise hit
        return hit

    @staticmethod
    def _read(path: str) -> tuple[int, int] | SampleError:
        try:
            return read_image_size(path)  # refuses a named pipe before opening it
        except NotARegularFileError as exc:
            return SampleError("not_a_regular_file", str(exc))
        except FileNotFoundError:
            return SampleError("missing_image", f"image file {path_repr(path)} does not exist")
        except ImageHeaderError as exc:
            return SampleError("unreadable_image", str(exc))
        except OSError as exc:  # the message without the path again (it may be long)
            why = exc.strerror or type(exc).__name__
            return SampleError("unreadable_image", f"{path_repr(path)}: {why}")


def _turns(data: dict[str, Any]) -> list[tuple[str, str]]:
    if "conversations" not in data:
        raise SampleError("missing_conversations", "the sample has no 'conversations' field")
    conv = data["conversations"]
    if not isinstance(conv, list) or not conv:
        raise SampleError(
            "bad_conversations",
            f"'conversations' must be a non-empty list, got {bounded_repr(conv, 80)}",
        )
    turns = []
    for k, turn in enumerate(conv):
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get("value"), str)
            or not isinstance(turn.get("from"), str)
        ):
            raise SampleError(
                "bad_conversations",
                f"conversations[{k}] must be {{'from': str, 'value': str}}, "
                f"got {bounded_repr(turn, 80)}",
            )
        turns.append((turn["from"], turn["value"]))
    return turns


def _video_frames(data: dict[str, Any], video: Any, folder: str) -> int:
    for key in ("num_frames", "frames"):
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, list):
            value = len(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SampleError(
                "bad_frame_metadata",
                f"{key}={bounded_repr(data[key], 80)} must be an int >= 1 or a list",
            )
        return value
    if not isinstance(video, str) or not video:
        raise SampleError(
            "bad_video_field", f"'video' must be a path, got {bounded_repr(video, 80)}"
        )
    path = os.path.join(folder, video)
    if os.path.isdir(path):
        try:
            frames = count_frame_files(path)
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
            raise SampleError("missing_video", f"frames folder {path_repr(path)}: {why}") from None
        if frames == 0:
            raise SampleError(
                "empty_frames_folder", f"frames folder {path_repr(path)} has no images"
            )
        return frames
    if os.path.exists(path):
        raise SampleError(
            "video_without_frame_count",
            f"video file {path_repr(path)} has no 'num_frames' metadata; dflop does not decode "
            "videos: add num_frames to the sample or extract frames to a folder",
        )
    raise SampleError("missing_video", f"video {path_repr(path)} does not exist")


def _first_frame(data: dict[str, Any], video: Any, folder: str) -> str | None:
    """The path of a video's first frame image (``frames`` list or frames folder)."""
    frames = data.get("frames")
    if isinstance(frames, list) and frames and isinstance(frames[0], str):
        return os.path.join(folder, frames[0])
    path = os.path.join(folder, video) if isinstance(video, str) and video else None
    if path is None or not os.path.isdir(path):
        return None
    names = sorted(
        n
        for n in os.listdir(path)
        if n.lower().endswith(FRAME_FILE_EXTENSIONS) and os.path.isfile(os.path.join(path, n))
    )
    return os.path.join(path, names[0]) if names else None


def describe_sample(
    raw: RawSample, count_text: TextTokenCounter, images: ImageSizeCache | None = None
) -> SampleDescriptor:
    """The raw descriptors of one sample (see the module docstring).

    Raises:
        SampleError: the sample cannot be profiled (reason and message).
    """
    if raw.error is not None:
        raise SampleError("invalid_json", raw.error)
    data = raw.data
    if not isinstance(data, dict):
        raise SampleError(
            "not_an_object",
            f"expected a JSON object, got {type(data).__name__}: {bounded_repr(data, 80)}",
        )
    turns = _turns(data)
    try:
        text_tokens, target_tokens = (int(v) for v in count_text.count_turns(turns))
    except Exception as exc:  # a user tokenizer may raise anything
        raise SampleError("tokenizer_error", f"{type(exc).__name__}: {exc}") from None
    counts = {"text_tokens": text_tokens, "target_tokens": target_tokens}
    image = data.get("image")
    video = data.get("video")
    if image is not None and video is not None:
        raise SampleError("image_and_video", "a sample may have 'image' or 'video', not both")
    if video is not None:
        frames = _video_frames(data, video, raw.video_folder)
        first = _first_frame(data, video, raw.video_folder)
        size = None
        if first is not None:
            size = (images if images is not None else ImageSizeCache()).size(first)
        return SampleDescriptor(Modality.VIDEO, num_frames=frames, frame_size_px=size, **counts)
    if image is None:
        return SampleDescriptor(Modality.TEXT, **counts)
    paths = [image] if isinstance(image, str) else image
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise SampleError(
            "bad_image_field",
            f"'image' must be a path or a non-empty list of paths, got {bounded_repr(image, 80)}",
        )
    sizes = _metadata_sizes(data, len(paths))
    if sizes is None:
        cache = images if images is not None else ImageSizeCache()
        sizes = [cache.size(os.path.join(raw.image_folder, p)) for p in paths]
    modality = Modality.IMAGE if len(paths) == 1 else Modality.MULTI_IMAGE
    return SampleDescriptor(modality, image_sizes_px=tuple(sizes), **counts)
