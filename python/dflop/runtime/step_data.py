"""Every shape of one training step, derived identically on every rank.

:meth:`StepPlan.build` turns the step's :class:`~dflop.scheduling.balance.Schedule`, the global
batch's :class:`~dflop.data.SampleShapes`, the encoder costs and the
:class:`RuntimeLayout` into, per microbatch: the samples of each LLM DP replica (the
Schedule's bins), the split of the microbatch's visual units across encoder DP replicas
(:func:`~dflop.runtime.routing.split_units`: pieces, contiguous unit ranges of a sample),
the routing plan of the pieces between the replicas, and the size of every message (pixel
units, feature rows, packed tokens, ``cu_seqlens``). It is a pure function of its inputs
(the split and the routing plan are deterministic C++), so all ranks build the same plan
and no rank ever needs a shape handshake.

Order conventions (shared with :mod:`dflop.runtime.routing`):

- A microbatch's *pieces* are ordered by (sample id, first unit); routing item ids are
  piece positions in that order.
- An LLM replica packs its samples in ascending sample id (``Schedule.bin`` order) and
  receives its pieces in piece order, i.e. every sample's unit features in unit order,
  samples ascending: exactly its placeholders' order. Per-sample operations that span a
  sample's units therefore run on the LLM replica's first stage, where the whole sample
  has arrived.
- An encoder replica encodes its pieces in the routing plan's send order (grouped by
  destination LLM replica, piece order within a group), so the features bound for each
  LLM replica are one contiguous slice of its output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dflop.data.shapes import SampleShapes
from dflop.runtime.routing import RoutingPlan, UnitSplit, plan_routing, split_units
from dflop.runtime.topology import RuntimeLayout
from dflop.scheduling.balance import Schedule

__all__ = ["EncoderShare", "LLMShare", "MicrobatchPlan", "StepPlan"]


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array, dtype=np.int64)
    array.setflags(write=False)
    return array


@dataclass(frozen=True)
class EncoderShare:
    """What one encoder DP replica computes of one microbatch: its pieces."""

    piece_ids: np.ndarray
    """Positions of its pieces in the microbatch's piece order, in encoding (= routing
    send) order."""
    sample_ids: np.ndarray
    """The sample of each of its pieces (aligned with ``piece_ids``)."""
    first_unit: np.ndarray
    """First unit of each piece within its sample."""
    num_units: np.ndarray
    """Units of each piece."""
    units: int
    """Visual units: pixels ``[units, C, H, W]``; stage-to-stage activations
    ``[units, tokens_per_unit, vision hidden]`` (fixed tokens per unit)."""
    feature_rows: int
    """Rows of projected features sent over the bridge: ``units * tokens_per_unit``, or
    the pieces' encoder tokens divided by the model's token merge."""
    tokens: int = 0
    """Encoder tokens of the pieces (``sum(units x tokens per unit of the sample)``); with
    variable tokens per unit, the pixels are ``[tokens, patch values]`` (one row per
    patch) and the stage-to-stage activations ``[tokens, vision hidden]``."""

    @property
    def is_empty(self) -> bool:
        return self.units == 0


@dataclass(frozen=True)
class LLMShare:
    """What one LLM DP replica computes of one microbatch (a Schedule bin)."""

    sample_ids: np.ndarray
    """Global sample indices, ascending (``Schedule.bin`` order): the packing order."""
    cu_seqlens: np.ndarray
    """(n + 1,) int64: cumulative sequence lengths of the packed samples."""
    visual_rows: int
    """Feature rows received over the bridge."""
    sample_visual_rows: np.ndarray
    """Feature rows of each of its samples (aligned with ``sample_ids``; 0 for text-only):
    where one sample's features end and the next one's begin, for per-sample operations
    (``image_newline``)."""
    target_tokens: int
    """Target tokens of these samples (loss terms)."""

    @property
    def tokens(self) -> int:
        """Packed positions T: stage-to-stage activations are ``[T, hidden]``."""
        return int(self.cu_seqlens[-1])

    @property
    def is_empty(self) -> bool:
        return self.tokens == 0


@dataclass(frozen=True)
class MicrobatchPlan:
    """Microbatch ``index`` across all replicas of both modules."""

    index: int
    visual_sample_ids: np.ndarray
    """Global indices of the microbatch's samples with visual units, ascending."""
    visual_rows: np.ndarray
    """Feature rows of each visual sample (aligned with ``visual_sample_ids``)."""
    split: UnitSplit
    """The encoder split: pieces (unit ranges of samples) and the replica of each."""
    piece_llm_replica: np.ndarray
    """LLM DP replica of each piece (the one the Schedule gave its sample)."""
    routing: RoutingPlan
    """Routing of the pieces (item id = piece position)."""
    encoder: tuple[EncoderShare, ...]
    """One per encoder DP replica."""
    llm: tuple[LLMShare, ...]
    """One per LLM DP replica."""

    @property
    def is_text_only(self) -> bool:
        return self.visual_sample_ids.size == 0


