"""Checkpoints: every rank saves its own stage and optimizer; a marker makes them visible.

Layout of ``checkpoint_dir``::

    step-000012/rank-00000.pt         {"step", "stage", "optimizer", "layout", "model", ...}
    step-000012/rank-00000.pt.sha256  the file's SHA-256
    step-000012/rank-00001.pt ...
    step-000012/settings.json         the run's settings and layout (rank 0; a resumed run
                                      compares its own with them)
    latest                            "step-000012" (written by rank 0 after every rank saved)
    dflop.lock                        the process and host of the run using the folder

One run at a time: :class:`CheckpointLock` holds an exclusive lock on the folder for the
whole run (a second run is refused, naming the first's process and host; a lock left by a
process that died is reported and taken over). Files are written to a temporary name
that carries the writer's process id and renamed, each with its checksum; ``latest``
moves only after a barrier and after rank 0 has verified every rank's file of the new
step, so a run killed mid-save, or a save that reached the disk damaged, leaves the
previous checkpoint in place. Rotation keeps the newest ``keep`` verified steps and never
removes the one ``latest`` names. ``step-000012`` holds the state after 12 steps (the
progress line's "step 12/N"); its files' ``step`` is that step's index (11), and a resumed
run starts at the next one. Batches are drawn per step from the seed, so no data-loader state is
needed.

Loading reads tensors and plain data only (``torch.load(weights_only=True)``, with the
tensor-parallel ``DTensor`` types allowed): a checkpoint folder from elsewhere cannot run
code. :func:`find_checkpoint` picks the step to resume from: the one ``latest`` names if it
verifies, else the newest step that does, and says what it found.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

from dflop.errors import InUseError
from dflop.output import write_file, write_text

__all__ = [
    "CheckpointError",
    "CheckpointLock",
    "checkpoint_name",
    "checkpoint_settings",
    "find_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

_LATEST = "latest"
_LOCK = "dflop.lock"
_SETTINGS = "settings.json"
# The temporary files a killed run can leave: write_file's "NAME.tmp-PID" of the files this
# module writes, where it writes them (and nothing else: a user's "notes.tmp" is theirs).
_OWN_TEMPORARIES = (
    re.compile(rf"{_LATEST}\.tmp-\d+"),
    re.compile(r"step-\d{6}/(rank-\d{5}\.pt(\.sha256)?|" + re.escape(_SETTINGS) + r")\.tmp-\d+"),
)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (damaged, incomplete, or from other settings)."""


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank:05d}.pt"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(folder: str | os.PathLike[str], world_size: int) -> str | None:
    """Why ``folder`` is not a complete, intact checkpoint of ``world_size`` ranks (a
    missing file or checksum, a checksum that differs), or None if it is."""
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder} does not exist"
    for rank in range(world_size):
        path = _rank_file(folder, rank)
        checksum = path.with_name(path.name + ".sha256")
        if not path.is_file():
            return f"{path} is missing"
        if not checksum.is_file():
            return f"{checksum} is missing"
        if checksum.read_text().strip() != _sha256(path):
            return f"{path} does not match its checksum (the file is damaged)"
    return None


def find_checkpoint(
    checkpoint_dir: str | os.PathLike[str], world_size: int, log: Callable[[str], None] = print
) -> Path | None:
    """The checkpoint to resume from: the step ``latest`` names when it verifies, else
    the newest step that does (saying why); None when there is none (saying so when the
    folder holds checkpoints that all fail)."""
    root = Path(checkpoint_dir)
    steps = sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True)
    marker = root / _LATEST
    named = marker.read_text().strip() if marker.is_file() else None
    if named is not None:
        problem = verify_checkpoint(root / named, world_size)
        if problem is None:
            return root / named
        log(f"checkpoint: 'latest' names {named}, which cannot be used: {problem}")
    for folder in steps:
        if folder.name == named:
            continue
        problem = verify_checkpoint(folder, world_size)
        if problem is None:
            if named is not None:
                log(f"checkpoint: resuming from {folder.name}, the newest intact step")
            return folder
        log(f"checkpoint: skipping {folder.name}: {problem}")
    if named is not None or steps:
        log(f"checkpoint: no intact checkpoint in {root}; starting from step 1")
    else:
        log(f"checkpoint: none in {root} yet; starting from step 1")
    return None


