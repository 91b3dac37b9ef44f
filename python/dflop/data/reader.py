"""One reader of a dataset's records, shared by the profiler and the training data.

The records a run trains on must be the ones whose shapes were profiled, so both walk a
dataset the same way: :class:`DatasetReader` reads the files of a ``.json``/``.jsonl``
dataset or a ``.yaml`` recipe in order (sampling strategies applied), describes each
record (:func:`~dflop.data.describe.describe_sample`: modality, text tokens, image sizes
from headers, video frames) and counts the records it cannot describe, by reason and by
file, keeping the first :data:`MAX_EXAMPLES_PER_REASON` examples of each reason.

* :func:`~dflop.data.profiler.profile_dataset` keeps the descriptors only (shapes).
* :func:`read_records` keeps the records too, and with ``loadable=True`` also skips those
  whose pixels cannot be found (an image known only from size fields, a video file without
  extracted frames): what :class:`~dflop.runtime.dataset_batch.DatasetBatch` renders.

Torch-free; nothing is decoded or tokenised beyond the text counter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dflop.data.dataset import DatasetSource, RawSample, dataset_sources, iter_source
from dflop.data.describe import (
    MAX_EXAMPLES_PER_REASON,
    ImageSizeCache,
    SampleDescriptor,
    SampleError,
    describe_sample,
)
from dflop.data.distribution import ShapeDistribution
from dflop.data.families import FamilySpec, get_family, shapes_from_descriptors
from dflop.data.length import LengthPolicy, TooLongError
from dflop.data.shapes import Modality, SampleShapes
from dflop.data.text_tokens import TextTokenCounter, make_text_counter
from dflop.safe_io import not_regular_reason, path_repr

__all__ = [
    "DatasetReader",
    "RecordSet",
    "check_confined",
    "descriptor_shapes",
    "frames_folder_problem",
    "image_paths",
    "read_records",
]


class DatasetReader:
    """Iterate ``(record, descriptor)`` over a dataset's describable records; the others
    are counted (:attr:`skipped` by reason, :attr:`examples`, :attr:`per_source`).

    Args:
        path: a ``.json``/``.jsonl`` dataset or a ``.yaml`` recipe.
        image_folder, video_folder: roots of relative paths (see :mod:`dflop.data.dataset`).
        text_counter: counts text tokens (default: the character estimate).
        seed: seed of ``random:`` sampling strategies.
        max_samples: stop after reading this many records (described + skipped).
        strict: raise ``ValueError`` naming the file and record at the first record that
            cannot be described, instead of counting it.
        loadable: also skip records whose pixels cannot be found (reason
            ``video_without_frames``, or ``missing_image`` for an image known only from
            size fields).
        allow_outside_paths: accept image / video / frame paths that are absolute or lead
            outside the record's image / video folder. By default such a record is skipped
            (reason ``outside_folder``, :func:`check_confined`) before any of its files is
            opened: a dataset reads only files under the folders it was given.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        image_folder: str | os.PathLike[str] | None = None,
        video_folder: str | os.PathLike[str] | None = None,
        text_counter: TextTokenCounter | None = None,
        seed: int = 0,
        max_samples: int | None = None,
        strict: bool = False,
        loadable: bool = False,
        allow_outside_paths: bool = False,
    ) -> None:
        if max_samples is not None and (
            isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 0
        ):
            raise ValueError(f"max_samples={max_samples!r} must be None or an int >= 0")
        self.path = os.fspath(path)
        self.counter = text_counter if text_counter is not None else make_text_counter(None)
        self.seed = int(seed)
        self.max_samples = max_samples
        self.strict = strict
        self.loadable = loadable
        self.allow_outside_paths = bool(allow_outside_paths)
        self._sources = dataset_sources(path, image_folder=image_folder, video_folder=video_folder)
        self.num_read = 0
        self.skipped: dict[str, int] = {}
        self.examples: list[dict[str, Any]] = []
        self.per_source: list[dict[str, Any]] = []

    def __iter__(self) -> Iterator[tuple[RawSample, SampleDescriptor]]:
        images = ImageSizeCache()  # repeated paths are read once
        roots: dict[str, str] = {}  # folder -> its real path
        for source in self._sources:
            if self.max_samples is not None and self.num_read >= self.max_samples:
                return
            stats = _source_stats(source)
            self.per_source.append(stats)
            for raw in iter_source(source, seed=self.seed):
                if self.max_samples is not None and self.num_read >= self.max_samples:
                    return
                self.num_read += 1
                stats["num_read"] += 1
                try:
                    if not self.allow_outside_paths:
                        check_confined(raw, roots)  # before any file of it is opened
                    descriptor = describe_sample(raw, self.counter, images)
                    if self.loadable:
                        check_loadable(raw, descriptor)
                except SampleError as err:
                    if self.strict:
                        raise ValueError(f"{raw.where}: {err.reason}: {err.message}") from None
                    stats["num_skipped"] += 1
                    self._skip(raw, err)
                    continue
                stats["num_profiled"] += 1
                yield raw, descriptor

    def _skip(self, raw: RawSample, err: SampleError) -> None:
        seen = self.skipped.get(err.reason, 0)
        self.skipped[err.reason] = seen + 1
        if seen < MAX_EXAMPLES_PER_REASON:
            self.examples.append(
                {
                    "reason": err.reason,
                    "file": raw.source,
                    "index": raw.index,
                    "line": raw.line,
                    "message": err.message,
                }
            )

    def distribution(
        self, samples: SampleShapes, family: str, extra: dict[str, Any] | None = None
    ) -> ShapeDistribution:
        """The profile of what was read: ``samples`` (the described records' shapes) with
        the counts and examples of what was skipped."""
        return ShapeDistribution(
            samples=samples,
            family=family,
            source=self.path,
            num_read=self.num_read,
            skipped=dict(self.skipped),
            skipped_examples=list(self.examples),
            sources=list(self.per_source),
            text_tokens_method=self.counter.method,
            extra={"seed": self.seed, "max_samples": self.max_samples, **(extra or {})},
        )


