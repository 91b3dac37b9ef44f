"""How the encoder's DP replicas share a microbatch, and who sends which feature rows
to whom.

Per microbatch, the encoder's DP replicas share the microbatch's *visual units* (anyres
tiles, video frames, the images of a multi-image sample): :func:`split_units` (the C++
core's ``split_units``, the same function the planner scores layouts with) cuts each
sample into *pieces*, contiguous unit ranges, each computed by one replica, balancing the
replicas' encoder cost. Each LLM DP replica consumes whole samples, the ones the
Schedule gave it (bin ``mb * dp_size + d``). :func:`plan_routing` (also C++) turns "item
i is encoded on replica src[i], consumed on replica dst[i] and has rows[i] feature rows"
into a :class:`RoutingPlan` from which both ends of every transfer derive its shape and
row order: no shape handshake. In the runtime the items are the pieces, in (sample, first
unit) order, so an LLM replica receives every sample's units in order and can run
per-sample operations that span units (they need the whole sample) on what arrived.

Orders (item ids; positions in the microbatch when no ``item_ids`` are given):

- ``pair_items(s, d)``: items encoded on s and consumed on d, in position order;
- ``send_order[s]``: pairs ``(s, 0), (s, 1), ...`` concatenated: s's items grouped by
  destination, so each destination's rows are one contiguous slice;
- ``recv_order[d]``: d's items in position order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop import _core
from dflop.errors import InputTypeError

__all__ = ["RoutingPlan", "UnitSplit", "plan_routing", "split_units"]


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def _int_array(name: str, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.size == 0:
        array = array.astype(np.int64)
    if array.dtype == object or array.dtype.kind not in "iu" or array.ndim != 1:
        raise InputTypeError(f"{name} must be a 1-D integer array, got {array.dtype} {array.shape}")
    return np.ascontiguousarray(array, dtype=np.int64)


def _count(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


@dataclass(frozen=True, eq=False)
class RoutingPlan:
    """Routing of one microbatch's features from S encoder replicas to D LLM replicas.

    Arrays are read-only int64. Item ids are ``item_ids[position]``.
    """

    send_counts: np.ndarray
    """(S, D): feature rows that encoder replica s sends to LLM replica d."""
    send_order: tuple[np.ndarray, ...]
    """Per src: the item ids it sends, grouped by dst (see the module docstring)."""
    recv_order: tuple[np.ndarray, ...]
    """Per dst: the item ids it receives, in position order."""
    item_ids: np.ndarray
    """(N,): item id of each position."""
    src_replica: np.ndarray
    """(N,): encoder replica of each position."""
    dst_replica: np.ndarray
    """(N,): LLM replica of each position."""
    rows: np.ndarray
    """(N,): feature rows of each position."""
    pair_offsets: np.ndarray
    """(S * D + 1,): CSR offsets of the (s, d) pairs (src-major) into ``pair_positions``."""
    pair_positions: np.ndarray
    """(N,): positions of the pairs' items; src-major, ascending within a pair."""

    @property
    def num_src(self) -> int:
        return int(self.send_counts.shape[0])

    @property
    def num_dst(self) -> int:
        return int(self.send_counts.shape[1])

    @property
    def num_items(self) -> int:
        return int(self.item_ids.shape[0])

    @property
    def recv_counts(self) -> np.ndarray:
        """(D, S): feature rows that LLM replica d receives from encoder replica s."""
        return self.send_counts.T

    def pair_items(self, src: int, dst: int) -> np.ndarray:
        """Item ids that go from encoder replica ``src`` to LLM replica ``dst``."""
        if not (0 <= src < self.num_src and 0 <= dst < self.num_dst):
            raise ValueError(
                f"(src, dst)=({src}, {dst}) is out of range ({self.num_src}, {self.num_dst})"
            )
        pair = src * self.num_dst + dst
        return self.item_ids[
            self.pair_positions[self.pair_offsets[pair] : self.pair_offsets[pair + 1]]
        ]

    def rows_of(self, item_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Feature rows of the given item ids."""
        return self.rows[self.positions_of(item_ids)]

    def positions_of(self, item_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Positions of the given item ids (KeyError naming the first unknown id)."""
        index = self.__dict__.get("_position_index")
        if index is None:
            index = {int(s): p for p, s in enumerate(self.item_ids)}
            object.__setattr__(self, "_position_index", index)
        try:
            return np.fromiter((index[int(s)] for s in item_ids), dtype=np.int64)
        except KeyError as error:
            raise KeyError(f"item id {error.args[0]} is not in this microbatch's plan") from None

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
    item_ids: Any = None,
) -> RoutingPlan:
    """Routing plan of one microbatch's items (computed in the C++ core).

    Args:
        src_replica: (N,) encoder DP replica that encodes each item (a piece of
            :func:`split_units` in the runtime).
        dst_replica: (N,) LLM DP replica that consumes each item.
        rows: (N,) feature rows of each item (an item with 0 rows is still routed).
        num_src, num_dst: replica counts (encoder DP, LLM DP). Default: largest index + 1.
            Pass them when a replica may get nothing, so the plan has its full shape.
        item_ids: (N,) distinct ids of the items; default ``arange(N)``. Orders and the
            communicator's dicts use these ids.

    Raises:
        ValueError: a replica out of range or negative rows (naming the argument and
            index), lengths that differ, or duplicate item ids.
    """
    src = _int_array("src_replica", src_replica)
    dst = _int_array("dst_replica", dst_replica)
    row_array = _int_array("rows", rows)
    n = src.shape[0]
    if item_ids is None:
        ids = np.arange(n, dtype=np.int64)
    else:
        ids = _int_array("item_ids", item_ids)
        if ids.shape[0] != n:
            raise ValueError(f"item_ids has length {ids.shape[0]}, expected {n}")
        if np.unique(ids).shape[0] != n:
            raise ValueError("item_ids must be distinct")
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
        item_ids=_frozen(ids.copy()),
        src_replica=_frozen(src.copy()),
        dst_replica=_frozen(dst.copy()),
        rows=_frozen(row_array.copy()),
        pair_offsets=_frozen(raw["pair_offsets"]),
        pair_positions=_frozen(raw["pair_samples"]),
    )


