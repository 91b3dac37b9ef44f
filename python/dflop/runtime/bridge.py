"""The inter-model communicator: encoder features to the LLM, gradients back.

Each piece's features (a piece is a contiguous unit range of a sample; see
:func:`~dflop.runtime.routing.split_units`) go from the encoder DP replica that computed
them (its last stage, tp rank 0: an *encoder bridge rank*) straight to the LLM DP replica
that the Schedule gave the sample (its first stage, tp rank 0: an *LLM bridge rank*),
which thus receives every unit of its samples; gradients travel back the
same way. That is an all-to-all with uneven splits between the S encoder and D LLM bridge
ranks, with no hub rank.

Why point-to-point and not ``all_to_all``
    A collective needs every member of the group to call the same collectives in the same
    order. In 1F1B the last encoder stage and the first LLM stage interleave forward and
    backward microbatches differently (the encoder stage sends forward k+1 before it needs
    backward k; the LLM stage needs forward k+1 only after it sent backward k), so one
    collective per transfer would be called in different orders on the two sides and
    deadlock. Instead every transfer is a batch of ``isend``/``irecv`` pairs
    (``batch_isend_irecv``), one per (src, dst) pair that moves at least one row, tagged
    with (microbatch, direction, data|header). Matching is then per pair and per tag
    (gloo) or per pair and direction in issue order (NCCL, which ignores tags), so the two
    directions never wait on each other and empty pairs cost nothing.

Blocking: a send completes only once the peer has posted the matching receive (gloo's
sends are rendezvous; NCCL's block the stream likewise). So, as in any 1F1B runtime, a
stage must not block on a send while its peer blocks on a send the other way: post
receives early with ``wait=False`` (e.g. the encoder posts ``recv_grads`` before it
sends the next microbatch's features) or issue sends with ``wait=False`` and wait later.

Shapes come from the :class:`~dflop.runtime.routing.RoutingPlan`, which every rank
derives from the step's Schedule, so there is no shape handshake. With ``debug=True``
every (src, dst) pair, even an empty one, first exchanges a small header (magic,
microbatch id, direction, rows, hidden size, dtype); the receiver compares it with its own
plan and raises a ``RuntimeError`` naming both ranks and the mismatch instead of hanging
or silently misreading rows (the data receives are posted only after the check, from a
short-lived helper thread, so debug mode blocks exactly like normal mode; it is meant for
gloo/CPU runs and is untested on NCCL).

Timeouts: on CPU (gloo) every wait uses ``timeout_s`` (default: the topology's group
timeout); a peer that never answers becomes a ``RuntimeError`` naming the ranks and the
microbatch. On CUDA (NCCL) waits are stream-ordered and the process group's timeout
bounds them (``timeout_s`` would block the host). The
process-wide default (``init_process_group(timeout=...)``, set by
:mod:`dflop.runtime.launch`) bounds everything else.

Tensors: one message per (src, dst) pair: the pair's items' rows concatenated in
``plan.pair_items(src, dst)`` order. The sender's tensor form is its ``send_order``
(pairs (s, 0), (s, 1), ... concatenated), so each message is one slice; the receiver's
tensor form is its ``recv_order`` (ascending item position: for pieces, every sample's
units in order) and costs one row gather.
On CUDA (NCCL, or ranks sharing a GPU in a thread world) the buffers live on the
current CUDA device and the communicator has its own stream: packing (the sender's
gather into arrival order), the transfers and unpacking (the receiver's
:func:`~dflop.runtime.rows.gather_rows` into recv order, a ``dflop._cuda`` kernel where
built) run there, ordered after the caller's stream (which made the data); ``wait``
orders the communicator's stream after the transfer, unpacks, and makes the caller's
stream wait for it, without blocking the host, so the caller's next compute proceeds
meanwhile; the returned tensors are marked as used on the caller's stream (the
allocator keeps them until it is done). A hang is caught by the process group's timeout
rather than ``timeout_s``. The NCCL path has not run yet (it needs two GPUs); the
thread-world path is a GPU test of ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np
import torch

from dflop.errors import InputTypeError
from dflop.runtime import dist, thread_world
from dflop.runtime.p2p import (
    BACKWARD,
    FORWARD,
    HEADER_LEN,
    collective_device,
    debug_header,
    header_mismatch,
    header_payload_bytes,
    message_tag,
)
from dflop.runtime.routing import RoutingPlan
from dflop.runtime.rows import gather_rows
from dflop.runtime.topology import Topology

__all__ = ["BridgeCommunicator", "PendingTransfer"]

FEATURES = FORWARD
GRADS = BACKWARD
_DIRECTION_NAMES = {FEATURES: "features", GRADS: "gradients"}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

FeatureInput = Union[Mapping[int, torch.Tensor], torch.Tensor]
FeatureOutput = Union[dict[int, torch.Tensor], torch.Tensor]


class PendingTransfer:
    """A transfer in flight. ``wait()`` returns the received data (None for sends) once it
    is safe to use: on CPU (gloo) it blocks, up to the communicator's timeout, until every
    message completed; on CUDA (``stream``: the communicator's stream) the stream waits for
    the transfer, unpacks there, and the caller's current stream waits for the stream; the
    call returns at once, so the host goes on queueing work (a timed wait would block the
    host on NCCL); a hung transfer is then caught by the process group's own timeout (set
    by the launcher)."""

    def __init__(
        self,
        works: Sequence[Any],
        finish: Callable[[], Any],
        describe: Callable[[], str],
        timeout_s: float,
        keepalive: Sequence[torch.Tensor] = (),
        prepare: Callable[[], list[Any]] | None = None,
        stream: Any = None,
    ) -> None:
        self._works = list(works)
        self._prepare = prepare  # debug mode: header check, then the data works
        self._finish = finish
        self._describe = describe
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._timeout_s = timeout_s
        self._keepalive = list(keepalive)  # send buffers must outlive the send
        self._stream = stream
        self._done = False
        self._result: Any = None

    def wait(self) -> Any:
        if not self._done:
            if self._prepare is not None:
                self._works += self._prepare()
                self._prepare = None
            caller = _current_stream(self._stream)
            with _on_stream(self._stream):
                for work in self._works:
                    try:
                        if self._stream is not None:
                            work.wait()  # orders the communicator's stream after it
                        else:
                            work.wait(self._timeout)
                    except RuntimeError as error:
                        limit = (
                            "the process group's timeout"
                            if self._stream is not None
                            else f"timeout {self._timeout_s:g} s"
                        )
                        raise RuntimeError(
                            f"{self._describe()} failed or timed out ({limit}): {error}"
                        ) from error
                self._result = self._finish()  # the unpack, on the communicator's stream
            if caller is not None:
                caller.wait_stream(self._stream)
                _used_on(self._result, caller)
            self._works.clear()
            self._keepalive.clear()
            self._done = True
        return self._result


class BridgeCommunicator:
    """Moves encoder features to the LLM and their gradients back (see the module doc).

    Build it on every bridge rank (``topology.info.is_bridge_sender`` or
    ``is_bridge_receiver``), all with the same ``hidden_size``, ``dtype`` and ``debug``:
    the constructor runs one small collective on the bridge group (which also warms up
    NCCL's P2P, whose first use on a group must involve all its ranks) and checks that
    they agree.

    Encoder side: :meth:`send_features`, :meth:`recv_grads`. LLM side:
    :meth:`recv_features`, :meth:`send_grads`. Each takes ``wait=True``; with
    ``wait=False`` it returns a :class:`PendingTransfer` whose ``wait()`` returns the
    result (so receives can be posted early and overlap compute).
    """

    def __init__(
        self,
        topology: Topology,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        *,
        device: torch.device | str | None = None,
        debug: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        info = topology.info
        if not (info.is_bridge_sender or info.is_bridge_receiver) or topology.bridge_group is None:
            raise ValueError(
                f"rank {info.rank} ({info.module} stage {info.pp_rank}, tp rank {info.tp_rank}) "
                "is not a bridge rank: only the last encoder stage's and the first LLM "
                "stage's tp-rank-0 ranks build a BridgeCommunicator"
            )
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size must be an integer >= 1, got {hidden_size!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
        self.topology = topology
        self.layout = topology.layout
        self.rank = info.rank
        self.side = "encoder" if info.is_bridge_sender else "llm"
        self.replica = info.dp_rank
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.debug = bool(debug)
        self.timeout_s = float(topology.timeout_s if timeout_s is None else timeout_s)
        self.group = topology.bridge_group
        self.device = torch.device(device) if device is not None else collective_device(self.group)
        # CUDA: packing, transfers and unpacking run on this stream, ordered after the
        # caller's stream and before the caller's use of the result; waits order streams,
        # they do not block the host (debug mode: timed host waits on the caller's stream).
        self._stream = (
            torch.cuda.Stream(self.device)
            if self.device.type == "cuda" and not self.debug
            else None
        )
        self._check_agreement()

    # ---- public API ---------------------------------------------------------------------

    def send_features(
        self, microbatch_id: int, plan: RoutingPlan, features: FeatureInput, *, wait: bool = True
    ) -> PendingTransfer:
        """Encoder side: send this replica's features of ``microbatch_id``.

        ``features``: ``{item_id: Tensor[rows_i, hidden]}`` for this replica's items
        (``plan.send_order[replica]``; zero-row items may be left out), or one
        ``Tensor[plan.send_rows(replica), hidden]`` in send order. Only data moves (no
        autograd): keep the graph on this side and feed :meth:`recv_grads`'s result to
        ``backward``.
        """
        self._require("encoder", "send_features")
        src = self.replica
        self._check_plan(plan)
        with self._side():
            buffers = self._split_outgoing(
                features,
                plan.send_order[src],
                plan,
                counts=plan.send_counts[src, :],
                what=f"features of microbatch {microbatch_id}",
            )
            peers = [self.layout.llm_bridge_rank(d) for d in range(plan.num_dst)]
            transfer = self._send(microbatch_id, FEATURES, buffers, peers)
        if wait:
            transfer.wait()
        return transfer

    def recv_features(
        self, microbatch_id: int, plan: RoutingPlan, *, as_tensor: bool = False, wait: bool = True
    ) -> FeatureOutput | PendingTransfer:
        """LLM side: receive the features of this replica's items of ``microbatch_id``.

        Returns ``{item_id: Tensor[rows_i, hidden]}`` for every item of
        ``plan.recv_order[replica]`` (zero-row items get an empty tensor; the values are
        views of one buffer), or with ``as_tensor=True`` one
        ``Tensor[plan.recv_rows(replica), hidden]`` in recv order.
        """
        self._require("llm", "recv_features")
        dst = self.replica
        self._check_plan(plan)
        counts = plan.send_counts[:, dst]
        peers = [self.layout.encoder_bridge_rank(s) for s in range(plan.num_src)]
        arrival_ids = [plan.pair_items(s, dst) for s in range(plan.num_src)]

        def finish(arrived: torch.Tensor) -> FeatureOutput:
            if as_tensor:
                index = plan.recv_arrival_index(dst)
                if _is_identity(index):
                    return arrived
                return gather_rows(arrived, index)  # unpack into recv order
            return _as_dict(arrived, arrival_ids, plan, order=plan.recv_order[dst])

        with self._side():
            transfer = self._recv(microbatch_id, FEATURES, counts, peers, finish)
        return transfer.wait() if wait else transfer

    def send_grads(
        self, microbatch_id: int, plan: RoutingPlan, grads: FeatureInput, *, wait: bool = True
    ) -> PendingTransfer:
        """LLM side: send the gradients w.r.t. the received features back to the encoder
        replicas that computed them. ``grads``: ``{item_id: Tensor[rows_i, hidden]}``
        or one ``Tensor[plan.recv_rows(replica), hidden]`` in recv order."""
        self._require("llm", "send_grads")
        dst = self.replica
        self._check_plan(plan)
        counts = plan.send_counts[:, dst]
        what = f"gradients of microbatch {microbatch_id}"
        with self._side():
            if isinstance(grads, torch.Tensor):
                self._check_tensor(grads, plan.recv_rows(dst), what)
                index = plan.recv_arrival_index(dst)
                if not _is_identity(index):  # pack back into arrival order
                    order = np.argsort(index, kind="stable")
                    grads = gather_rows(grads.detach().contiguous(), order)
                buffers = _slices(grads.detach(), counts)
            else:
                arrival_order = np.concatenate(
                    [plan.pair_items(s, dst) for s in range(plan.num_src)] + [np.zeros(0, np.int64)]
                )
                buffers = self._split_outgoing(grads, arrival_order, plan, counts=counts, what=what)
            peers = [self.layout.encoder_bridge_rank(s) for s in range(plan.num_src)]
            transfer = self._send(microbatch_id, GRADS, buffers, peers)
        if wait:
            transfer.wait()
        return transfer

    def recv_grads(
        self, microbatch_id: int, plan: RoutingPlan, *, as_tensor: bool = False, wait: bool = True
    ) -> FeatureOutput | PendingTransfer:
        """Encoder side: receive the gradients of this replica's features of
        ``microbatch_id``: ``{item_id: Tensor[rows_i, hidden]}`` or, with
        ``as_tensor=True``, one tensor in send order (matching :meth:`send_features`'
        tensor form, so ``features.backward(grads)`` works directly)."""
        self._require("encoder", "recv_grads")
        src = self.replica
        self._check_plan(plan)
        counts = plan.send_counts[src, :]
        peers = [self.layout.llm_bridge_rank(d) for d in range(plan.num_dst)]
        pair_ids = [plan.pair_items(src, d) for d in range(plan.num_dst)]

        def finish(arrived: torch.Tensor) -> FeatureOutput:
            return arrived if as_tensor else _as_dict(arrived, pair_ids, plan, order=None)

        with self._side():
            transfer = self._recv(microbatch_id, GRADS, counts, peers, finish)
        return transfer.wait() if wait else transfer

    # ---- transport ----------------------------------------------------------------------

    def _send(
        self,
        microbatch_id: int,
        direction: int,
        buffers: list[torch.Tensor],
        peers: list[int],
    ) -> PendingTransfer:
        ops, keep = [], []
        for peer, buffer in zip(peers, buffers):
            rows = int(buffer.shape[0])
            if self.debug:
                header = self._header(microbatch_id, direction, rows)
                keep.append(header)
                ops.append(
                    self._op(
                        dist.isend, header, peer, message_tag(microbatch_id, direction, header=True)
                    )
                )
            if rows > 0:
                keep.append(buffer)
                ops.append(
                    self._op(dist.isend, buffer, peer, message_tag(microbatch_id, direction))
                )
        works = dist.batch_isend_irecv(ops) if ops else []
        active = [p for p, b in zip(peers, buffers) if self.debug or b.shape[0] > 0]
        transfer = PendingTransfer(
            works,
            finish=lambda: None,
            describe=lambda: self._describe("sending", microbatch_id, direction, active),
            timeout_s=self.timeout_s,
            keepalive=keep,
            stream=self._stream,
        )
        return transfer

    def _recv(
        self,
        microbatch_id: int,
        direction: int,
        counts: np.ndarray,
        peers: list[int],
        finish: Callable[[torch.Tensor], Any],
    ) -> PendingTransfer:
        total_rows = int(counts.sum())
        arrived = torch.empty(total_rows, self.hidden_size, dtype=self.dtype, device=self.device)
        parts, start = [], 0
        for peer, rows in zip(peers, counts.tolist()):
            # A leading-dim slice of a contiguous buffer is contiguous: receive in place.
            parts.append((peer, arrived.narrow(0, start, rows)))
            start += rows
        active = [peer for peer, part in parts if part.shape[0] > 0]
        tag = message_tag(microbatch_id, direction)
        if self.debug:
            works: list[Any] = []
            prepare = self._debug_prepare(microbatch_id, direction, counts, peers, parts)
        else:
            ops = [self._op(dist.irecv, part, peer, tag) for peer, part in parts if part.shape[0]]
            works, prepare = (dist.batch_isend_irecv(ops) if ops else []), None
        transfer = PendingTransfer(
            works,
            finish=lambda: finish(arrived),
            describe=lambda: self._describe("receiving", microbatch_id, direction, active),
            timeout_s=self.timeout_s,
            prepare=prepare,
            stream=self._stream,
        )
        return transfer

    def _side(self) -> Any:
        """CUDA: a context running the enclosed packing and transfers on the
        communicator's stream, after all work queued so far on the caller's stream (which
        made the data). Elsewhere: nothing."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return _on_stream(self._stream)

    def _op(self, fn: Any, tensor: torch.Tensor, peer: int, tag: int) -> dist.P2POp:
        return dist.P2POp(fn, tensor, peer=peer, group=self.group, tag=tag)

    # ---- debug headers ------------------------------------------------------------------

    def _header(self, microbatch_id: int, direction: int, rows: int) -> torch.Tensor:
        shape = (rows, self.hidden_size)
        return debug_header(microbatch_id, direction, shape, self.dtype, self.device)

    def _debug_prepare(
        self,
        microbatch_id: int,
        direction: int,
        counts: np.ndarray,
        peers: list[int],
        parts: list[tuple[int, torch.Tensor]],
    ) -> Callable[[], list[Any]]:
        """Debug receive: post the header receives now; a helper thread waits for them,
        compares them with the plan and only then posts the data receives.

        Posting a data receive before its header is checked is unsafe: gloo aborts the
        process when a message is longer than the posted buffer (and silently accepts a
        shorter one). Waiting for the headers on the caller's thread instead would change
        when the data receives get posted, and gloo's sends only complete once the
        matching receive is posted, so a ``wait=False`` receive must post its data
        without the caller's help: hence one short-lived thread per debug receive. On a
        mismatch the thread still drains the messages as the headers describe them (so
        the sender does not hang) and ``wait()`` raises the mismatch.
        """
        headers = [torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device) for _ in peers]
        header_tag = message_tag(microbatch_id, direction, header=True)
        ops = [self._op(dist.irecv, h, p, header_tag) for h, p in zip(headers, peers)]
        header_works = dist.batch_isend_irecv(ops) if ops else []
        timeout = datetime.timedelta(seconds=self.timeout_s)
        outcome: dict[str, Any] = {}
        member = thread_world.current()  # a thread world's rank: the helper acts as it
        # ... on the caller's CUDA stream (current streams are per thread), after which
        # the receive buffers were made.
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        def run() -> None:
            if member is not None:
                member[0].join(member[1])
            with _on_stream(stream):
                post_after_check()

        def post_after_check() -> None:
            try:
                for work in header_works:
                    work.wait(timeout)
            except RuntimeError as error:
                outcome["error"] = RuntimeError(
                    f"{self._describe('receiving debug headers for', microbatch_id, direction, peers)}"
                    f" failed or timed out (timeout {self.timeout_s:g} s): {error}"
                )
                return
            mismatch = self._header_mismatch(microbatch_id, direction, counts, peers, headers)
            tag = message_tag(microbatch_id, direction)
            if mismatch is None:
                recvs = [self._op(dist.irecv, t, p, tag) for p, t in parts if t.shape[0]]
                outcome["works"] = dist.batch_isend_irecv(recvs) if recvs else []
                return
            outcome["error"] = RuntimeError(mismatch)
            drains = []
            for (peer, _), header in zip(parts, headers):
                size = header_payload_bytes(header)
                if size > 0:
                    sink = torch.empty(size, dtype=torch.uint8, device=self.device)
                    drains.append(self._op(dist.irecv, sink, peer, tag))
            for work in dist.batch_isend_irecv(drains) if drains else []:
                with contextlib.suppress(RuntimeError):
                    work.wait(timeout)

        thread = threading.Thread(
            target=run, name=f"dflop-bridge-debug-mb{microbatch_id}", daemon=True
        )
        thread.start()

        def prepare() -> list[Any]:
            thread.join(self.timeout_s * 2 + 1.0)  # run() bounds its own waits by timeout_s
            if thread.is_alive():
                raise RuntimeError(
                    f"{self._describe('checking debug headers for', microbatch_id, direction, peers)}"
                    " did not finish in time"
                )
            if "error" in outcome:
                raise outcome["error"]
            return outcome["works"]

        return prepare

    def _header_mismatch(
        self,
        microbatch_id: int,
        direction: int,
        counts: np.ndarray,
        peers: list[int],
        headers: list[torch.Tensor],
    ) -> str | None:
        """None if every header matches the plan, else a message naming both ranks."""
        for header, peer, rows in zip(headers, peers, counts.tolist()):
            diffs = header_mismatch(header, self._header(microbatch_id, direction, rows))
            if diffs is None:
                continue
            return (
                f"bridge {_DIRECTION_NAMES[direction]} mismatch for microbatch {microbatch_id}: "
                f"rank {peer} ({self._peer_role()} replica {self._peer_replica(peer)}) sent a "
                f"header that rank {self.rank} ({self._role()} replica {self.replica}) does not "
                f"expect from its routing plan ({diffs}); the two ranks derived different "
                "plans (different Schedule, encoder split or rows?)"
            )
        return None

    # ---- helpers ------------------------------------------------------------------------

    def _check_agreement(self) -> None:
        """One all-reduce over the bridge group: everyone's (hidden, dtype, debug) equal."""
        mine = [self.hidden_size, _DTYPES.index(self.dtype), int(self.debug)]
        values = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=self.device)
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            raise RuntimeError(
                f"rank {self.rank}: BridgeCommunicator setup on the bridge group "
                f"{list(self.topology.bridge_ranks)} failed or timed out (every bridge rank "
                f"must build one): {error}"
            ) from error
        highest, lowest = values[:3].tolist(), [-v for v in values[3:].tolist()]
        if highest != lowest:
            raise ValueError(
                "bridge ranks disagree on (hidden_size, dtype code, debug): "
                f"between {lowest} and {highest}; rank {self.rank} has {mine}"
            )

    def _require(self, side: str, method: str) -> None:
        if self.side != side:
            raise RuntimeError(
                f"{method} runs on {side} bridge ranks; rank {self.rank} is an {self.side} "
                "bridge rank"
            )

    def _check_plan(self, plan: RoutingPlan) -> None:
        if not isinstance(plan, RoutingPlan):
            raise InputTypeError(f"plan must be a RoutingPlan, got {type(plan).__name__}")
        if plan.num_src != self.layout.encoder.dp or plan.num_dst != self.layout.llm.dp:
            raise ValueError(
                f"the plan routes {plan.num_src} encoder x {plan.num_dst} LLM replicas but the "
                f"layout has encoder dp={self.layout.encoder.dp}, llm dp={self.layout.llm.dp} "
                "(pass num_src/num_dst to plan_routing)"
            )

    def _check_tensor(self, tensor: torch.Tensor, rows: int, what: str) -> None:
        expected = (rows, self.hidden_size)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"rank {self.rank}: {what} has shape {tuple(tensor.shape)}, the plan expects "
                f"{expected}"
            )
        if tensor.dtype != self.dtype:
            raise ValueError(
                f"rank {self.rank}: {what} has dtype {tensor.dtype}, expected {self.dtype}"
            )

    def _split_outgoing(
        self,
        data: FeatureInput,
        order: np.ndarray,
        plan: RoutingPlan,
        *,
        counts: np.ndarray,
        what: str,
    ) -> list[torch.Tensor]:
        """One contiguous buffer per peer: rows of ``order``'s items, cut by ``counts``."""
        total_rows = int(counts.sum())
        if isinstance(data, torch.Tensor):
            self._check_tensor(data, total_rows, what)
            return _slices(data.detach(), counts)
        if not isinstance(data, Mapping):
            raise InputTypeError(
                f"{what} must be a dict of tensors or one tensor, got {type(data)}"
            )
        rows = plan.rows_of(order)
        pieces = []
        for item_id, item_rows in zip(order.tolist(), rows.tolist()):
            tensor = data.get(item_id)
            if tensor is None:
                if item_rows == 0:
                    continue
                raise KeyError(f"rank {self.rank}: {what} lacks item {item_id} ({item_rows} rows)")
            self._check_tensor(tensor, item_rows, f"{what}, item {item_id}")
            pieces.append(tensor.detach())
        joined = (
            torch.cat(pieces)
            if pieces
            else torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device)
        )
        return _slices(joined, counts)

    def _role(self) -> str:
        return "encoder" if self.side == "encoder" else "LLM"

    def _peer_role(self) -> str:
        return "LLM" if self.side == "encoder" else "encoder"

    def _peer_replica(self, peer: int) -> int:
        first = self.layout.first_rank("llm" if self.side == "encoder" else "encoder")
        mod = self.layout.llm if self.side == "encoder" else self.layout.encoder
        return (peer - first) // (mod.tp * mod.pp)

    def _describe(self, verb: str, microbatch_id: int, direction: int, peers: list[int]) -> str:
        return (
            f"rank {self.rank} ({self._role()} bridge, replica {self.replica}) {verb} "
            f"{_DIRECTION_NAMES[direction]} of microbatch {microbatch_id} with rank(s) {peers}"
        )


