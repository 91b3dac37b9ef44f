"""Data profiler: a LLaVA-family dataset -> the shape of every sample.

:func:`profile_dataset` reads a ``.json``/``.jsonl`` dataset or a ``.yaml`` recipe
(:mod:`dflop.data.dataset`), turns each sample into raw descriptors
(:func:`~dflop.data.describe.describe_sample`: modality, text tokens, image sizes, video
frames), and applies the model family's shape rules to a chunk of descriptors at a time
(:func:`dflop.data.families.shapes_from_descriptors`, vectorised). The result is a
:class:`~dflop.data.distribution.ShapeDistribution`.

What a sample becomes
---------------------
* ``image`` is a string, or a list of one path: a single image (anyres / dynamic tiling).
  A list of two or more paths: a multi-image sample (one tile per image in LLaVA-OneVision).
* ``video``: a video; its frames available are read from metadata (``num_frames`` or
  ``frames``: an int, or a list of frame paths), else counted in the frames folder
  (:func:`dflop.data.image_header.count_frame_files`). The family's frame cap (32) is
  applied by the shape rules. A video *file* without frame-count metadata is skipped with
  reason ``video_without_frame_count``: dflop has no video decoder dependency.
* neither: text-only (no encoder work).

Image sizes come from size fields of the sample when present, else from the image file's
header (:mod:`dflop.data.image_header`; no pixels are decoded; repeated paths are read
once). Size fields, all as (width, height) in pixels like ``PIL.Image.size``:
``image_size`` (``[w, h]``, ``{"width": w, "height": h}``, or a list of those, one per
image), ``image_sizes`` (a list of those), or ``width`` and ``height`` (ints, or lists
with one entry per image). Text tokens: :mod:`dflop.data.text_tokens`.

Paths and special files
-----------------------
Image, video and frame paths must stay under their folder: a sample whose path is
absolute or resolves (``..``, symlinks) outside its image / video folder is skipped with
reason ``outside_folder`` before anything of it is opened, unless
``allow_outside_paths=True``. A path that is a named pipe, device or socket is refused
without being opened (reason ``not_a_regular_file``: reading a named pipe would block
forever). Error messages name the file and what is wrong with it, never its bytes.

Unreadable samples
------------------
A sample that cannot be profiled is *skipped and counted* by reason
(:data:`~dflop.data.describe.REASONS`), with the first few examples (file, sample index,
message) kept in the profile, and a final total in :meth:`ShapeDistribution.summary`. Nothing is dropped silently. With
``strict=True`` the first such sample raises ``ValueError`` naming the file and the sample
index instead.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from dflop.data.describe import (
    MAX_EXAMPLES_PER_REASON,
    REASONS,
    SampleDescriptor,
    SampleError,
    describe_sample,
)
from dflop.data.distribution import ShapeDistribution
from dflop.data.families import FamilySpec, get_family
from dflop.data.reader import DatasetReader, descriptor_shapes
from dflop.data.shapes import SampleShapes
from dflop.data.text_tokens import TextTokenCounter, make_text_counter

__all__ = [
    "DataProfile",
    "MAX_EXAMPLES_PER_REASON",
    "REASONS",
    "SampleDescriptor",
    "SampleError",
    "describe_sample",
    "profile_dataset",
]

DataProfile = ShapeDistribution
"""What :func:`profile_dataset` returns (an alias of :class:`ShapeDistribution`)."""

CHUNK_SAMPLES = 4096


# --------------------------------------------------------------------------- profile


def _progress_bar(enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    try:
        isatty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        isatty = False
    if not isatty:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(desc=desc, unit=" samples", file=sys.stderr, dynamic_ncols=True)


def profile_dataset(
    path: str | os.PathLike[str],
    family: str | FamilySpec = "llava-ov",
    *,
    image_folder: str | os.PathLike[str] | None = None,
    video_folder: str | os.PathLike[str] | None = None,
    tokenizer: Any = None,
    strict: bool = False,
    progress: bool = True,
    seed: int = 0,
    max_samples: int | None = None,
    allow_outside_paths: bool = False,
    chunk_samples: int = CHUNK_SAMPLES,
) -> ShapeDistribution:
    """Profile a dataset: the shape of every (selected) sample under ``family``'s rules.

    Args:
        path: a ``.json``/``.jsonl`` dataset or a ``.yaml`` recipe
            (:mod:`dflop.data.dataset`).
        family: model family (``"llava-ov"``, ``"internvl"`` or a :class:`FamilySpec`).
        image_folder: folder image paths are relative to (default: the dataset file's
            folder; a recipe's own ``image_folder`` keys are used per entry, see
            :mod:`dflop.data.dataset`).
        video_folder: folder video paths are relative to (default: the image folder).
        tokenizer: ``None`` (character estimate), a local tokenizer folder, an object
            with ``encode``, or a callable ``text -> int`` (:mod:`dflop.data.text_tokens`).
        strict: raise ``ValueError`` (naming file and sample index) at the first sample
            that cannot be profiled, instead of counting it.
        progress: show a tqdm progress bar on stderr (only if tqdm is installed and stderr
            is a terminal).
        seed: seed of ``random:`` sampling strategies.
        max_samples: stop after reading this many samples (profiled + skipped).
        allow_outside_paths: accept image / video paths that are absolute or lead outside
            the image / video folder (``..``, symlinks). By default such a sample is
            skipped with reason ``outside_folder`` before any of its files is opened.
        chunk_samples: samples per vectorised call of the shape rules.

    Returns:
        A :class:`ShapeDistribution` with the shapes, per-reason skip counts and examples,
        and per-file counts.

    Raises:
        FileNotFoundError: the dataset does not exist.
        ValueError: unknown family; malformed dataset file or recipe (``DatasetError``);
            with ``strict=True``, an unreadable sample.
    """
    spec = get_family(family)
    if not isinstance(chunk_samples, int) or chunk_samples < 1:
        raise ValueError(f"chunk_samples={chunk_samples!r} must be an int >= 1")
    counter = tokenizer if isinstance(tokenizer, TextTokenCounter) else make_text_counter(tokenizer)
    reader = DatasetReader(
        path,
        image_folder=image_folder,
        video_folder=video_folder,
        text_counter=counter,
        seed=seed,
        max_samples=max_samples,
        strict=strict,
        allow_outside_paths=allow_outside_paths,
    )
    parts: list[SampleShapes] = []
    chunk: list[SampleDescriptor] = []
    bar = _progress_bar(progress, f"profiling {os.fspath(path)}")
    reported = 0
    try:
        for _, descriptor in reader:
            chunk.append(descriptor)
            if len(chunk) >= chunk_samples:
                parts.append(descriptor_shapes(spec, chunk))
                chunk = []
            if bar is not None and reader.num_read - reported >= 256:
                bar.update(reader.num_read - reported)
                reported = reader.num_read
        parts.append(descriptor_shapes(spec, chunk))
    finally:
        if bar is not None:
            bar.update(reader.num_read - reported)
            bar.close()
    return reader.distribution(SampleShapes.concat(parts), spec.name)
