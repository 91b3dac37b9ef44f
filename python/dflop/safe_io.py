"""Reading user files without hanging, exploding or echoing their contents.

Every file dflop reads on a user's behalf (datasets and their images, recipes, config,
plan, performance-model and shapes files) goes through these helpers:

* :func:`check_regular_file` / :func:`open_regular`: a path must be a regular file. A named
  pipe (FIFO), device or socket is refused *before* it is opened (``open()`` on a FIFO
  blocks until a writer appears, i.e. forever), and the file is then opened non-blocking
  and checked again on the open descriptor, so swapping the path for a pipe in between
  cannot hang either.
* :func:`load_json`, :func:`loads_json`: JSON nested deeper than Python's recursion limit
  is a :class:`JSONTooDeepError` (a ``ValueError``), not a ``RecursionError`` traceback.
* :func:`load_yaml`: PyYAML's safe loader with a bound on alias expansion (a 1 KB
  "billion laughs" document of nested anchors would otherwise stand for billions of
  nodes, which a ``repr`` in an error message or any walk over the value expands),
  recursive aliases refused, and deep nesting a ``ValueError``.
* :func:`path_repr`: a path quoted in an error message, bounded (its start and file name
  kept); other user values are quoted with :func:`dflop.errors.bounded_repr`.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import IO, Any

from dflop.errors import bounded_repr

__all__ = [
    "MAX_PATH_CHARS",
    "MAX_YAML_ALIAS_NODES",
    "JSONTooDeepError",
    "check_regular_file",
    "load_json",
    "load_yaml",
    "loads_json",
    "not_regular_reason",
    "open_regular",
    "path_repr",
]

MAX_PATH_CHARS = 240
"""Longest :func:`path_repr` (paths quoted in error messages)."""

MAX_YAML_ALIAS_NODES = 100_000
"""How many nodes aliases may add to a YAML document when expanded (beyond the nodes the
document itself holds); more is refused (:func:`load_yaml`)."""


# --------------------------------------------------------------------------- repr


def path_repr(path: str | os.PathLike[str], limit: int = MAX_PATH_CHARS) -> str:
    """``repr`` of a path for a message, at most about ``limit`` characters: a longer one
    keeps its start and its end (the file name), cut in the middle."""
    text = repr(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else bounded_repr(path)
    if len(text) <= limit:
        return text
    head = max(1, limit // 3)
    return f"{text[:head]}...{text[-(limit - head - 3) :]}"


# --------------------------------------------------------------------------- regular files


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def not_regular_reason(path: str | os.PathLike[str]) -> str | None:
    """``"is a named pipe (FIFO), not a regular file"`` (device, socket ...) when ``path``
    exists and is neither a regular file nor a folder; None otherwise (a regular file, a
    folder, or nothing there: those the caller words itself). Symlinks are followed."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return f"is {_kind(mode)}, not a regular file"


def check_regular_file(path: str | os.PathLike[str], what: str = "file") -> None:
    """Raise unless ``path`` is a regular file (symlinks followed), without opening it.

    Raises:
        FileNotFoundError: nothing there.
        ValueError: a folder, named pipe, device or socket (the message names ``what``
            and the path).
    """
    name = os.fspath(path)
    try:
        mode = os.stat(name).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path_repr(name)} does not exist") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what} {path_repr(name)} is {_kind(mode)}, not a regular file")


def open_regular(
    path: str | os.PathLike[str],
    mode: str = "r",
    what: str = "file",
    *,
    encoding: str | None = None,
) -> IO[Any]:
    """``open(path, mode)`` for reading (``"r"`` or ``"rb"``), refusing anything but a
    regular file: checked with :func:`check_regular_file` before opening, then opened
    non-blocking (opening a FIFO that way returns at once) and checked again on the open
    descriptor."""
    if mode not in ("r", "rb"):
        raise ValueError(f"open_regular reads only (mode 'r' or 'rb'), got {mode!r}")
    name = os.fspath(path)
    check_regular_file(name, what)
    nonblock = getattr(os, "O_NONBLOCK", 0)
    fd = os.open(name, os.O_RDONLY | nonblock | getattr(os, "O_BINARY", 0))
    try:
        file_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(file_mode):
            raise ValueError(f"{what} {path_repr(name)} is {_kind(file_mode)}, not a regular file")
        if nonblock:
            os.set_blocking(fd, True)
        if mode == "rb":
            return os.fdopen(fd, "rb")
        return os.fdopen(fd, "r", encoding=encoding or "utf-8")
    except BaseException:
        os.close(fd)
        raise


# --------------------------------------------------------------------------- JSON


class JSONTooDeepError(ValueError):
    """JSON nested deeper than this Python can parse (its recursion limit)."""

    def __init__(self) -> None:
        super().__init__(
            "JSON nested too deeply (arrays/objects more than about "
            f"{sys.getrecursionlimit()} levels deep)"
        )


def loads_json(text: str | bytes) -> Any:
    """``json.loads``, with too-deep nesting a :class:`JSONTooDeepError`."""
    try:
        return json.loads(text)
    except RecursionError:
        raise JSONTooDeepError() from None


def load_json(f: IO[Any]) -> Any:
    """``json.load``, with too-deep nesting a :class:`JSONTooDeepError`."""
    try:
        return json.load(f)
    except RecursionError:
        raise JSONTooDeepError() from None


# --------------------------------------------------------------------------- YAML


def _children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_expansion(root: Any, where: str, max_alias_nodes: int) -> None:
    """Refuse a composed YAML node graph whose expansion (every alias replaced by a copy
    of its anchor's node) holds more than ``max_alias_nodes`` nodes beyond the graph's
    own, or that refers to itself (a recursive alias). Iterative, memoised by node."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # entered, not finished: the current node's ancestors
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:  # one visit per distinct node: sizes are exact (big) integers
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise ValueError(
                f"{where}: YAML with a recursive alias (a node that contains itself); not supported"
            )
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    expanded = sizes.get(id(root), 0)
    if expanded > len(sizes) + max_alias_nodes:
        count = f"{expanded:,}" if expanded < 10**12 else f"{float(expanded):.2e}"
        raise ValueError(
            f"{where}: YAML aliases expand the document from {len(sizes):,} nodes to {count} "
            f"(an 'alias bomb'?); refused: aliases may add at most {max_alias_nodes:,} nodes"
        )


def load_yaml(
    source: str | bytes | IO[Any], where: str, *, max_alias_nodes: int = MAX_YAML_ALIAS_NODES
) -> Any:
    """One YAML document with PyYAML's safe loader, bounded: aliases may not expand the
    document by more than ``max_alias_nodes`` nodes, a recursive alias is refused, and
    nesting too deep to parse is an error.

    Raises:
        ValueError: invalid YAML, an alias expansion past the bound, a recursive alias or
            too deep nesting (the message starts with ``where``, e.g. the file's path).
        ImportError: PyYAML is not installed.
    """
    import yaml

    class _BoundedLoader(yaml.SafeLoader):
        def construct_document(self, node: Any) -> Any:
            _check_expansion(node, where, max_alias_nodes)
            return super().construct_document(node)

    loader = _BoundedLoader(source)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: invalid YAML: {exc}") from None
    except RecursionError:
        raise ValueError(f"{where}: YAML nested too deeply to read") from None
    finally:
        loader.dispose()