@dataclass(frozen=True, eq=False)
class UnitSplit:
    """One microbatch's visual units split over the encoder's DP replicas.

    Piece p is units ``[first_unit[p], first_unit[p] + num_units[p])`` of sample
    ``sample_ids[p]``, computed by encoder replica ``replica[p]``; pieces are ordered by
    (sample position, first unit), so a sample's pieces are adjacent and in unit order.
    Samples without units have no piece. Arrays are read-only.
    """

    sample_ids: np.ndarray
    """(P,) int64: the sample of each piece."""
    first_unit: np.ndarray
    """(P,) int64: the piece's first unit within its sample."""
    num_units: np.ndarray
    """(P,) int64: units in the piece."""
    replica: np.ndarray
    """(P,) int64: the encoder DP replica that computes the piece."""
    replica_cost: np.ndarray
    """(R,) float64: encoder cost per replica (sum of its pieces' shares of their samples'
    costs)."""
    replica_units: np.ndarray
    """(R,) int64: units per replica."""
    makespan: float
    """The largest replica cost: the microbatch's encoder time is its slowest replica's."""

    @property
    def num_replicas(self) -> int:
        return int(self.replica_cost.shape[0])

    @property
    def num_pieces(self) -> int:
        return int(self.sample_ids.shape[0])

    def pieces_of(self, replica: int) -> np.ndarray:
        """Positions of the pieces that ``replica`` computes, in piece order."""
        return np.flatnonzero(self.replica == replica)


def split_units(
    units: Any,
    costs: Any,
    num_replicas: int,
    *,
    sample_ids: Any = None,
    granularity: str = "unit",
) -> UnitSplit:
    """Split one microbatch's visual units over ``num_replicas`` encoder DP replicas,
    balancing their encoder cost (the C++ core's ``split_units``; the header
    ``cpp/include/dflop/encoder_split.hpp`` describes the algorithm). Deterministic.

    Args:
        units: (n,) visual units of each sample of the microbatch (0: text-only).
        costs: (n,) encoder cost of each sample (all of its units); every unit of a
            sample costs ``costs[i] / units[i]``. Must be 0 where ``units`` is 0.
        num_replicas: the encoder's DP size.
        sample_ids: (n,) ids reported in :attr:`UnitSplit.sample_ids` (default: positions).
        granularity: ``"unit"`` (the runtime's) or ``"sample"`` (whole samples, LPT +
            local search: an ablation).

    Raises:
        ValueError: naming the argument and the first offending index (negative units,
            a negative or non-finite cost, a cost for a sample without units), or
            lengths that differ.
    """
    unit_array = _int_array("units", units)
    cost_array = np.ascontiguousarray(np.asarray(costs, dtype=np.float64))
    if cost_array.ndim != 1 or cost_array.shape[0] != unit_array.shape[0]:
        raise ValueError(
            f"costs must be 1-D with one entry per sample ({unit_array.shape[0]}), "
            f"got shape {cost_array.shape}"
        )
    num_replicas = _count("num_replicas", num_replicas)
    ids = np.arange(unit_array.shape[0], dtype=np.int64)
    if sample_ids is not None:
        ids = _int_array("sample_ids", sample_ids)
        if ids.shape[0] != unit_array.shape[0]:
            raise ValueError(
                f"sample_ids has length {ids.shape[0]}, expected {unit_array.shape[0]}"
            )
    raw = _core.split_units(unit_array, cost_array, num_replicas, granularity)
    return UnitSplit(
        sample_ids=_frozen(ids[raw["sample"]]),
        first_unit=_frozen(raw["first_unit"]),
        num_units=_frozen(raw["num_units"]),
        replica=_frozen(raw["replica"]),
        replica_cost=_frozen(raw["replica_cost"]),
        replica_units=_frozen(raw["replica_units"]),
        makespan=float(raw["makespan"]),
    )
