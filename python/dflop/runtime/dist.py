"""The collective and point-to-point calls of dflop's runtime, for either kind of world:

- processes (``torch.distributed``: gloo on CPU, NCCL on GPUs), one rank per process;
- a :class:`~dflop.runtime.thread_world.ThreadWorld`, one rank per thread of one
  process (ranks sharing one GPU, which NCCL refuses).

Each function has ``torch.distributed``'s signature (the subset the runtime uses) and
acts on the calling thread's world: its thread world if it joined one, else
``torch.distributed``'s. The runtime imports this module as ``dist``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as _dist

from dflop.runtime.thread_world import ThreadGroup, current

__all__ = [
    "P2POp",
    "ReduceOp",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather_object",
    "get_backend",
    "get_rank",
    "get_world_size",
    "irecv",
    "is_initialized",
    "isend",
    "new_group",
]

ReduceOp = _dist.ReduceOp
THREADS = "threads"
"""``get_backend()`` of a thread world."""


def is_initialized() -> bool:
    return current() is not None or (_dist.is_available() and _dist.is_initialized())


def get_rank(group: Any = None) -> int:
    member = current()
    if member is None:
        return _dist.get_rank(group)
    world, rank = member
    ranks = _group(world, group).ranks
    return ranks.index(rank) if rank in ranks else -1  # -1: not a member, as torch says


def get_world_size(group: Any = None) -> int:
    member = current()
    if member is None:
        return _dist.get_world_size(group)
    return len(_group(member[0], group).ranks)


def get_backend(group: Any = None) -> str:
    return THREADS if current() is not None else _dist.get_backend(group)


def new_group(ranks: Sequence[int], timeout: Any = None) -> Any:
    member = current()
    if member is None:
        return _dist.new_group(ranks=list(ranks), timeout=timeout)
    return member[0].new_group(member[1], ranks)


def destroy_process_group() -> None:
    if current() is None:
        _dist.destroy_process_group()


# ---- point to point -------------------------------------------------------------------


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    member = current()
    if member is None:
        return _dist.isend(tensor, dst, group=group, tag=tag)
    world, rank = member
    return world.isend(rank, tensor, dst, tag, _group(world, group))


def irecv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> Any:
    member = current()
    if member is None:
        return _dist.irecv(tensor, src, group=group, tag=tag)
    world, rank = member
    return world.irecv(rank, tensor, src, tag, _group(world, group))


@dataclass(frozen=True)
class P2POp:
    """One send (``op=isend``) or receive (``op=irecv``) of :func:`batch_isend_irecv`;
    ``peer`` is a global rank."""

    op: Any
    tensor: torch.Tensor
    peer: int
    group: Any = None
    tag: int = 0


def batch_isend_irecv(ops: Sequence[P2POp]) -> list[Any]:
    if current() is None:
        native = {isend: _dist.isend, irecv: _dist.irecv}
        return _dist.batch_isend_irecv(
            [_dist.P2POp(native[o.op], o.tensor, o.peer, o.group, o.tag) for o in ops]
        )
    return [o.op(o.tensor, o.peer, o.group, o.tag) for o in ops]


# ---- collectives ----------------------------------------------------------------------


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    member = current()
    if member is None:
        return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    names = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max"}
    if op not in names:
        raise ValueError(f"a thread world reduces with SUM or MAX, got {op}")
    world, rank = member
    work = world.all_reduce(rank, tensor, names[op], _group(world, group))
    return _finish(work, async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    member = current()
    if member is None:
        return _dist.broadcast(tensor, src, group=group, async_op=async_op)
    world, rank = member
    return _finish(world.broadcast(rank, tensor, src, _group(world, group)), async_op)


def barrier(group: Any = None) -> None:
    member = current()
    if member is None:
        _dist.barrier(group)
        return
    world, rank = member
    world.collective(rank, _group(world, group), "barrier", None, lambda payloads: None)


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0) -> None:
    member = current()
    if member is None:
        _dist.gather_object(obj, object_gather_list, dst=dst)
        return
    world, rank = member
    gathered = world.exchange_objects(rank, world.world_group, f"gather_object(dst={dst})", obj)
    if rank == dst:
        object_gather_list[:] = gathered


def all_gather_object(object_list: list[Any], obj: Any) -> None:
    member = current()
    if member is None:
        _dist.all_gather_object(object_list, obj)
        return
    world, rank = member
    object_list[:] = world.exchange_objects(rank, world.world_group, "all_gather_object", obj)


def broadcast_object_list(object_list: list[Any], src: int = 0) -> None:
    member = current()
    if member is None:
        _dist.broadcast_object_list(object_list, src=src)
        return
    world, rank = member
    mine = object_list if rank == src else None
    gathered = world.exchange_objects(rank, world.world_group, f"broadcast_object(src={src})", mine)
    object_list[:] = gathered[src]


def _group(world: Any, group: Any) -> ThreadGroup:
    if group is None:
        return world.world_group
    if not isinstance(group, ThreadGroup):
        raise TypeError(f"a thread world's rank got a {type(group).__name__} as its group")
    return group


def _finish(work: Any, async_op: bool) -> Any:
    if async_op:
        return work
    work.wait()
    return None
