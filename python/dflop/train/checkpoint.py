"""Checkpoints: every rank saves its own stage and optimizer; a marker makes them visible.

Layout of ``checkpoint_dir``::

    step-000012/rank-00000.pt    {"step", "stage", "optimizer", "layout", "model", "world_size"}
    step-000012/rank-00001.pt
    latest                       "step-000012" (written by rank 0 after every rank saved)

Files are written to a temporary name and renamed, and ``latest`` moves only after a
barrier, so a run killed mid-save leaves the previous checkpoint intact. ``step`` is the
last completed step; a resumed run starts at ``step + 1``. Batches are drawn per step from
the seed, so no data-loader state is needed. Older step folders beyond ``keep`` are
removed by rank 0.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]

_LATEST = "latest"


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank:05d}.pt"


def latest_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> Path | None:
    """The folder of the latest complete checkpoint, or None."""
    marker = Path(checkpoint_dir) / _LATEST
    if not marker.exists():
        return None
    folder = Path(checkpoint_dir) / marker.read_text().strip()
    return folder if folder.is_dir() else None


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    step: int,
    rank: int,
    state: dict[str, Any],
    *,
    barrier: Any,
    keep: int = 2,
) -> Path:
    """Save this rank's ``state`` for ``step``; ``barrier()`` is called before the marker
    moves (every rank must call this function)."""
    import torch

    root = Path(checkpoint_dir)
    folder = root / f"step-{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    target = _rank_file(folder, rank)
    tmp = target.with_suffix(".pt.tmp")
    torch.save({**state, "step": step}, tmp)
    os.replace(tmp, target)
    barrier()
    if rank == 0:
        marker_tmp = root / (_LATEST + ".tmp")
        marker_tmp.write_text(folder.name)
        os.replace(marker_tmp, root / _LATEST)
        steps = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in steps[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def load_checkpoint(
    folder: str | os.PathLike[str], rank: int, expect: dict[str, Any]
) -> dict[str, Any]:
    """This rank's saved state; ``expect`` (e.g. layout, model, world size) must match the
    saved values, else ``ValueError`` names the first differing key."""
    import torch

    path = _rank_file(Path(folder), rank)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {folder} has no file for rank {rank} ({path.name})")
    state = torch.load(path, map_location="cpu", weights_only=False)
    for key, value in expect.items():
        if state.get(key) != value:
            raise ValueError(
                f"checkpoint {folder} was saved with {key}={state.get(key)!r}, this run has "
                f"{key}={value!r}: resume with the same settings or use another --checkpoint-dir"
            )
    return state
