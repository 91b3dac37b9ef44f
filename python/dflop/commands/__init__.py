"""Subcommands of the ``dflop`` CLI: each module defines ``register(subparsers)``, which
adds its parser(s) with ``set_defaults(handler=...)``; a handler returns the exit code."""