def _slices(tensor: torch.Tensor, counts: np.ndarray) -> list[torch.Tensor]:
    """Contiguous row slices of ``tensor`` of ``counts`` rows each."""
    tensor = tensor.contiguous()
    out, start = [], 0
    for rows in counts.tolist():
        out.append(tensor.narrow(0, start, rows))
        start += rows
    return out


def _as_dict(
    arrived: torch.Tensor,
    ids_by_peer: Sequence[np.ndarray],
    plan: RoutingPlan,
    order: np.ndarray | None,
) -> dict[int, torch.Tensor]:
    """Per-item views of ``arrived`` (the peers' messages concatenated in order), keyed
    by item id and iterating in ``order`` (default: arrival order)."""
    views: dict[int, torch.Tensor] = {}
    start = 0
    for ids in ids_by_peer:
        for item_id, rows in zip(ids.tolist(), plan.rows_of(ids).tolist()):
            views[item_id] = arrived.narrow(0, start, rows)
            start += rows
    if order is None:
        return views
    return {item_id: views[item_id] for item_id in order.tolist()}


def _is_identity(index: np.ndarray) -> bool:
    return bool(np.array_equal(index, np.arange(index.shape[0])))


def _current_stream(stream: Any) -> Any:
    """The caller's current stream on ``stream``'s device (None without a stream)."""
    return None if stream is None else torch.cuda.current_stream(stream.device)


def _on_stream(stream: Any) -> Any:
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _used_on(result: Any, stream: Any) -> None:
    """Tell the caching allocator that ``result``'s tensors (made on the communicator's
    stream) are used on ``stream``, so their memory is not reused before it is done."""
    tensors = result.values() if isinstance(result, dict) else [result]
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
            tensor.record_stream(stream)
