"""Readers of LLaVA-family datasets: JSON, JSONL and YAML recipes of several files.

Sample format
-------------
A sample is a JSON object with ``conversations`` (a list of ``{"from": ..., "value": ...}``
turns) and optionally ``image`` (a path, or a list of paths, relative to the image folder)
or ``video`` (a video file or a folder of frames, relative to the video folder). This
module only *reads* samples; what they cost is :mod:`dflop.data.profiler`'s job.

* ``.json``: one JSON list of samples (loaded whole, as LLaVA's own loader does).
* ``.jsonl``: one sample per line, streamed line by line (blank lines are skipped and do
  not count as samples); a line that is not valid JSON becomes a :class:`RawSample` with
  ``error`` set, so the profiler can count it instead of dying.
* ``.yaml`` / ``.yml``: a training recipe in the LLaVA-OneVision format::

      image_folder: images        # optional, default for every entry
      video_folder: videos        # optional
      datasets:
        - json_path: data/a.json
          sampling_strategy: all           # the default
        - json_path: data/b.jsonl
          sampling_strategy: first:1000    # the first N samples
        - json_path: data/c.json
          sampling_strategy: first:10%     # the first ceil(P% of the file) samples
        - json_path: data/d.json
          sampling_strategy: end:500       # the last N (also end:P%)
        - json_path: data/e.json
          sampling_strategy: random:2000   # N samples at random (also random:P%)
          image_folder: other_images       # optional, this entry only

  Relative paths in a recipe are relative to the recipe's folder (``json_path`` also
  falls back to the current directory). ``random:`` draws without replacement, with a
  ``numpy`` generator seeded by ``(seed, entry position)``: the same seed gives the same
  samples. Selected samples are read in file order. A count larger than the file takes
  the whole file. PyYAML is used when installed; otherwise a built-in reader handles
  this recipe format (``key: value`` pairs and a ``datasets:`` list of such mappings).

Folders
-------
Image folder of an entry: the entry's ``image_folder`` key, else the ``image_folder``
argument, else the recipe's top-level ``image_folder`` key, else the folder of the
entry's JSON file. Video folder: the same chain with ``video_folder``, ending with the
entry's image folder. A sample's image / video / frame paths must stay under these
folders: one that is absolute or resolves outside (``..``, symlinks) is skipped with
reason ``outside_folder`` unless ``allow_outside_paths`` is set
(:func:`dflop.data.reader.check_confined`).

File-level problems (a missing file, a JSON file that is not a list or is nested too deeply
to parse, an unknown sampling strategy, a malformed recipe, a path that is a named pipe or
device rather than a regular file, a YAML recipe whose aliases expand past a bound) raise
:class:`DatasetError` naming the file; problems of a single sample never raise here (a
JSONL line nested too deeply is an unparseable line, like invalid JSON).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop.errors import bounded_repr
from dflop.safe_io import (
    load_json,
    load_yaml,
    loads_json,
    not_regular_reason,
    open_regular,
    path_repr,
)

__all__ = [
    "DATASET_SUFFIXES",
    "DatasetError",
    "DatasetSource",
    "RawSample",
    "SamplingStrategy",
    "dataset_sources",
    "iter_samples",
    "iter_source",
    "parse_sampling_strategy",
    "read_recipe",
]

DATASET_SUFFIXES = (".json", ".jsonl", ".yaml", ".yml")


class DatasetError(ValueError):
    """A dataset file (or recipe) cannot be read; the message names the file."""


@dataclass(frozen=True)
class SamplingStrategy:
    """A parsed ``sampling_strategy``.

    Attributes:
        kind: ``"all"``, ``"first"``, ``"end"`` or ``"random"``.
        count: number of samples (``first:N``/``end:N``/``random:N``), else None.
        percent: percentage of the file (``first:P%`` ...), else None.
        text: the strategy as written.
    """

    kind: str
    count: int | None = None
    percent: float | None = None
    text: str = "all"

    def num_selected(self, num_available: int) -> int:
        """How many of ``num_available`` samples the strategy selects (LLaVA's rule:
        ``ceil(P * n / 100)`` for percentages, ``min(N, n)`` for counts)."""
        if self.kind == "all":
            return num_available
        if self.percent is not None:
            return min(num_available, math.ceil(self.percent * num_available / 100.0))
        assert self.count is not None
        return min(num_available, self.count)

    @property
    def needs_total(self) -> bool:
        """Whether the file's sample count is needed before selecting (not for ``all`` and
        ``first:N``, which stream)."""
        return not (self.kind == "all" or (self.kind == "first" and self.percent is None))


_STRATEGY_RE = re.compile(r"^(first|end|random):\s*([0-9]+(?:\.[0-9]*)?)\s*(%?)$")


def parse_sampling_strategy(text: object, *, where: str = "sampling_strategy") -> SamplingStrategy:
    """Parse ``all``, ``first:N``, ``first:P%``, ``end:N``, ``end:P%``, ``random:N``,
    ``random:P%``.

    Raises:
        DatasetError: anything else (the message names ``where``).
    """
    if text is None:
        return SamplingStrategy("all")
    if not isinstance(text, str):
        raise DatasetError(f"{where}: sampling_strategy must be a string, got {bounded_repr(text)}")
    s = text.strip()
    if s == "all":
        return SamplingStrategy("all", text=s)
    m = _STRATEGY_RE.match(s)
    if m is None:
        raise DatasetError(
            f"{where}: unknown sampling_strategy {bounded_repr(text)}; expected all, first:N, "
            "first:P%, end:N, end:P%, random:N or random:P%"
        )
    kind, number, percent = m.groups()
    if percent:
        value = float(number)
        if value > 100.0:
            raise DatasetError(f"{where}: sampling_strategy {bounded_repr(text)} exceeds 100%")
        return SamplingStrategy(kind, percent=value, text=s)
    if "." in number:
        raise DatasetError(
            f"{where}: sampling_strategy {bounded_repr(text)} needs an integer count"
        )
    return SamplingStrategy(kind, count=int(number), text=s)


@dataclass(frozen=True)
class DatasetSource:
    """One dataset file to read, with its sampling strategy and folders.

    Attributes:
        path: the ``.json``/``.jsonl`` file.
        sampling_strategy: parsed strategy.
        image_folder: folder image paths are relative to.
        video_folder: folder video paths are relative to.
        position: position of the entry in its recipe (0 for a single file); seeds
            ``random:`` selections.
    """

    path: str
    sampling_strategy: SamplingStrategy
    image_folder: str
    video_folder: str
    position: int = 0


@dataclass(frozen=True)
class RawSample:
    """One sample as read from a dataset file.

    Attributes:
        source: path of the dataset file.
        index: 0-based position of the sample in the file (JSON list index; JSONL
            non-blank line count).
        data: the parsed JSON value (anything: validation is the profiler's), or None when
            ``error`` is set.
        image_folder, video_folder: folders the sample's paths are relative to.
        line: 1-based line number (JSONL only).
        error: why the sample could not be parsed (invalid JSON line), else None.
    """

    source: str
    index: int
    data: Any
    image_folder: str
    video_folder: str
    line: int | None = None
    error: str | None = None

    @property
    def where(self) -> str:
        """``file: sample I`` (plus the line for JSONL), for messages."""
        line = f" (line {self.line})" if self.line is not None else ""
        return f"{self.source}: sample {self.index}{line}"


# --------------------------------------------------------------------------- sources


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _check_dataset_file(path: str, where: str) -> None:
    name = path_repr(path)
    if not os.path.exists(path):
        raise DatasetError(f"{where}: dataset file {name} does not exist")
    if os.path.isdir(path):
        raise DatasetError(f"{where}: dataset path {name} is a folder, expected a file")
    problem = not_regular_reason(path)
    if problem is not None:  # a FIFO would block open() forever
        raise DatasetError(f"{where}: dataset file {name} {problem}")
    if _suffix(path) not in (".json", ".jsonl"):
        raise DatasetError(
            f"{where}: dataset file {name} must end with .json or .jsonl "
            f"(got {bounded_repr(_suffix(path) or 'no suffix')})"
        )


def _open(path: str, mode: str, what: str = "dataset file") -> Any:
    """``path`` opened for reading, refusing anything but a regular file (a named pipe
    would block ``open()`` forever) with a :class:`DatasetError`."""
    try:
        return open_regular(path, mode, what, encoding="utf-8" if mode == "r" else None)
    except FileNotFoundError:
        raise
    except ValueError as exc:
        raise DatasetError(str(exc)) from None


def dataset_sources(
    path: str | os.PathLike[str],
    *,
    image_folder: str | os.PathLike[str] | None = None,
    video_folder: str | os.PathLike[str] | None = None,
) -> list[DatasetSource]:
    """The dataset files behind ``path``: itself for ``.json``/``.jsonl``, the recipe's
    entries for ``.yaml``/``.yml``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DatasetError: unsupported suffix, malformed recipe, missing dataset file.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {path!r} does not exist")
    suffix = _suffix(path)
    if suffix in (".yaml", ".yml"):
        return read_recipe(path, image_folder=image_folder, video_folder=video_folder)
    if suffix not in (".json", ".jsonl"):
        raise DatasetError(
            f"dataset {path!r}: unsupported file type {suffix or '(no suffix)'!r}; "
            "expected .json, .jsonl, .yaml or .yml"
        )
    _check_dataset_file(path, path)
    images = os.fspath(image_folder) if image_folder is not None else os.path.dirname(path)
    videos = os.fspath(video_folder) if video_folder is not None else images
    return [DatasetSource(path, SamplingStrategy("all"), images or ".", videos or ".")]


def read_recipe(
    path: str | os.PathLike[str],
    *,
    image_folder: str | os.PathLike[str] | None = None,
    video_folder: str | os.PathLike[str] | None = None,
) -> list[DatasetSource]:
    """The entries of a LLaVA-OneVision YAML recipe (see the module docstring)."""
    path = os.fspath(path)
    try:
        with _open(path, "r", "recipe") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"recipe {path!r} does not exist") from None
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: the recipe is not UTF-8 text: {exc}") from None
    doc = _load_yaml(text, path)
    if not isinstance(doc, dict) or "datasets" not in doc:
        raise DatasetError(f"{path}: a recipe must be a mapping with a 'datasets' list")
    entries = doc["datasets"]
    if not isinstance(entries, list) or not entries:
        raise DatasetError(f"{path}: 'datasets' must be a non-empty list")
    base = os.path.dirname(path)

    def rel(value: object, key: str, where: str) -> str:
        if not isinstance(value, str) or not value:
            raise DatasetError(
                f"{where}: {key} must be a non-empty string, got {bounded_repr(value)}"
            )
        return value if os.path.isabs(value) else os.path.join(base, value)

    top_images = doc.get("image_folder")
    top_videos = doc.get("video_folder")
    sources = []
    for i, entry in enumerate(entries):
        where = f"{path}: datasets[{i}]"
        if not isinstance(entry, dict):
            raise DatasetError(
                f"{where} must be a mapping with json_path, got {bounded_repr(entry)}"
            )
        if "json_path" not in entry:
            raise DatasetError(f"{where} has no json_path")
        json_path = entry["json_path"]
        resolved = rel(json_path, "json_path", where)
        if not os.path.exists(resolved) and os.path.exists(str(json_path)):
            resolved = str(json_path)
        _check_dataset_file(resolved, where)
        strategy = parse_sampling_strategy(entry.get("sampling_strategy", "all"), where=where)
        if entry.get("image_folder") is not None:
            images = rel(entry["image_folder"], "image_folder", where)
        elif image_folder is not None:
            images = os.fspath(image_folder)
        elif top_images is not None:
            images = rel(top_images, "image_folder", f"{path}: image_folder")
        else:
            images = os.path.dirname(resolved) or "."
        if entry.get("video_folder") is not None:
            videos = rel(entry["video_folder"], "video_folder", where)
        elif video_folder is not None:
            videos = os.fspath(video_folder)
        elif top_videos is not None:
            videos = rel(top_videos, "video_folder", f"{path}: video_folder")
        else:
            videos = images
        sources.append(DatasetSource(resolved, strategy, images, videos, position=i))
    return sources


