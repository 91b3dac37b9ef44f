"""Which encoder replica encodes each sample, and who sends which feature rows to whom.

Per microbatch, the encoder's DP replicas share the microbatch's images
(:func:`encoder_split`), and each LLM DP replica consumes the samples the Schedule gave it
(bin ``mb * dp_size + d``). :func:`plan_routing` (computed in the C++ core) turns "sample i
is encoded on replica src[i], consumed on replica dst[i], and has rows[i] feature rows"
into a :class:`RoutingPlan` from which both ends of every transfer derive its shape and
row order: no shape handshake.

Orders (sample ids; positions in the microbatch when no ``sample_ids`` are given):

- ``pair_samples(s, d)``: samples encoded on s and consumed on d, in position order;
- ``send_order[s]``: pairs ``(s, 0), (s, 1), ...`` concatenated: s's samples grouped by
  destination, so each destination's rows are one contiguous slice;
- ``recv_order[d]``: d's samples in position order (for a Schedule microbatch, ascending
  sample id: the order of ``Schedule.bin``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop import _core

__all__ = ["RoutingPlan", "encoder_split", "plan_for_microbatch", "plan_routing"]


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def _int_array(name: str, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.size == 0:
        array = array.astype(np.int64)
    if array.dtype == object or array.dtype.kind not in "iu" or array.ndim != 1:
        raise TypeError(f"{name} must be a 1-D integer array, got {array.dtype} {array.shape}")
    return np.ascontiguousarray(array, dtype=np.int64)


def _count(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


@dataclass(frozen=True, eq=False)
class RoutingPlan:
    """Routing of one microbatch's features from S encoder replicas to D LLM replicas.

    Arrays are read-only int64. Sample ids are ``sample_ids[position]``.
    """

    send_counts: np.ndarray
    """(S, D): feature rows that encoder replica s sends to LLM replica d."""
    send_order: tuple[np.ndarray, ...]
    """Per src: the sample ids it sends, grouped by dst (see the module docstring)."""
    recv_order: tuple[np.ndarray, ...]
    """Per dst: the sample ids it receives, in position order."""
    sample_ids: np.ndarray
    """(N,): sample id of each position."""
    src_replica: np.ndarray
    """(N,): encoder replica of each position."""
    dst_replica: np.ndarray
    """(N,): LLM replica of each position."""
    rows: np.ndarray
    """(N,): feature rows of each position."""
    pair_offsets: np.ndarray
    """(S * D + 1,): CSR offsets of the (s, d) pairs (src-major) into ``pair_positions``."""
    pair_positions: np.ndarray
    """(N,): positions of the pairs' samples; src-major, ascending within a pair."""

    @property
    def num_src(self) -> int:
        return int(self.send_counts.shape[0])

    @property
    def num_dst(self) -> int:
        return int(self.send_counts.shape[1])

    @property
    def num_samples(self) -> int:
        return int(self.sample_ids.shape[0])

    @property
    def recv_counts(self) -> np.ndarray:
        """(D, S): feature rows that LLM replica d receives from encoder replica s."""
        return self.send_counts.T

    def pair_samples(self, src: int, dst: int) -> np.ndarray:
        """Sample ids that go from encoder replica ``src`` to LLM replica ``dst``."""
        if not (0 <= src < self.num_src and 0 <= dst < self.num_dst):
            raise ValueError(
                f"(src, dst)=({src}, {dst}) is out of range ({self.num_src}, {self.num_dst})"
            )
        pair = src * self.num_dst + dst
        return self.sample_ids[
            self.pair_positions[self.pair_offsets[pair] : self.pair_offsets[pair + 1]]
        ]

    def rows_of(self, sample_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Feature rows of the given sample ids."""
        return self.rows[self.positions_of(sample_ids)]

    def positions_of(self, sample_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Positions of the given sample ids (KeyError naming the first unknown id)."""
        index = self.__dict__.get("_position_index")
        if index is None:
            index = {int(s): p for p, s in enumerate(self.sample_ids)}
            object.__setattr__(self, "_position_index", index)
        try:
            return np.fromiter((index[int(s)] for s in sample_ids), dtype=np.int64)
        except KeyError as error:
            raise KeyError(f"sample id {error.args[0]} is not in this microbatch's plan") from None

    def send_rows(self, src: int) -> int:
        """Total feature rows encoder replica ``src`` sends."""
        return int(self.send_counts[src].sum())

    def recv_rows(self, dst: int) -> int:
        """Total feature rows LLM replica ``dst`` receives."""
        return int(self.send_counts[:, dst].sum())

    def recv_arrival_index(self, dst: int) -> np.ndarray:
        """Row permutation from arrival order to recv order at LLM replica ``dst``.

        The rows arrive src by src (pair (0, dst), (1, dst), ...). With ``arrived`` those
        rows concatenated, ``arrived[index]`` is in recv order, and ``recv_tensor[inverse]``
        (``inverse = argsort(index)``) is back in arrival order. Cached.
        """
        cache = self.__dict__.setdefault("_arrival_cache", {})
        if dst not in cache:
            arrival_positions = np.concatenate(
                [self.pair_positions[self._pair_slice(s, dst)] for s in range(self.num_src)]
                + [np.zeros(0, np.int64)]
            )
            recv_positions = self.positions_of(self.recv_order[dst])
            # Row start of each position in arrival order, then gather in recv order.
            arrival_rows = self.rows[arrival_positions]
            arrival_start = np.concatenate([[0], np.cumsum(arrival_rows)[:-1]]).astype(np.int64)
            start_of = dict(zip(arrival_positions.tolist(), arrival_start.tolist()))
            pieces = [
                np.arange(start_of[p], start_of[p] + self.rows[p], dtype=np.int64)
                for p in recv_positions.tolist()
            ]
            index = np.concatenate(pieces + [np.zeros(0, np.int64)])
            cache[dst] = _frozen(index)
        return cache[dst]

    def _pair_slice(self, src: int, dst: int) -> slice:
        pair = src * self.num_dst + dst
        return slice(int(self.pair_offsets[pair]), int(self.pair_offsets[pair + 1]))


def plan_routing(
    src_replica: Any,
    dst_replica: Any,
    rows: Any,
    *,
    num_src: int | None = None,
    num_dst: int | None = None,
    sample_ids: Any = None,
) -> RoutingPlan:
    """Routing plan of one microbatch (computed in the C++ core).

    Args:
        src_replica: (N,) encoder DP replica that encodes each sample.
        dst_replica: (N,) LLM DP replica that consumes each sample.
        rows: (N,) feature rows of each sample (its visual tokens in the LLM; 0 for a
            text-only sample, which is still routed, with no rows).
        num_src, num_dst: replica counts (encoder DP, LLM DP). Default: largest index + 1.
            Pass them when a replica may get nothing, so the plan has its full shape.
        sample_ids: (N,) distinct ids of the samples (e.g. ``Schedule.microbatch(mb)``);
            default ``arange(N)``. Orders and the communicator's dicts use these ids.

    Raises:
        ValueError: a replica out of range or negative rows (naming the argument and
            index), lengths that differ, or duplicate sample ids.
    """
    src = _int_array("src_replica", src_replica)
    dst = _int_array("dst_replica", dst_replica)
    row_array = _int_array("rows", rows)
    n = src.shape[0]
    if sample_ids is None:
        ids = np.arange(n, dtype=np.int64)
    else:
        ids = _int_array("sample_ids", sample_ids)
        if ids.shape[0] != n:
            raise ValueError(f"sample_ids has length {ids.shape[0]}, expected {n}")
        if np.unique(ids).shape[0] != n:
            raise ValueError("sample_ids must be distinct")
    num_src = (int(src.max()) + 1 if n else 1) if num_src is None else _count("num_src", num_src)
    num_dst = (int(dst.max()) + 1 if n else 1) if num_dst is None else _count("num_dst", num_dst)
    raw = _core.plan_routing(src, dst, row_array, num_src, num_dst)
    send_order = tuple(
        _frozen(ids[raw["send_order"][raw["send_offsets"][s] : raw["send_offsets"][s + 1]]])
        for s in range(num_src)
    )
    recv_order = tuple(
        _frozen(ids[raw["recv_order"][raw["recv_offsets"][d] : raw["recv_offsets"][d + 1]]])
        for d in range(num_dst)
    )
    return RoutingPlan(
        send_counts=_frozen(raw["send_rows"]),
        send_order=send_order,
        recv_order=recv_order,
        sample_ids=_frozen(ids.copy()),
        src_replica=_frozen(src.copy()),
        dst_replica=_frozen(dst.copy()),
        rows=_frozen(row_array.copy()),
        pair_offsets=_frozen(raw["pair_offsets"]),
        pair_positions=_frozen(raw["pair_samples"]),
    )


def _split(costs: np.ndarray, num_replicas: int) -> np.ndarray:
    return _core.split_for_encoder(np.ascontiguousarray(costs, dtype=np.float64), num_replicas)


def encoder_split(
    schedule_or_sample_ids: Any, encoder_costs: Any, num_encoder_replicas: int
) -> np.ndarray:
    """Encoder DP replica of each sample: each microbatch's samples split across the
    encoder replicas minimising the largest replica's encoder cost (LPT + local search in
    the C++ core; deterministic; zero-cost samples spread by count).

    Args:
        schedule_or_sample_ids: a :class:`dflop.Schedule` (every microbatch is split on
            its own) or the sample ids of ONE microbatch.
        encoder_costs: (N,) encoder cost of every sample of the global batch, indexed by
            sample id (column 0 of the Schedule's costs in dflop's own use).
        num_encoder_replicas: the encoder's DP size.

    Returns:
        int64 array: for a Schedule, (N,) the replica of every sample; for sample ids,
        the replica of each listed sample, in the listed order.
    """
    from dflop.scheduler import Schedule

    num_encoder_replicas = _count("num_encoder_replicas", num_encoder_replicas)
    costs = np.asarray(encoder_costs, dtype=np.float64)
    if costs.ndim != 1:
        raise ValueError(f"encoder_costs must be 1-D (N,), got shape {costs.shape}")
    if isinstance(schedule_or_sample_ids, Schedule):
        schedule = schedule_or_sample_ids
        if costs.shape[0] != schedule.num_samples:
            raise ValueError(
                f"encoder_costs has {costs.shape[0]} entries but the schedule has "
                f"{schedule.num_samples} samples"
            )
        replica = np.zeros(schedule.num_samples, dtype=np.int64)
        for mb in range(schedule.num_microbatches):
            ids = schedule.microbatch(mb)
            replica[ids] = _split(costs[ids], num_encoder_replicas)
        return replica
    ids = _int_array("sample_ids", schedule_or_sample_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= costs.shape[0]):
        bad = int(np.flatnonzero((ids < 0) | (ids >= costs.shape[0]))[0])
        raise ValueError(
            f"sample_ids[{bad}]={ids[bad]} is out of range for encoder_costs of length "
            f"{costs.shape[0]}"
        )
    return _split(costs[ids], num_encoder_replicas)


def plan_for_microbatch(
    schedule: Any,
    microbatch_id: int,
    encoder_replica: Any,
    rows: Any,
    num_encoder_replicas: int,
) -> RoutingPlan:
    """The plan of a Schedule's microbatch: samples ``schedule.microbatch(mb)``, dst = their
    LLM DP rank (bin % dp_size), src = ``encoder_replica[sample]`` (e.g. from
    :func:`encoder_split`), rows = ``rows[sample]``; both indexed by sample id."""
    ids = schedule.microbatch(microbatch_id)
    encoder_replica = _int_array("encoder_replica", encoder_replica)
    rows = _int_array("rows", rows)
    return plan_routing(
        encoder_replica[ids],
        schedule.assignment[ids] % schedule.dp_size,
        rows[ids],
        num_src=num_encoder_replicas,
        num_dst=schedule.dp_size,
        sample_ids=ids,
    )
