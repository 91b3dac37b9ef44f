"""The ``dflop`` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from dflop.errors import InputTypeError, InUseError, WriteError

__all__ = ["build_parser", "main"]

# Subcommand modules under dflop.commands, in the order they appear in --help. A module
# may define start_early(argv): called with its arguments before the parser is built (which
# imports torch), to start work that overlaps with the rest of the start-up.
COMMAND_MODULES = ("demo", "train", "profile", "plan")


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error contract: one line on stderr, exit code 2 (argparse
    prints the whole usage first); subcommand parsers are of this class too. Flags are
    taken only as ``--help`` spells them: a prefix is an error, not a silent match."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dflop", description="Data-driven planning and scheduling for multimodal training."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"dflop.commands.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMAND_MODULES:  # before the parser imports torch
        start_early = getattr(
            importlib.import_module(f"dflop.commands.{argv[0]}"), "start_early", None
        )
        if start_early is not None:
            start_early(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        # Ctrl-C: one line, the shell's code for SIGINT (the ranks were killed on the way).
        print(f"dflop {args.command}: interrupted", file=sys.stderr)
        return 130
    except (
        ValueError,
        InUseError,  # e.g. a checkpoint folder another run holds
        InputTypeError,  # a validation message; any other TypeError is a bug: traceback
        FileNotFoundError,
        ImportError,
        PermissionError,
        IsADirectoryError,
        NotADirectoryError,
    ) as error:
        # Bad input: one clear line, no traceback.
        print(f"dflop {args.command}: error: {error}", file=sys.stderr)
        return 2
    except WriteError as error:
        # An output could not be written (a full disk): named, nothing half-written.
        print(f"dflop {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