# --------------------------------------------------------------------------- YAML


def _load_yaml(text: str, path: str) -> Any:
    try:
        import yaml  # noqa: F401
    except ImportError:
        return _parse_simple_yaml(text, path)
    try:  # bounded: an alias bomb, a recursive alias or deep nesting is refused
        return load_yaml(text, path)
    except ValueError as exc:
        raise DatasetError(str(exc)) from None


def _scalar(value: str) -> Any:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    if value in ("", "~", "null", "None"):
        return None
    if re.fullmatch(r"[-+]?[0-9]+", value):
        return int(value)
    return value


def _strip_comment(line: str) -> str:
    # A '#' starts a comment at the line start or after whitespace, outside quotes.
    quote = None
    for k, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1] in " \t"):
            return line[:k]
    return line


def _parse_simple_yaml(text: str, path: str) -> dict[str, Any]:
    """The recipe subset of YAML: top-level ``key: value`` pairs and lists of flat
    mappings (``- key: value`` items continued by indented ``key: value`` lines)."""
    doc: dict[str, Any] = {}
    current_list: list[Any] | None = None
    current_item: dict[str, Any] | None = None
    item_indent = -1
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = _strip_comment(raw).rstrip()
        if not line.strip() or line.strip() in ("---", "..."):
            continue
        indent = len(line) - len(line.lstrip(" "))
        body = line.strip()
        where = f"{path}: line {lineno}"
        if indent == 0 and not body.startswith("- "):
            key, sep, value = body.partition(":")
            if not sep:
                raise DatasetError(f"{where}: expected 'key: value', got {bounded_repr(body)}")
            if value.strip():
                doc[key.strip()] = _scalar(value)
                current_list = None
            else:
                current_list = doc[key.strip()] = []
            current_item = None
            continue
        if current_list is None:
            raise DatasetError(f"{where}: unexpected indented line {bounded_repr(body)}")
        if body.startswith("- ") or body == "-":
            current_item = {}
            current_list.append(current_item)
            body = body[1:].strip()
            item_indent = indent + 2
            if not body:
                continue
        elif current_item is None or indent < item_indent:
            raise DatasetError(f"{where}: unexpected line {bounded_repr(body)}")
        key, sep, value = body.partition(":")
        if not sep or not key.strip():
            raise DatasetError(f"{where}: expected 'key: value', got {bounded_repr(body)}")
        assert current_item is not None
        current_item[key.strip()] = _scalar(value)
    return doc


