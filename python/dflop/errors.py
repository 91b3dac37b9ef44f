"""dflop's exception types for bad input.

Bad values raise ``ValueError`` (the native core's ``InvalidArgument`` too; an
unsatisfiable constraint raises :class:`dflop.InfeasibleError`, a ``ValueError``). A value
of the wrong type raises :class:`InputTypeError`, a ``TypeError``: callers catch it as
``TypeError``, and the CLI can tell a validation message (one line, exit code 2) from a
``TypeError`` raised by a bug, whose traceback it must not hide.
"""

from __future__ import annotations

__all__ = ["InputTypeError"]


class InputTypeError(TypeError):
    """An argument, field or file value has the wrong type; the message names it."""
