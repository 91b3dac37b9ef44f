"""The ``dflop`` command as a real subprocess, with a timeout (a hang fails the test)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

TIMEOUT_S = 150


def run_cli(
    *args: str, env: dict | None = None, timeout_s: float = TIMEOUT_S, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """``dflop ARGS...`` (the installed script, else ``python -m dflop.cli``), output
    captured; ``env`` on top of this process's environment; in ``cwd`` if given."""
    executable = shutil.which("dflop")
    command = [executable] if executable else [sys.executable, "-m", "dflop.cli"]
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