# --------------------------------------------------------------------------- reading


def _count_jsonl_samples(path: str) -> int:
    with _open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _selection(source: DatasetSource, num_available: int, seed: int) -> np.ndarray | range:
    strategy = source.sampling_strategy
    k = strategy.num_selected(num_available)
    if strategy.kind in ("all", "first"):
        return range(k)
    if strategy.kind == "end":
        return range(num_available - k, num_available)
    rng = np.random.default_rng([int(seed), int(source.position)])
    return np.sort(rng.choice(num_available, size=k, replace=False))


def iter_source(source: DatasetSource, *, seed: int = 0) -> Iterator[RawSample]:
    """The samples :attr:`DatasetSource.sampling_strategy` selects from one file, in file
    order. JSONL files are streamed (a first counting pass only when the strategy needs
    the file's length)."""
    if _suffix(source.path) == ".jsonl":
        yield from _iter_jsonl(source, seed)
    else:
        yield from _iter_json(source, seed)


def _iter_json(source: DatasetSource, seed: int) -> Iterator[RawSample]:
    try:
        with _open(source.path, "r") as f:
            data = load_json(f)  # nesting too deep: a ValueError, not a RecursionError
    except DatasetError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{source.path}: invalid JSON file: {exc}") from None
    if not isinstance(data, list):
        raise DatasetError(
            f"{source.path}: a .json dataset must hold a list of samples, "
            f"got a {type(data).__name__}"
        )
    for i in _selection(source, len(data), seed):
        i = int(i)
        yield RawSample(source.path, i, data[i], source.image_folder, source.video_folder)


