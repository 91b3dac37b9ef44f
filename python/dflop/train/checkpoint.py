"""Checkpoints: every rank saves its own stage and optimizer; a marker makes them visible.

Layout of ``checkpoint_dir``::

    step-000012/rank-00000.pt         {"step", "stage", "optimizer", "layout", "model", ...}
    step-000012/rank-00000.pt.sha256  the file's SHA-256
    step-000012/rank-00001.pt ...
    latest                            "step-000012" (written by rank 0 after every rank saved)

Files are written to a temporary name and renamed, each with its checksum; ``latest``
moves only after a barrier and after rank 0 has verified every rank's file of the new
step, so a run killed mid-save, or a save that reached the disk damaged, leaves the
previous checkpoint in place. Rotation keeps the newest ``keep`` verified steps and never
removes the one ``latest`` names. ``step`` is the last completed step; a resumed run starts
at ``step + 1``. Batches are drawn per step from the seed, so no data-loader state is
needed.

Loading reads tensors and plain data only (``torch.load(weights_only=True)``, with the
tensor-parallel ``DTensor`` types allowed): a checkpoint folder from elsewhere cannot run
code. :func:`find_checkpoint` picks the step to resume from: the one ``latest`` names if it
verifies, else the newest step that does, and says what it found.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable

__all__ = [
    "CheckpointError",
    "find_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

_LATEST = "latest"


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
        log(f"checkpoint: no intact checkpoint in {root}; starting from step 0")
    return None


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    step: int,
    rank: int,
    state: dict[str, Any],
    *,
    barrier: Any,
    world_size: int,
    keep: int = 2,
) -> Path:
    """Save this rank's ``state`` for ``step`` with its checksum; ``barrier()`` is called
    before rank 0 verifies the step and moves the marker (every rank must call this
    function).

    Raises:
        CheckpointError: on rank 0, the new step does not verify (the marker and the older
            steps are left as they were).
    """
    import torch

    root = Path(checkpoint_dir)
    folder = root / f"step-{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    target = _rank_file(folder, rank)
    tmp = target.with_suffix(".pt.tmp")
    torch.save({**state, "step": step}, tmp)
    checksum = _sha256(tmp)
    os.replace(tmp, target)
    check_tmp = target.with_name(target.name + ".sha256.tmp")
    check_tmp.write_text(checksum)
    os.replace(check_tmp, target.with_name(target.name + ".sha256"))
    barrier()
    if rank == 0:
        problem = verify_checkpoint(folder, world_size)
        if problem is not None:
            raise CheckpointError(f"the checkpoint of step {step} did not verify: {problem}")
        marker_tmp = root / (_LATEST + ".tmp")
        marker_tmp.write_text(folder.name)
        os.replace(marker_tmp, root / _LATEST)
        steps = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in steps[:-keep] if keep > 0 else []:
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
    return folder


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
        if state.get(key) != value:
            raise CheckpointError(
                f"checkpoint {folder} was saved with {key}={state.get(key)!r}, this run has "
                f"{key}={value!r}: resume with the same settings or use another --checkpoint-dir"
            )
    return state
