"""Writing output files so that a failure leaves nothing half-written.

Every file dflop writes after work it cannot redo cheaply (checkpoints, metrics, traces,
timelines) goes through :func:`write_file`: into a temporary file beside the target,
named for the writing process (two writers never share one), then renamed over the
target. A failure (a full disk, a quota, an I/O error) removes the temporary file and
raises :class:`~dflop.errors.WriteError`, which names the path and the reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any, Callable

from dflop.errors import WriteError

__all__ = ["write_file", "write_text"]


def write_file(
    path: str | os.PathLike[str],
    write: Callable[[IO[bytes]], Any],
    *,
    durable: bool = False,
) -> None:
    """``write(f)`` into a binary file object, then the result replaces ``path`` at once.
    ``durable``: flushed to the disk (``fsync``) before the rename, as a checkpoint must
    be to survive a power loss.

    Raises:
        WriteError: the file could not be written (no partial file is left).
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    recorder = None
    try:
        with open(tmp, "wb") as f:
            recorder = _Recording(f)
            write(recorder)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        # A writer that catches the file's error (torch.save reports a failed write as
        # "unexpected pos") still has it recorded: the cause is named, not the symptom.
        cause = recorder.error if recorder is not None and recorder.error else error
        if isinstance(cause, WriteError) or not isinstance(cause, OSError):
            raise
        raise WriteError.from_os_error(path, cause) from None


class _Recording:
    """A binary file that remembers the first error its writes raised."""

    def __init__(self, file: IO[bytes]):
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def __getattr__(self, name: str) -> Any:  # flush, tell, fileno, ...
        return getattr(self._file, name)


def write_text(path: str | os.PathLike[str], text: str, *, durable: bool = False) -> None:
    """:func:`write_file` of ``text`` as UTF-8."""
    write_file(path, lambda f: f.write(text.encode("utf-8")), durable=durable)
