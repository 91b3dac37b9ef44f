"""dflop's exception types for bad input.

Bad values raise ``ValueError`` (the native core's ``InvalidArgument`` too; an
unsatisfiable constraint raises :class:`dflop.InfeasibleError`, a ``ValueError``). A value
of the wrong type raises :class:`InputTypeError`, a ``TypeError``: callers catch it as
``TypeError``, and the CLI can tell a validation message (one line, exit code 2) from a
``TypeError`` raised by a bug, whose traceback it must not hide.
"""

from __future__ import annotations

__all__ = ["InUseError", "InputTypeError", "WriteError", "bounded_repr"]


class InputTypeError(TypeError):
    """An argument, field or file value has the wrong type; the message names it."""


class InUseError(RuntimeError):
    """A resource another run holds (a locked checkpoint folder); the message names the
    holder's process and host. The CLI reports it in one line with exit code 2."""


class WriteError(OSError):
    """An output or checkpoint file could not be written (the disk is full, a quota, an
    I/O error); the message names the path and the reason, and no partial file is left."""

    @classmethod
    def from_os_error(cls, path: object, error: OSError) -> WriteError:
        import errno
        import os
        import shutil

        reason = os.strerror(error.errno) if error.errno else str(error)
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                free = shutil.disk_usage(os.path.dirname(os.path.abspath(str(path)))).free
                reason = f"the disk is full ({free / 1e6:.1f} MB free)"
            except OSError:
                reason = "the disk is full"
        out = cls(f"could not write {str(path)!r}: {reason}")
        out.errno = error.errno
        return out


def bounded_repr(value: object, limit: int = 120) -> str:
    """``repr(value)`` in about ``limit`` characters, built without the full repr (a
    1 KB YAML file can expand into gigabytes of nested lists; a message quoting it must
    stay one short line): nested containers show their first items, then ``...``."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel = 3
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 6
    short.maxstring = short.maxother = limit
    text = short.repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
