"""A world of ranks that are threads of one process: what dflop's runtime runs on when
its ranks share one GPU (NCCL refuses two ranks of a communicator on one device), and on
CPU when one process is wanted.

:mod:`dflop.runtime.dist` sends every collective and point-to-point call of the runtime
here when the calling thread belongs to a :class:`ThreadWorld` (see
:func:`dflop.runtime.launch.spawn_threads`), and to ``torch.distributed`` otherwise, so
the pipeline engine, the bridge communicator and the trainer run unchanged.

Semantics follow gloo's, so that code correct here is correct there:

- Point-to-point: a send matches the oldest receive posted for the same (source,
  destination, tag), in order; a send completes once its receive is posted (a
  rendezvous, like gloo's), not when it is issued. The data is copied by whichever side
  arrives second. Sizes must agree (a mismatch fails both sides, naming them).
- Collectives: every member of a group must make the same calls in the same order; the
  last to arrive computes the result (sums in group order, so they are deterministic).
  Objects passed between ranks are pickled and unpickled, as between processes, so no
  two ranks share one.
- On CUDA, transfers and reductions run on the world's own communication stream,
  ordered with CUDA events after the producer's stream; ``wait()`` makes the caller's
  current stream wait for them and returns without blocking the host on the GPU (only
  on the match). Each rank's thread computes on its own stream (``spawn_threads``), so
  one rank's compute, another's, and the copies between them can overlap.
- Every wait is bounded by the world's timeout; a timeout or a failed rank
  (:meth:`ThreadWorld.abort`) makes every waiting rank raise instead of hanging
  (:class:`WorldStopped`: a consequence, so the launcher names the cause).

Differences from torch.distributed: collectives return once every member has arrived
(``async_op=True`` gives a completed handle; on CUDA the result is still
stream-ordered), and CUDA streams come from torch's pool (32 per device), so with many
ranks two of them may share one and overlap less.
"""

from __future__ import annotations

import collections
import datetime
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ThreadGroup", "ThreadWorld", "WorldStopped", "current"]

_local = threading.local()


def current() -> tuple[ThreadWorld, int] | None:
    """(world, rank) of the calling thread, or None outside a thread world."""
    return getattr(_local, "membership", None)


class WorldStopped(RuntimeError):
    """A wait ended because the world stopped (another rank failed or timed out): a
    consequence, not a cause."""


@dataclass(frozen=True)
class ThreadGroup:
    """A group of a thread world: its global ranks (ascending, as torch orders them) and
    its number (the world's group is 0; every rank numbers the groups it creates in
    creation order, which torch requires to be the same on every rank). Collectives and
    messages of different groups never match, as in torch."""

    ranks: tuple[int, ...]
    number: int = 0

    def __repr__(self) -> str:
        return f"ThreadGroup{list(self.ranks)}"


class _Work:
    """A handle on a transfer or collective; ``wait()`` as torch's ``Work.wait``."""

    def __init__(self, world: ThreadWorld, what: str) -> None:
        self._world = world
        self.what = what
        self.done = False
        self.error: BaseException | None = None
        self.event: Any = None  # CUDA: recorded on the comm stream after the data moved

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        world = self._world
        limit_s = world.timeout_s if timeout is None else _seconds(timeout)
        with world._cond:
            world._wait_for(lambda: self.done or self.error is not None, limit_s, self.what)
        if self.error is not None:
            raise self.error
        if self.event is not None:
            torch.cuda.current_stream(world.device).wait_event(self.event)
        return True


@dataclass
class _Message:
    tensor: torch.Tensor
    ready: Any  # CUDA event: the tensor's values are produced
    work: _Work


@dataclass
class _Slot:
    """One collective call of a group, gathering its members' arguments."""

    kind: str
    payloads: dict[int, Any] = field(default_factory=dict)
    result: Any = None
    done: bool = False
    taken: int = 0