def checkpoint_name(step: int) -> str:
    """The folder of the checkpoint saved after step index ``step``: named for the steps
    done, as the progress line counts them."""
    return f"step-{step + 1:06d}"


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    step: int,
    rank: int,
    state: dict[str, Any],
    *,
    barrier: Any,
    world_size: int,
    keep: int = 2,
    settings: dict[str, Any] | None = None,
) -> Path:
    """Save this rank's ``state`` after ``step`` (an index: the folder is named for the
    steps done, ``step + 1``) with its checksum; ``barrier()`` is called
    before rank 0 verifies the step and moves the marker (every rank must call this
    function). ``settings`` (rank 0): the run's settings, saved beside the step as
    ``settings.json`` (what :func:`checkpoint_settings` reads).

    Raises:
        CheckpointError: on rank 0, the new step does not verify (the marker and the older
            steps are left as they were).
        dflop.errors.WriteError: a file could not be written (a full disk is named as such, with the
            path and the space left); its temporary file is removed.
    """
    import torch

    root = Path(checkpoint_dir)
    folder = root / checkpoint_name(step)
    folder.mkdir(parents=True, exist_ok=True)
    target = _rank_file(folder, rank)
    write_file(target, lambda f: torch.save({**state, "step": step}, f), durable=True)
    write_text(target.with_name(target.name + ".sha256"), _sha256(target), durable=True)
    if rank == 0 and settings is not None:
        text = json.dumps(settings, indent=1, default=str)
        write_text(folder / _SETTINGS, text, durable=True)
    barrier()
    if rank == 0:
        problem = verify_checkpoint(folder, world_size)
        if problem is not None:
            raise CheckpointError(f"the checkpoint after step {step + 1} did not verify: {problem}")
        write_text(root / _LATEST, folder.name, durable=True)
        steps = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in steps[:-keep] if keep > 0 else []:
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
    return folder