@dataclass(frozen=True)
class StepPlan:
    """All microbatches of one step plus the global loss normaliser."""

    microbatches: tuple[MicrobatchPlan, ...]
    num_target_tokens: int
    """Target tokens of the whole global batch: every rank divides its loss sums by it,
    so the gradients summed over microbatches and DP replicas are those of the mean loss."""
    tokens_per_unit: int | None
    """The model's fixed encoder tokens per unit, or None: every unit its own
    (``unit_tokens`` of :meth:`build`: a patch-sequence encoder's units differ in size)."""
    visual_newline: bool | None = False
    """The LLM's first stage appends the model's ``image_newline`` row after each visual
    sample's features (``DecoderConfig.image_newline``); None for a model that counts its
    visual tokens by its own per-sample rule (``ModelSpec.visual_newline``)."""
    token_merge: int = 1
    """Encoder tokens per feature row sent over the bridge (Qwen-VL's 2 x 2 merger: 4)."""

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @classmethod
    def build(
        cls,
        schedule: Schedule,
        shapes: SampleShapes,
        layout: RuntimeLayout,
        target_tokens: np.ndarray,
        *,
        tokens_per_unit: int | None,
        visual_newline: bool | None = False,
        encoder_costs: np.ndarray | None = None,
        unit_tokens: Sequence[Sequence[int]] | None = None,
        token_merge: int = 1,
    ) -> StepPlan:
        """The plan of one step.

        Args:
            schedule: the step's Schedule over the LLM's DP replicas (``dp_size`` = LLM dp,
                ``num_microbatches`` = the pipeline's microbatches).
            shapes: the global batch, conformed to the model (``llm_visual_tokens ==
                encoder_units * tokens_per_unit``, plus 1 per visual sample with
                ``visual_newline``; ``ShapeScaler.for_model`` does it).
            layout: the runtime layout (encoder and LLM parallel sizes).
            target_tokens: (N,) target tokens of every sample (e.g.
                ``SyntheticBatch.target_tokens()``).
            tokens_per_unit: the model's encoder tokens per visual unit, or None: every
                unit's own, from ``unit_tokens`` (a patch-sequence encoder such as
                Qwen-VL's, whose units are images / frame pairs of any size; its pixels
                are one row per token).
            visual_newline: the model's ``DecoderConfig.image_newline`` (its spec's
                ``visual_newline``); None: the model has its own per-sample rule for
                ``llm_visual_tokens`` (e.g. LLaVA-OneVision's unpadding), which its LLM
                stage checks, so the shapes are not checked against units here.
            encoder_costs: (N,) encoder cost of each sample, which the split balances
                over the encoder replicas (the cost model's, as the planner uses);
                default: its encoder tokens. Every rank must pass the same values.
            unit_tokens: with ``tokens_per_unit=None``: per sample, the encoder tokens of
                each of its units (``encoder_units[i]`` entries).
            token_merge: encoder tokens per feature row over the bridge (>= 1, dividing
                every unit's tokens).
        """
        _check_inputs(schedule, shapes, layout, target_tokens, tokens_per_unit, visual_newline)
        units = shapes.encoder_units.astype(np.int64)
        offsets = _unit_offsets(shapes, tokens_per_unit, unit_tokens, token_merge)
        if encoder_costs is None:
            costs = np.array([o[-1] for o in offsets], dtype=np.float64)
        else:
            costs = np.asarray(encoder_costs, dtype=np.float64)
            if costs.shape != (len(shapes),):
                raise ValueError(
                    f"encoder_costs has shape {costs.shape}, expected ({len(shapes)},): one "
                    "per sample of the global batch"
                )
        seq_lens = shapes.seq_len.astype(np.int64)
        targets = np.asarray(target_tokens, dtype=np.int64)
        microbatches = tuple(
            _microbatch_plan(
                j, schedule, layout, units, offsets, token_merge, seq_lens, targets, costs
            )
            for j in range(schedule.num_microbatches)
        )
        newline = None if visual_newline is None else bool(visual_newline)
        fixed = None if tokens_per_unit is None else int(tokens_per_unit)
        return cls(microbatches, int(targets.sum()), fixed, newline, int(token_merge))