class ThreadWorld:
    """``world_size`` ranks, each a thread of this process (see the module docstring).

    Args:
        world_size: number of ranks.
        device: where collective tensors live (``"cpu"`` or a CUDA device).
        timeout_s: bound of every wait (a rank waiting longer fails, and so does the world).
    """

    def __init__(
        self, world_size: int, device: torch.device | str = "cpu", timeout_s: float = 300.0
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        self.world_size = world_size
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.world_group = ThreadGroup(tuple(range(world_size)))
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        # Unmatched sends / receives by (group number, source, destination, tag).
        self._sends: dict[tuple[int, int, int, int], collections.deque[_Message]] = {}
        self._recvs: dict[tuple[int, int, int, int], collections.deque[_Message]] = {}
        self._slots: dict[tuple[ThreadGroup, int], _Slot] = {}
        self._calls: collections.Counter[tuple[int, ThreadGroup]] = collections.Counter()
        self._groups_made: collections.Counter[int] = collections.Counter()
        self.comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- membership -----------------------------------------------------------------

    def join(self, rank: int) -> None:
        """Make the calling thread rank ``rank`` of this world."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        _local.membership = (self, rank)

    @staticmethod
    def leave() -> None:
        _local.membership = None

    def new_group(self, rank: int, ranks: Sequence[int]) -> ThreadGroup:
        """Rank ``rank``'s handle on its next group (every rank creates every group, in
        the same order, as torch requires)."""
        members = tuple(sorted({int(r) for r in ranks}))
        if not members or members[0] < 0 or members[-1] >= self.world_size:
            raise ValueError(f"group ranks {list(ranks)} must be in [0, {self.world_size})")
        with self._cond:
            self._groups_made[rank] += 1
            return ThreadGroup(members, self._groups_made[rank])

    def abort(self, error: BaseException) -> None:
        """Fail every present and future wait of the world with ``error`` (a rank failed)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def _wait_for(self, ready: Callable[[], bool], limit_s: float, what: str) -> None:
        """Wait (holding ``_cond``) until ``ready()``; raise on abort or timeout."""
        deadline = time.monotonic() + limit_s
        while not ready():
            if self._error is not None:
                raise WorldStopped(f"{what}: the thread world stopped: {self._error}")
            left = deadline - time.monotonic()
            if left <= 0:
                error = RuntimeError(f"{what} timed out after {limit_s:g} s")
                self._error = error
                self._cond.notify_all()
                raise error
            self._cond.wait(left)

    # ---- point to point -------------------------------------------------------------

    def isend(
        self, rank: int, tensor: torch.Tensor, dst: int, tag: int, group: ThreadGroup
    ) -> _Work:
        return self._post(rank, tensor, dst, tag, group, sender=True)

    def irecv(
        self, rank: int, tensor: torch.Tensor, src: int, tag: int, group: ThreadGroup
    ) -> _Work:
        return self._post(rank, tensor, src, tag, group, sender=False)

    def _post(
        self,
        rank: int,
        tensor: torch.Tensor,
        peer: int,
        tag: int,
        group: ThreadGroup,
        sender: bool,
    ) -> _Work:
        """Post a send (to ``peer``) or a receive (from ``peer``); match it if its other
        half is waiting."""
        self._check_peer(rank, peer, "dst" if sender else "src", group)
        if not tensor.is_contiguous():  # as torch.distributed: the copy is a flat one
            raise ValueError(
                f"rank {rank}: {'isend' if sender else 'irecv'} needs a contiguous tensor, got "
                f"shape {tuple(tensor.shape)} with strides {tensor.stride()}"
            )
        verb = "sending to" if sender else "receiving from"
        work = _Work(self, f"rank {rank} {verb} rank {peer} (tag {tag})")
        message = _Message(tensor, self._ready_event(tensor), work)
        src, dst = (rank, peer) if sender else (peer, rank)
        mine, others = (self._sends, self._recvs) if sender else (self._recvs, self._sends)
        self._match(message, (group.number, src, dst, tag), others, mine, sender=sender)
        return work

    def _match(
        self,
        message: _Message,
        key: tuple[int, int, int, int],
        others: dict[tuple[int, int, int, int], collections.deque[_Message]],
        mine: dict[tuple[int, int, int, int], collections.deque[_Message]],
        sender: bool,
    ) -> None:
        with self._cond:
            if self._error is not None:
                raise WorldStopped(f"{message.work.what}: the thread world stopped: {self._error}")
            waiting = others.get(key)
            if not waiting:
                mine.setdefault(key, collections.deque()).append(message)
                return
            peer = waiting.popleft()
            if not waiting:
                del others[key]
            send, recv = (message, peer) if sender else (peer, message)
            self._deliver(send, recv, key)
            self._cond.notify_all()

    def _deliver(self, send: _Message, recv: _Message, key: tuple[int, int, int, int]) -> None:
        _, src, dst, tag = key
        if send.tensor.numel() != recv.tensor.numel() or send.tensor.dtype != recv.tensor.dtype:
            error = RuntimeError(
                f"rank {src} sent {tuple(send.tensor.shape)} {send.tensor.dtype} to rank {dst} "
                f"(tag {tag}), which posted a receive of {tuple(recv.tensor.shape)} "
                f"{recv.tensor.dtype}"
            )
            send.work.error = recv.work.error = error
            return
        source = send.tensor.view(recv.tensor.shape)  # both contiguous: no copy here
        event = self._on_comm_stream(
            lambda: recv.tensor.copy_(source, non_blocking=True),
            [send.ready, recv.ready],
            [send.tensor, recv.tensor],
        )
        for work in (send.work, recv.work):
            work.event = event
            work.done = True

    # ---- collectives ----------------------------------------------------------------

    def collective(
        self,
        rank: int,
        group: ThreadGroup,
        kind: str,
        payload: Any,
        compute: Callable[[dict[int, Any]], Any],
    ) -> Any:
        """Rank ``rank``'s part in ``group``'s next collective: every member passes its
        ``payload``; the last to arrive runs ``compute(payloads by rank)``, whose result
        every member gets."""
        if rank not in group.ranks:
            raise ValueError(f"rank {rank} is not in {group}")
        what = f"rank {rank}: {kind} on {group}"
        with self._cond:
            if self._error is not None:
                raise WorldStopped(f"{what}: the thread world stopped: {self._error}")
            number = self._calls[(rank, group)]
            self._calls[(rank, group)] += 1
            key = (group, number)
            slot = self._slots.setdefault(key, _Slot(kind))
            if slot.kind != kind:
                error = RuntimeError(
                    f"{what}: call {number} of this group is a {slot.kind} on another rank "
                    "(the ranks' collectives differ)"
                )
                self._error = error
                self._cond.notify_all()
                raise error
            slot.payloads[rank] = payload
            if len(slot.payloads) == len(group.ranks):
                slot.result = compute(slot.payloads)
                slot.done = True
                self._cond.notify_all()
            else:
                self._wait_for(lambda: slot.done, self.timeout_s, what)
            slot.taken += 1
            if slot.taken == len(group.ranks):
                del self._slots[key]
            return slot.result

    def all_reduce(self, rank: int, tensor: torch.Tensor, op: str, group: ThreadGroup) -> _Work:
        def compute(payloads: dict[int, Any]) -> Any:
            tensors = [payloads[r][0] for r in group.ranks]

            def reduce() -> None:
                total = tensors[0].clone()
                for other in tensors[1:]:
                    if op == "sum":
                        total.add_(other)
                    else:
                        torch.maximum(total, other, out=total)
                for t in tensors:
                    t.copy_(total)

            return self._on_comm_stream(reduce, [payloads[r][1] for r in group.ranks], tensors)

        return self._done_work(
            f"all_reduce({op})",
            self.collective(
                rank, group, f"all_reduce({op})", (tensor, self._ready_event(tensor)), compute
            ),
        )

    def broadcast(self, rank: int, tensor: torch.Tensor, src: int, group: ThreadGroup) -> _Work:
        def compute(payloads: dict[int, Any]) -> Any:
            source = payloads[src][0]
            targets = [payloads[r][0] for r in group.ranks if r != src]

            def copy() -> None:
                for t in targets:
                    t.copy_(source)

            events = [payloads[r][1] for r in group.ranks]
            return self._on_comm_stream(copy, events, [source, *targets])

        if src not in group.ranks:
            raise ValueError(f"broadcast source rank {src} is not in {group}")
        payload = (tensor, self._ready_event(tensor))
        return self._done_work(
            "broadcast", self.collective(rank, group, f"broadcast(src={src})", payload, compute)
        )

    def exchange_objects(self, rank: int, group: ThreadGroup, kind: str, obj: Any) -> list[Any]:
        """Every member's ``obj`` (pickled copies), in group order."""
        blob = pickle.dumps(obj)
        blobs = self.collective(
            rank, group, kind, blob, lambda payloads: [payloads[r] for r in group.ranks]
        )
        return [pickle.loads(b) for b in blobs]

    # ---- helpers --------------------------------------------------------------------

    def _done_work(self, what: str, event: Any) -> _Work:
        work = _Work(self, what)
        work.event = event
        work.done = True
        return work

    def _ready_event(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event

    def _on_comm_stream(
        self, run: Callable[[], None], after: Sequence[Any], tensors: Sequence[torch.Tensor]
    ) -> Any:
        """Run ``run`` (copies / reductions) after the ``after`` events: at once on CPU;
        on CUDA, enqueued on the communication stream. Returns the CUDA event that marks
        its end (None on CPU)."""
        stream = self.comm_stream
        if stream is None or not any(t.device.type == "cuda" for t in tensors):
            run()
            return None
        with torch.cuda.stream(stream):
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            run()
            done = torch.cuda.Event()
            done.record(stream)
        for t in tensors:  # the allocator must not reuse them before the stream is done
            if t.device.type == "cuda":
                t.record_stream(stream)
        return done

    def _check_peer(self, rank: int, peer: int, name: str, group: ThreadGroup) -> None:
        if peer == rank or peer not in group.ranks or rank not in group.ranks:
            raise ValueError(
                f"rank {rank}: {name}={peer} must be another rank of {group} (global ranks)"
            )


def _seconds(timeout: datetime.timedelta | float) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)