def checkpoint_settings(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The settings a run saved beside checkpoint ``folder`` (None if it saved none)."""
    path = Path(folder) / _SETTINGS
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError):
        return None


class CheckpointLock:
    """An exclusive lock on a checkpoint folder, held by one run from before it reads the
    folder until it exits (a ``with`` block; the kernel drops it if the process dies).

    The lock is ``dflop.lock`` in the folder, locked with ``flock`` and holding the
    process id, host and command of its holder. A second run is refused with
    :class:`~dflop.errors.InUseError` naming them. A lock file whose process is gone (a
    killed run) is reported and taken over. A lock file written on another host is
    refused even when unlocked: whether that run still runs cannot be told from here
    (delete the file once it has ended). ``flock`` works on local disks and on NFSv4; on
    file systems without it the host check still applies.
    """

    def __init__(self, folder: str | os.PathLike[str], log: Callable[[str], None] = print):
        self.folder = Path(folder)
        self.path = self.folder / _LOCK
        self._log = log
        self._fd: int | None = None

    def __enter__(self) -> CheckpointLock:
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                holder = _read_holder(fd)
                os.close(fd)
                raise InUseError(
                    f"checkpoint folder {str(self.folder)!r} is in use by another run: "
                    f"{_describe_holder(holder)}; wait for it to end or use another "
                    "--checkpoint-dir"
                ) from None
            # The file may have been removed (its holder released it) between our open
            # and our lock: then we hold a lock on a deleted file; start again.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        holder = _read_holder(fd)
        if holder:
            host = holder.get("host")
            if host != socket.gethostname():
                os.close(fd)
                raise InUseError(
                    f"checkpoint folder {str(self.folder)!r} has a lock left by "
                    f"{_describe_holder(holder)}; whether that run still runs cannot be "
                    f"told from here: once it has ended, delete {str(self.path)!r}"
                )
            self._log(
                f"checkpoint: {self.path} was left by {_describe_holder(holder)}, which is no "
                "longer running; taking the folder over"
            )
        self._fd = fd
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        if holder:  # a run that died holding the folder: it may have died mid-write
            self._remove_stale_temporaries()
        return self

    def _remove_stale_temporaries(self) -> None:
        """The temporary files of a run that died mid-write (this run holds the folder
        now): only names this module writes, where it writes them (``latest`` and a
        step's rank, checksum and settings files); nothing else in the folder is touched."""
        candidates = [*self.folder.glob(f"{_LATEST}.tmp-*"), *self.folder.glob("step-*/*.tmp-*")]
        stale = [
            p
            for p in candidates
            if p.is_file()
            and not p.is_symlink()
            and not p.parent.is_symlink()  # a step folder that leads elsewhere is not ours
            and any(
                pattern.fullmatch(p.relative_to(self.folder).as_posix())
                for pattern in _OWN_TEMPORARIES
            )
        ]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            self._log(
                f"checkpoint: removed {len(stale)} temporary file(s) a stopped run left in "
                f"{self.folder}"
            )

    def __exit__(self, *exc: Any) -> None:
        if self._fd is None:
            return
        # Unlink before unlocking: a run waiting on this file then retries on a new one.
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # releases the flock
            self._fd = None


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        holder = json.loads(text) if text.strip() else {}
    except ValueError:
        return {"unreadable": True}
    return holder if isinstance(holder, dict) else {"unreadable": True}


def _describe_holder(holder: dict[str, Any]) -> str:
    if not holder or "pid" not in holder:
        return "a run that did not say which (unreadable lock file)"
    command = f", {holder['command']!r}" if holder.get("command") else ""
    return (
        f"process {holder['pid']} on host {holder.get('host', '?')} (started "
        f"{holder.get('started', '?')}{command})"
    )


def _safe_types() -> list[Any]:
    """Types a checkpoint may hold besides tensors and plain data: tensor parallelism's
    ``DTensor`` and its mesh and placements."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    return [DTensor, DeviceMesh, Shard, Replicate, Partial, DTensorSpec, TensorMeta]


def layout_identity(layout: dict[str, Any]) -> dict[str, Any]:
    """The part of a layout (``RuntimeLayout.to_dict()``) a checkpoint is bound to: its
    ranks, stages and batch. Not the pipeline order (it only reorders a step's work) nor
    activation recompute (memory for time, the same math): a run may resume under
    another."""
    out = {k: v for k, v in layout.items() if k != "order"}
    for module in ("encoder", "llm"):
        if isinstance(out.get(module), dict):
            out[module] = {k: v for k, v in out[module].items() if k != "recompute"}
    return out


def load_checkpoint(
    folder: str | os.PathLike[str], rank: int, expect: dict[str, Any]
) -> dict[str, Any]:
    """This rank's saved state, read as tensors and plain data only (anything else in the
    file is refused). ``expect`` (e.g. layout, model, world size) must match the saved
    values, else ``CheckpointError`` names the first differing key."""
    import pickle

    import torch

    path = _rank_file(Path(folder), rank)
    if not path.exists():
        raise CheckpointError(f"checkpoint {folder} has no file for rank {rank} ({path.name})")
    try:
        with torch.serialization.safe_globals(_safe_types()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path} holds more than tensors and plain data; refusing to load it "
            f"(loading would run code from the file): {str(err).splitlines()[0]}"
        ) from None
    for key, value in expect.items():
        saved = state.get(key)
        if key == "layout" and isinstance(saved, dict) and isinstance(value, dict):
            saved, value = layout_identity(saved), layout_identity(value)
        if saved != value:
            raise CheckpointError(
                f"checkpoint {folder} was saved with {key}={state.get(key)!r}, this run has "
                f"{key}={value!r}: resume with the same settings or use another --checkpoint-dir"
            )
    return state