def _source_stats(source: DatasetSource) -> dict[str, Any]:
    return {
        "path": source.path,
        "sampling_strategy": source.sampling_strategy.text,
        "image_folder": source.image_folder,
        "video_folder": source.video_folder,
        "num_read": 0,
        "num_profiled": 0,
        "num_skipped": 0,
    }


def descriptor_shapes(spec: FamilySpec, descriptors: list[SampleDescriptor]) -> SampleShapes:
    """The shapes of described records under ``spec``'s rules (one vectorised call)."""
    if not descriptors:
        return SampleShapes.empty()
    owners = [i for i, d in enumerate(descriptors) for _ in d.image_sizes_px]
    sizes = [s for d in descriptors for s in d.image_sizes_px]
    frames = [d.frame_size_px or (0, 0) for d in descriptors]
    return shapes_from_descriptors(
        spec,
        np.array([d.modality for d in descriptors], dtype=np.int8),
        np.array([d.text_tokens for d in descriptors], dtype=np.int64),
        image_sample_index=np.array(owners, dtype=np.int64),
        image_width_px=np.array([s[0] for s in sizes], dtype=np.float64),
        image_height_px=np.array([s[1] for s in sizes], dtype=np.float64),
        video_num_frames=np.array([d.num_frames for d in descriptors], dtype=np.int64),
        video_frame_width_px=np.array([f[0] for f in frames], dtype=np.float64),
        video_frame_height_px=np.array([f[1] for f in frames], dtype=np.float64),
        target_tokens=np.array([d.target_tokens for d in descriptors], dtype=np.int64),
    )


# --------------------------------------------------------------------------- confined


def _inside(folder: str, name: str, roots: dict[str, str]) -> bool:
    root = roots.get(folder)
    if root is None:
        root = roots[folder] = os.path.realpath(folder)
    target = os.path.realpath(os.path.join(folder, name))
    try:
        return os.path.commonpath([root, target]) == root
    except ValueError:  # different drives (Windows)
        return False


