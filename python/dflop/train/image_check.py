"""Check a step's image files before the step uses them, and replace bad records.

The profiler reads only image headers, so a file whose header is fine but whose data is
cut short or corrupt passes profiling and would fail on the encoder rank that decodes it,
in the middle of a step, with the other ranks waiting on it. Before a step trains, every
record of its batch not yet known good is decoded once (the records split round-robin
over the ranks: each rank decodes 1/world of them), the verdicts are combined with one
all-reduce, and a record that did not decode is replaced in the batch by a seeded redraw
(:meth:`~dflop.train.data.StepShapes.record_indices`: every rank and a resumed run get
the same batch). A record is checked once per run.
"""

from __future__ import annotations

from typing import Any

from dflop.data.image_header import image_decode_error
from dflop.train.data import StepShapes

__all__ = ["check_step_records"]


def _problem(batch: Any, position: int) -> str | None:
    try:
        files = batch.visual_files(position)
    except ValueError as exc:  # e.g. a frames folder emptied since profiling
        return str(exc)
    for path in files:
        problem = image_decode_error(path)
        if problem is not None:
            return problem
    return None


def check_step_records(
    source: StepShapes, step: int, batch: Any, rank: int, world_size: int, device: Any
) -> dict[int, str]:
    """Check the records of ``step``'s batch (``batch`` is ``source``'s batch of it) that
    are not yet known good, on every rank together (a collective). Marks them in
    ``source.good_records`` / ``source.bad_records`` and returns the newly found bad ones
    (record index -> ``where: why``); the caller redraws the batch when any are."""
    import torch

    from dflop.runtime import dist

    unchecked = source.unchecked_records(step)
    if not unchecked:
        return {}
    first_position: dict[int, int] = {}
    for position, record in enumerate(source.record_indices(step)):
        first_position.setdefault(int(record), position)
    flags = torch.zeros(len(unchecked), dtype=torch.int32)
    problems: dict[int, str] = {}
    for j in range(rank, len(unchecked), world_size):
        record = unchecked[j]
        problem = _problem(batch, first_position[record])
        if problem is not None:
            flags[j] = 1
            problems[record] = f"{source.records.records[record].where}: {problem}"
    flags = flags.to(device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad = {unchecked[j] for j in flags.cpu().nonzero().flatten().tolist()}
    source.good_records.update(r for r in unchecked if r not in bad)
    if not bad:
        return {}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, problems)
    found = {r: why for part in gathered for r, why in part.items()}
    source.bad_records.update(found)
    return found