def _unit_offsets(
    shapes: SampleShapes,
    tokens_per_unit: int | None,
    unit_tokens: Sequence[Sequence[int]] | None,
    merge: int,
) -> list[np.ndarray]:
    """Per sample, the encoder-token offset of each unit boundary (``units + 1`` entries
    from 0): a piece of units ``[f, f + n)`` has ``o[f + n] - o[f]`` tokens."""
    if isinstance(merge, bool) or not isinstance(merge, (int, np.integer)) or merge < 1:
        raise ValueError(f"token_merge={merge!r} must be an integer >= 1")
    units = shapes.encoder_units.astype(np.int64)
    if tokens_per_unit is not None:
        if unit_tokens is not None:
            raise ValueError("unit_tokens is for tokens_per_unit=None: give one of them")
        if tokens_per_unit % merge:
            raise ValueError(f"tokens_per_unit={tokens_per_unit} must be a multiple of {merge=}")
        return [np.arange(u + 1, dtype=np.int64) * int(tokens_per_unit) for u in units]
    if unit_tokens is None or len(unit_tokens) != len(shapes):
        raise ValueError(
            "tokens_per_unit=None needs unit_tokens: one list of unit token counts per sample "
            f"({len(shapes)})"
        )
    offsets = []
    for i, (u, tokens) in enumerate(zip(units, unit_tokens)):
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size != u or (tokens < merge).any() or (tokens % merge).any():
            raise ValueError(
                f"sample {i}: unit_tokens {tokens.tolist()} must hold encoder_units={u} "
                f"positive multiples of token_merge={merge}"
            )
        offsets.append(np.concatenate(([0], np.cumsum(tokens))))
    return offsets


def _check_inputs(
    schedule: Schedule,
    shapes: SampleShapes,
    layout: RuntimeLayout,
    target_tokens: np.ndarray,
    tokens_per_unit: int | None,
    visual_newline: bool | None,
) -> None:
    if schedule.num_samples != len(shapes) or len(target_tokens) != len(shapes):
        raise ValueError(
            f"the Schedule covers {schedule.num_samples} samples, shapes {len(shapes)} and "
            f"target_tokens {len(target_tokens)}: they must describe the same global batch"
        )
    if schedule.dp_size != layout.llm.dp:
        raise ValueError(
            f"Schedule.dp_size={schedule.dp_size} must equal the LLM's dp={layout.llm.dp}"
        )
    if schedule.num_microbatches != layout.num_microbatches:
        raise ValueError(
            f"Schedule.num_microbatches={schedule.num_microbatches} must equal "
            f"RuntimeLayout.num_microbatches={layout.num_microbatches}"
        )
    if visual_newline is None:
        return
    if tokens_per_unit is None:
        raise ValueError("visual_newline must be None with per-sample tokens per unit")
    units = shapes.encoder_units.astype(np.int64)
    expected = units * tokens_per_unit + (units > 0) * int(visual_newline)
    bad = np.flatnonzero(shapes.llm_visual_tokens != expected)
    if bad.size:
        i = int(bad[0])
        newline = " + 1 newline" if visual_newline and units[i] else ""
        raise ValueError(
            f"sample {i}: llm_visual_tokens={shapes.llm_visual_tokens[i]} != encoder_units "
            f"{units[i]} x tokens_per_unit {tokens_per_unit}{newline}: conform the shapes "
            "to the model (ShapeScaler.for_model) before planning the step"
        )