def check_confined(raw: RawSample, roots: dict[str, str] | None = None) -> None:
    """Raise :class:`SampleError` (reason ``outside_folder``) when a record's ``image``
    path(s), ``video`` or ``frames`` paths resolve (``..``, symlinks, an absolute path:
    :func:`os.path.realpath`) outside its image / video folder; ``bad_image_field`` /
    ``bad_video_field`` for a path holding a NUL character. Fields of other types are
    left to :func:`~dflop.data.describe.describe_sample` to report. ``roots`` caches the
    folders' real paths."""
    data = raw.data
    if not isinstance(data, dict):
        return
    roots = {} if roots is None else roots
    image = data.get("image")
    names = [image] if isinstance(image, str) else image if isinstance(image, list) else []
    checks = [("image", raw.image_folder, n) for n in names if isinstance(n, str) and n]
    video = data.get("video")
    if isinstance(video, str) and video:
        checks.append(("video", raw.video_folder, video))
    frames = data.get("frames")
    if video is not None and isinstance(frames, list):
        checks.extend(("frame", raw.video_folder, f) for f in frames if isinstance(f, str) and f)
    for kind, folder, name in checks:
        if "\0" in name:
            field = "bad_image_field" if kind == "image" else "bad_video_field"
            raise SampleError(field, f"{kind} path {path_repr(name)} holds a NUL character")
        if not _inside(folder, name, roots):  # where the path leads, however it is written
            where = "absolute, outside its folder" if os.path.isabs(name) else "outside its folder"
            raise SampleError(
                "outside_folder",
                f"{kind} path {path_repr(name)} is {where} (folder {path_repr(folder)}); "
                "dataset paths stay under the image / video folder unless "
                "allow_outside_paths (--allow-outside-paths) is set",
            )


# --------------------------------------------------------------------------- loadable


def image_paths(raw: RawSample) -> list[str]:
    """The image files of an image record (its ``image`` field, under its image folder)."""
    image = raw.data.get("image")
    paths = [image] if isinstance(image, str) else list(image)
    return [os.path.join(raw.image_folder, p) for p in paths]


def frames_folder_problem(raw: RawSample) -> str | None:
    """Why a video record's frames cannot be read (None when they can be listed)."""
    frames = raw.data.get("frames")
    if isinstance(frames, list) and frames and all(isinstance(f, str) for f in frames):
        return None
    path = os.path.join(raw.video_folder, raw.data["video"])
    if os.path.isdir(path):
        return None
    return (
        f"video {path_repr(path)} is not a frames folder; DatasetBatch reads video frames from a "
        "folder of images (dflop does not decode video files): extract its frames to a "
        "folder, or list the frame paths in 'frames'"
    )


def check_loadable(raw: RawSample, d: SampleDescriptor) -> None:
    """Raise :class:`SampleError` unless the record's pixels can be found (an image file
    that only size fields describe, a video file without extracted frames)."""
    if d.modality == Modality.VIDEO:
        problem = frames_folder_problem(raw)
        if problem is not None:
            raise SampleError("video_without_frames", problem)
        frames = raw.data.get("frames")
        if isinstance(frames, list):  # a named pipe among them would block the decoder
            for name in (f for f in frames if isinstance(f, str)):
                path = os.path.join(raw.video_folder, name)
                problem = not_regular_reason(path)
                if problem is not None:
                    raise SampleError("not_a_regular_file", f"frame {path_repr(path)} {problem}")
    elif d.modality != Modality.TEXT:
        for path in image_paths(raw):
            if not os.path.isfile(path):
                problem = not_regular_reason(path)
                if problem is not None:
                    raise SampleError("not_a_regular_file", f"image {path_repr(path)} {problem}")
                raise SampleError("missing_image", f"image file {path_repr(path)} does not exist")


# --------------------------------------------------------------------------- records