def _iter_jsonl(source: DatasetSource, seed: int) -> Iterator[RawSample]:
    strategy = source.sampling_strategy
    if strategy.needs_total:
        selected = _selection(source, _count_jsonl_samples(source.path), seed)
    elif strategy.kind == "first":
        assert strategy.count is not None
        selected = range(strategy.count)
    else:
        selected = None  # all
    if selected is not None and len(selected) == 0:
        return
    wanted = None if selected is None or isinstance(selected, range) else set(selected.tolist())
    last = None if selected is None else int(selected[-1])
    index = -1
    with _open(source.path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            index += 1
            if wanted is not None:
                if index not in wanted:
                    continue
            elif isinstance(selected, range) and index not in selected:
                continue
            try:
                data, error = loads_json(line.decode("utf-8")), None
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too deep
                data, error = None, f"invalid JSON: {exc}"
            yield RawSample(
                source.path,
                index,
                data,
                source.image_folder,
                source.video_folder,
                line=lineno,
                error=error,
            )
            if last is not None and index >= last:
                return


def iter_samples(
    path: str | os.PathLike[str],
    *,
    image_folder: str | os.PathLike[str] | None = None,
    video_folder: str | os.PathLike[str] | None = None,
    seed: int = 0,
) -> Iterator[RawSample]:
    """Every selected sample of a ``.json``/``.jsonl`` file or ``.yaml`` recipe, in order
    (see the module docstring for formats, strategies and folders)."""
    for source in dataset_sources(path, image_folder=image_folder, video_folder=video_folder):
        yield from iter_source(source, seed=seed)