def _microbatch_plan(
    j: int,
    schedule: Schedule,
    layout: RuntimeLayout,
    units: np.ndarray,
    offsets: list[np.ndarray],
    token_merge: int,
    seq_lens: np.ndarray,
    targets: np.ndarray,
    encoder_costs: np.ndarray,
) -> MicrobatchPlan:
    rows = np.array([o[-1] for o in offsets], dtype=np.int64) // token_merge
    llm_bins = schedule.microbatches  # bins of replica r: llm_bins(r)[j]
    llm = tuple(
        _llm_share(np.asarray(llm_bins(r)[j]), rows, seq_lens, targets)
        for r in range(layout.llm.dp)
    )
    # The microbatch's visual samples, ascending, with the LLM replica that consumes each.
    members = np.concatenate([share.sample_ids for share in llm])
    owner = np.concatenate(
        [np.full(share.sample_ids.size, r, dtype=np.int64) for r, share in enumerate(llm)]
    )
    order = np.argsort(members, kind="stable")
    members, owner = members[order], owner[order]
    visual = units[members] > 0
    visual_ids, llm_replica = members[visual], owner[visual]
    if layout.colocated:  # each replica encodes its own samples, whole
        split = _own_samples(visual_ids, llm_replica, units, encoder_costs, layout.llm.dp)
    else:
        split = split_units(
            units[visual_ids], encoder_costs[visual_ids], layout.encoder.dp, sample_ids=visual_ids
        )
    piece_llm_replica = llm_replica[np.searchsorted(visual_ids, split.sample_ids)]
    piece_tokens = np.array(
        [
            offsets[i][f + n] - offsets[i][f]
            for i, f, n in zip(split.sample_ids, split.first_unit, split.num_units)
        ],
        dtype=np.int64,
    )
    routing = plan_routing(
        split.replica,
        piece_llm_replica,
        piece_tokens // token_merge,
        num_src=layout.encoder.dp,
        num_dst=layout.llm.dp,
    )
    encoder = tuple(
        _encoder_share(np.asarray(routing.send_order[e]), split, piece_tokens, token_merge)
        for e in range(layout.encoder.dp)
    )
    return MicrobatchPlan(
        index=j,
        visual_sample_ids=_frozen(visual_ids),
        visual_rows=_frozen(rows[visual_ids]),
        split=split,
        piece_llm_replica=_frozen(piece_llm_replica),
        routing=routing,
        encoder=encoder,
        llm=llm,
    )


def _own_samples(
    sample_ids: np.ndarray,
    replica: np.ndarray,
    units: np.ndarray,
    costs: np.ndarray,
    num_replicas: int,
) -> UnitSplit:
    """A colocated layout's "split": every visual sample one piece, on the replica whose
    LLM computes it (pieces in sample order, as :func:`split_units` gives them)."""
    num_units = units[sample_ids]
    replica_cost = np.bincount(replica, weights=costs[sample_ids], minlength=num_replicas)
    replica_cost.setflags(write=False)
    replica_units = np.bincount(replica, weights=num_units, minlength=num_replicas)
    return UnitSplit(
        sample_ids=_frozen(sample_ids),
        first_unit=_frozen(np.zeros_like(sample_ids)),
        num_units=_frozen(num_units),
        replica=_frozen(replica),
        replica_cost=replica_cost,
        replica_units=_frozen(replica_units),
        makespan=float(replica_cost.max(initial=0.0)),
    )


def _encoder_share(
    piece_ids: np.ndarray, split: UnitSplit, piece_tokens: np.ndarray, token_merge: int
) -> EncoderShare:
    num_units = split.num_units[piece_ids]
    tokens = int(piece_tokens[piece_ids].sum())
    return EncoderShare(
        piece_ids=_frozen(piece_ids),
        sample_ids=_frozen(split.sample_ids[piece_ids]),
        first_unit=_frozen(split.first_unit[piece_ids]),
        num_units=_frozen(num_units),
        units=int(num_units.sum()),
        feature_rows=tokens // token_merge,
        tokens=tokens,
    )


def _llm_share(
    sample_ids: np.ndarray, rows: np.ndarray, seq_lens: np.ndarray, targets: np.ndarray
) -> LLMShare:
    cu = np.concatenate(([0], np.cumsum(seq_lens[sample_ids], dtype=np.int64)))
    return LLMShare(
        sample_ids=_frozen(sample_ids),
        cu_seqlens=_frozen(cu),
        visual_rows=int(rows[sample_ids].sum()),
        sample_visual_rows=_frozen(rows[sample_ids]),
        target_tokens=int(targets[sample_ids].sum()),
    )