@dataclass
class RecordSet:
    """The records of a dataset that a :class:`~dflop.runtime.dataset_batch.DatasetBatch`
    can load, and their shapes.

    ``distribution`` is their profile (same order as ``records``); :meth:`draw` picks
    records with the same generator as ``ShapeDistribution.sample``, so
    ``draw(n, seed)`` are the records whose shapes ``distribution.sample(n, seed)`` gives.
    """

    records: list[RawSample]
    distribution: ShapeDistribution
    _fingerprint: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.records)

    def fingerprint(self) -> dict[str, Any]:
        """What a step's batch is drawn from, in short: the number of records and a
        SHA-256 of each one's position in its file and content, in order (a batch is a
        list of positions in ``records``). A checkpoint saves it; a resume on records that
        differ (the file edited, shuffled or cut; an image gone, which drops its record)
        is refused. About half a second for 200k records; computed once."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for raw in self.records:
                digest.update(json.dumps([raw.index, raw.data]).encode("utf-8", "replace"))
                digest.update(b"\n")
            self._fingerprint = {"records": len(self.records), "sha256": digest.hexdigest()}
        return dict(self._fingerprint)

    def indices(self, num_samples: int, seed: int = 0) -> np.ndarray:
        if len(self.records) == 0:
            raise ValueError(f"no loadable records in {self.distribution.source}")
        rng = np.random.default_rng(int(seed))
        return rng.integers(0, len(self.records), size=int(num_samples))

    def draw(self, num_samples: int, seed: int = 0) -> list[RawSample]:
        """``num_samples`` records uniformly with replacement (``ShapeDistribution.sample``'s
        draw)."""
        return [self.records[int(k)] for k in self.indices(num_samples, seed)]

    def limited(self, policy: LengthPolicy, counter: TextTokenCounter) -> RecordSet:
        """The records under ``policy`` (:mod:`dflop.data.length`): over-long ones with
        their text cut (shapes as the runtime will cut them: the targets left in the kept
        text, by ``counter``, the one that counted them), or left out and counted as
        ``too_long``; with ``"error"``, :class:`~dflop.data.length.TooLongError` at the
        first one. Returns ``self`` when every record fits."""
        dist = self.distribution
        shapes = dist.samples
        keep, cut = policy.outcome(shapes)
        over = np.flatnonzero(shapes.seq_len > policy.max_seq_len)
        if over.size == 0:
            return self
        if policy.too_long == "error":
            i = int(over[0])
            raise TooLongError(policy.describe(self.records[i].where, shapes, i))
        text = shapes.text_tokens.copy()
        targets = shapes.target_tokens.copy()
        for i in np.flatnonzero(cut):
            text[i] = policy.max_seq_len - int(shapes.llm_visual_tokens[i])
            turns = [(t["from"], t["value"]) for t in self.records[i].data["conversations"]]
            targets[i] = min(counter.targets_in_prefix(turns, int(text[i])), int(text[i]))
        limited = replace(shapes, text_tokens=text, target_tokens=targets).take(keep)
        dropped = np.flatnonzero(~keep)
        skipped = dict(dist.skipped)
        examples = list(dist.skipped_examples)
        if dropped.size:
            skipped["too_long"] = skipped.get("too_long", 0) + int(dropped.size)
        for i in dropped[:MAX_EXAMPLES_PER_REASON]:
            raw = self.records[int(i)]
            examples.append(
                {
                    "reason": "too_long",
                    "file": raw.source,
                    "index": raw.index,
                    "line": raw.line,
                    "message": policy.describe(raw.where, shapes, int(i)),
                }
            )
        extra = {
            **dist.extra,
            "length_policy": {
                "max_seq_len": policy.max_seq_len,
                "too_long": policy.too_long,
                "why": policy.why,
                "truncated": int(cut.sum()),
                "skipped": int(dropped.size),
            },
        }
        profile = dataclasses.replace(
            dist, samples=limited, skipped=skipped, skipped_examples=examples, extra=extra
        )
        return RecordSet([self.records[int(i)] for i in np.flatnonzero(keep)], profile)


def read_records(
    path: str | os.PathLike[str],
    family: str | FamilySpec = "llava-ov",
    *,
    image_folder: str | os.PathLike[str] | None = None,
    video_folder: str | os.PathLike[str] | None = None,
    text_counter: TextTokenCounter | None = None,
    seed: int = 0,
    max_samples: int | None = None,
    allow_outside_paths: bool = False,
) -> RecordSet:
    """Read a ``.json``/``.jsonl`` dataset or ``.yaml`` recipe into the records a
    :class:`~dflop.runtime.dataset_batch.DatasetBatch` can load, plus their profile.
    Records the profiler would skip are counted by reason (``distribution.skipped``), as
    is a video *file* without extracted frames (reason ``video_without_frames``), and,
    unless ``allow_outside_paths``, a record whose paths leave its folders (reason
    ``outside_folder``, :class:`DatasetReader`); nothing is decoded or tokenised."""
    spec = get_family(family)
    reader = DatasetReader(
        path,
        image_folder=image_folder,
        video_folder=video_folder,
        text_counter=text_counter,
        seed=seed,
        max_samples=max_samples,
        loadable=True,
        allow_outside_paths=allow_outside_paths,
    )
    records: list[RawSample] = []
    descriptors: list[SampleDescriptor] = []
    for raw, descriptor in reader:
        records.append(raw)
        descriptors.append(descriptor)
    shapes = descriptor_shapes(spec, descriptors)
    return RecordSet(records, reader.distribution(shapes, spec.name, {"records": "loadable"}))
