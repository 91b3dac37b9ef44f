"""Placement of the encoder and the LLM on disjoint ranks, and their process groups.

Rank layout (world of ``V + L`` ranks; a *colocated* layout, below, has no encoder ranks):

- ranks ``[0, V)`` hold the encoder (vision tower + projector), ``V = encoder.num_gpus``;
- ranks ``[V, V + L)`` hold the LLM, ``L = llm.num_gpus``;
- inside a module whose first rank is ``first``::

      rank = first + (dp_idx * pp + pp_idx) * tp + tp_idx

  Tensor parallelism is innermost so that a TP group is a run of consecutive ranks (on a
  GPU node: one NVLink island); then the pipeline stages of one DP replica; DP outermost.

The pipeline of one training step runs over ``pe + pl`` *global stages*: encoder stages
``0 .. pe - 1`` then LLM stages ``pe .. pe + pl - 1``. Between encoder stage ``pe - 1``
and LLM stage ``pe`` features do not follow a fixed replica-to-replica link: each sample
moves from the encoder replica that computed it to the LLM replica that the Schedule gave
it (see :mod:`dflop.runtime.bridge`).

A colocated layout (``RuntimeLayout.colocated``, Megatron-LM's placement and the
data-blind baseline's) has no encoder ranks: the world is the LLM's ``L`` ranks, the
pipeline its ``pl`` stages, and each rank of the first LLM stage runs the encoder and
projector itself on its own microbatches' images (tensor-parallel over the LLM's TP group;
``RankInfo.holds_encoder``), so no bridge is needed and autograd carries the features'
gradient into the encoder.

:func:`rank_info` is pure (no torch.distributed), so layouts can be checked anywhere;
:meth:`Topology.create` builds the process groups and needs an initialised default group.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dflop._deprecated import warn_renamed
from dflop.errors import InputTypeError, bounded_repr
from dflop.scheduling.actions import pipeline_order_for, pipeline_order_name, pipeline_program

__all__ = [
    "DEFAULT_GROUP_TIMEOUT_S",
    "ModuleLayout",
    "RankInfo",
    "RuntimeLayout",
    "Topology",
    "chunk_infos",
    "rank_info",
    "uniform_layer_ranges",
]

Module = Literal["encoder", "llm"]

DEFAULT_GROUP_TIMEOUT_S = 300.0
"""Timeout of every process group's collectives unless the caller passes one: long enough
for a slow first step on a big model, short enough that a dead peer surfaces as an error."""


def _positive_int(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(
            f"{owner}.{name} must be an integer, got {type(value).__name__} {value!r}"
        )
    if value < 1:
        raise ValueError(f"{owner}.{name} must be >= 1, got {value}")
    return value


def uniform_layer_ranges(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Half-open layer ranges splitting ``num_layers`` over ``num_stages`` as evenly as
    possible; the first ``num_layers % num_stages`` stages get one layer more."""
    _positive_int("uniform_layer_ranges", "num_stages", num_stages)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"num_layers must be an integer >= 0, got {num_layers!r}")
    base, extra = divmod(num_layers, num_stages)
    ranges, first = [], 0
    for stage in range(num_stages):
        end = first + base + (1 if stage < extra else 0)
        ranges.append((first, end))
        first = end
    return tuple(ranges)


@dataclass(frozen=True)
class ModuleLayout:
    """Parallel layout of one module (the encoder or the LLM).

    Attributes:
        tp: tensor-parallel size.
        pp: pipeline-parallel size (stages).
        dp: data-parallel size (replicas).
        layer_ranges: per virtual stage (``pp * virtual_stages`` of them, along the model),
            the half-open ``[first, end)`` range of transformer blocks it holds; contiguous
            from 0 (a stage may be empty, e.g. a last encoder stage holding only the
            projector). Virtual stage ``c * pp + p`` is chunk c of pipeline stage p.
        virtual_stages: model chunks per pipeline stage (1: a plain pipeline; > 1: the
            interleaved 1F1B schedule's virtual stages, LLM only).
        recompute: full activation recompute: each transformer block of the module keeps
            only its input through the forward and runs again in the backward
            (:func:`dflop.runtime.recompute.apply_recompute`), as the planner's ``rc``
            prices it.
    """

    tp: int
    pp: int
    dp: int
    layer_ranges: tuple[tuple[int, int], ...]
    virtual_stages: int = 1
    recompute: bool = False

    def __post_init__(self) -> None:
        owner = "ModuleLayout"
        for name in ("tp", "pp", "dp", "virtual_stages"):
            _positive_int(owner, name, getattr(self, name))
        if not isinstance(self.recompute, bool):
            raise InputTypeError(
                f"{owner}.recompute must be a bool, got {bounded_repr(self.recompute, 40)}"
            )
        try:
            ranges = tuple((int(a), int(b)) for a, b in self.layer_ranges)
        except (TypeError, ValueError):
            raise InputTypeError(
                f"{owner}.layer_ranges must be a sequence of (first, end) integer pairs, "
                f"got {self.layer_ranges!r}"
            ) from None
        object.__setattr__(self, "layer_ranges", ranges)
        if len(ranges) != self.pp * self.virtual_stages:
            raise ValueError(
                f"{owner}.layer_ranges has {len(ranges)} ranges but pp={self.pp} stages x "
                f"virtual_stages={self.virtual_stages} need {self.pp * self.virtual_stages}"
            )
        if self.virtual_stages > 1 and self.pp < 2:
            raise ValueError(
                f"{owner}.virtual_stages={self.virtual_stages} needs pp >= 2 (interleaving "
                "chunks over one stage changes nothing)"
            )
        expected_first = 0
        for stage, (first, end) in enumerate(ranges):
            if first != expected_first or end < first:
                raise ValueError(
                    f"{owner}.layer_ranges[{stage}]=({first}, {end}) must start at "
                    f"{expected_first} and have end >= first (ranges are contiguous from 0)"
                )
            expected_first = end

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_layers(self) -> int:
        return self.layer_ranges[-1][1]

    def local_rank(self, dp_idx: int, pp_idx: int, tp_idx: int) -> int:
        """Rank offset inside the module: ``(dp_idx * pp + pp_idx) * tp + tp_idx``."""
        for name, value, size in (
            ("dp", dp_idx, self.dp),
            ("pp", pp_idx, self.pp),
            ("tp", tp_idx, self.tp),
        ):
            if not 0 <= value < size:
                raise ValueError(f"{name}_idx={value} is out of range [0, {size})")
        return (dp_idx * self.pp + pp_idx) * self.tp + tp_idx

    def stage_layer_ranges(self, pp_idx: int) -> tuple[tuple[int, int], ...]:
        """The layer ranges of pipeline stage ``pp_idx``'s chunks, in model order."""
        return tuple(self.layer_ranges[c * self.pp + pp_idx] for c in range(self.virtual_stages))

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "layer_ranges": [list(r) for r in self.layer_ranges],
            "virtual_stages": self.virtual_stages,
            "recompute": self.recompute,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModuleLayout:
        missing = {"tp", "pp", "dp", "layer_ranges"} - set(data)
        if missing:
            raise ValueError(f"ModuleLayout dict lacks {sorted(missing)}")
        return cls(
            tp=data["tp"],
            pp=data["pp"],
            dp=data["dp"],
            layer_ranges=tuple(tuple(r) for r in data["layer_ranges"]),
            virtual_stages=data.get("virtual_stages", 1),
            recompute=data.get("recompute", False),
        )


@dataclass(frozen=True)
class RuntimeLayout:
    """Where the encoder and the LLM run and how one step is cut into microbatches.

    Attributes:
        encoder: layout of the vision tower + projector on ranks ``[0, V)``.
        llm: layout of the decoder on ranks ``[V, V + L)``.
        num_microbatches: microbatches per LLM DP replica per step (the Schedule's).
        global_batch: samples per step over all LLM DP replicas; the balancer gives every
            bin a sample, so it must be >= ``num_microbatches * llm.dp``.
        order: the pipeline order (a name of :data:`dflop.scheduling.PIPELINE_ORDERS`,
            e.g. ``"zb-h1"``); None: :func:`dflop.scheduling.pipeline_order_for`'s choice.
        colocated: the encoder runs inside the LLM's first stage (no ranks of its own; see
            the module docstring); ``encoder`` must then be ``pp=1`` with the LLM's tp and
            dp (:meth:`colocated_encoder` builds it).
    """

    encoder: ModuleLayout
    llm: ModuleLayout
    num_microbatches: int
    global_batch: int
    order: str | None = None
    colocated: bool = False

    def __post_init__(self) -> None:
        for name in ("encoder", "llm"):
            if not isinstance(getattr(self, name), ModuleLayout):
                raise InputTypeError(f"RuntimeLayout.{name} must be a ModuleLayout")
        _positive_int("RuntimeLayout", "num_microbatches", self.num_microbatches)
        _positive_int("RuntimeLayout", "global_batch", self.global_batch)
        if self.encoder.virtual_stages != 1:
            raise ValueError(
                f"RuntimeLayout.encoder.virtual_stages={self.encoder.virtual_stages}: only "
                "the LLM is interleaved (the encoder's stages hold one chunk each)"
            )
        if not isinstance(self.colocated, bool):
            raise InputTypeError(
                f"RuntimeLayout.colocated must be a bool, got {bounded_repr(self.colocated, 40)}"
            )
        if self.colocated:
            self._check_colocated()
        if self.llm.virtual_stages > 1 and self.num_microbatches % self.llm.pp:
            raise ValueError(
                f"RuntimeLayout.num_microbatches={self.num_microbatches} must be a multiple of "
                f"llm.pp={self.llm.pp} for the interleaved schedule (llm.virtual_stages="
                f"{self.llm.virtual_stages})"
            )
        if self.order is not None:
            try:
                object.__setattr__(self, "order", pipeline_order_name(self.order))
                stages, chunks = self.pipeline_stages
                pipeline_program(self.order, stages, self.num_microbatches, chunks=chunks)
            except ValueError as error:
                raise ValueError(f"RuntimeLayout.order={self.order!r}: {error}") from None
        bins = self.num_microbatches * self.llm.dp
        if self.global_batch < bins:
            raise ValueError(
                f"RuntimeLayout.global_batch={self.global_batch} is smaller than "
                f"num_microbatches * llm.dp = {bins}: every microbatch needs a sample"
            )

    def _check_colocated(self) -> None:
        enc, llm = self.encoder, self.llm
        want = (1, llm.tp, llm.dp)
        if (enc.pp, enc.tp, enc.dp) != want:
            raise ValueError(
                f"RuntimeLayout.encoder (pp={enc.pp}, tp={enc.tp}, dp={enc.dp}) must be pp=1, "
                f"tp={llm.tp}, dp={llm.dp} in a colocated layout: the encoder runs on the "
                "LLM's first stage, over its TP group, in each of its replicas (use "
                "RuntimeLayout.colocated_encoder)"
            )
        if enc.recompute != llm.recompute:
            raise ValueError(
                f"RuntimeLayout.encoder.recompute={enc.recompute} must equal "
                f"llm.recompute={llm.recompute} in a colocated layout: the planner prices the "
                "colocated encoder's activations with its stage's (use "
                "RuntimeLayout.colocated_encoder)"
            )
        if llm.virtual_stages > 1:
            raise ValueError(
                f"RuntimeLayout.llm.virtual_stages={llm.virtual_stages}: a colocated layout "
                "runs plain (non-interleaved) LLM stages, as the planner scores it"
            )

    @staticmethod
    def colocated_encoder(encoder_layers: int, llm: ModuleLayout) -> ModuleLayout:
        """The encoder's layout in a colocated layout with ``llm``: every layer on one
        stage, the LLM's tp, dp and recompute (the planner prices the colocated encoder's
        activations with the LLM's)."""
        return ModuleLayout(llm.tp, 1, llm.dp, ((0, encoder_layers),), recompute=llm.recompute)

    @property
    def world_size(self) -> int:
        if self.colocated:
            return self.llm.num_gpus
        return self.encoder.num_gpus + self.llm.num_gpus

    @property
    def num_global_stages(self) -> int:
        """Physical pipeline stages of one replica: encoder stages + LLM stages (the LLM's
        alone in a colocated layout)."""
        return self.llm.pp + (0 if self.colocated else self.encoder.pp)

    @property
    def encoder_stages(self) -> int:
        """Pipeline stages of the encoder's own (0 in a colocated layout)."""
        return 0 if self.colocated else self.encoder.pp

    @property
    def pipeline_stages(self) -> tuple[list[int], list[int]]:
        """``(stages, chunks)`` of the pipeline's segments (encoder, LLM; the LLM alone in
        a colocated layout), as :func:`dflop.scheduling.pipeline_program` takes them."""
        if self.colocated:
            return [self.llm.pp], [self.llm.virtual_stages]
        return [self.encoder.pp, self.llm.pp], [1, self.llm.virtual_stages]

    @property
    def pipeline_order(self) -> str:
        """The pipeline order this layout runs: :attr:`order`, or
        :func:`dflop.scheduling.pipeline_order_for` (``"interleaved-1f1b"`` for an LLM with
        virtual stages, else ``"1f1b"``)."""
        return self.order or pipeline_order_for(self)

    @property
    def default_schedule(self) -> str:
        """Deprecated name of :attr:`pipeline_order`."""
        warn_renamed("RuntimeLayout.default_schedule", "RuntimeLayout.pipeline_order")
        return self.pipeline_order

    def module(self, name: Module) -> ModuleLayout:
        if name not in ("encoder", "llm"):
            raise ValueError(f"module must be 'encoder' or 'llm', got {name!r}")
        return self.encoder if name == "encoder" else self.llm

    def first_rank(self, name: Module) -> int:
        """Global rank of the module's ``(dp, pp, tp) = (0, 0, 0)`` (a colocated encoder's
        is the LLM's: its ranks are the LLM's first stage's)."""
        self.module(name)  # validates the name
        return 0 if name == "encoder" or self.colocated else self.encoder.num_gpus

    def rank_of(self, name: Module, dp_idx: int, pp_idx: int, tp_idx: int = 0) -> int:
        """Global rank of a module's ``(dp_idx, pp_idx, tp_idx)`` (a colocated encoder's
        is its LLM replica's first-stage rank)."""
        local = self.module(name).local_rank(dp_idx, pp_idx, tp_idx)  # validates
        if self.colocated and name == "encoder":
            return self.rank_of("llm", dp_idx, 0, tp_idx)
        return self.first_rank(name) + local

    def encoder_bridge_rank(self, dp_idx: int) -> int:
        """The rank sending encoder replica ``dp_idx``'s features: its last stage, tp 0."""
        return self.rank_of("encoder", dp_idx, self.encoder.pp - 1, 0)

    def llm_bridge_rank(self, dp_idx: int) -> int:
        """The rank receiving LLM replica ``dp_idx``'s features: its first stage, tp 0."""
        return self.rank_of("llm", dp_idx, 0, 0)

    @property
    def bridge_ranks(self) -> tuple[int, ...]:
        """Encoder bridge ranks (replica order), then LLM bridge ranks (replica order);
        none in a colocated layout."""
        if self.colocated:
            return ()
        return tuple(self.encoder_bridge_rank(d) for d in range(self.encoder.dp)) + tuple(
            self.llm_bridge_rank(d) for d in range(self.llm.dp)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "encoder": self.encoder.to_dict(),
            "llm": self.llm.to_dict(),
            "num_microbatches": self.num_microbatches,
            "global_batch": self.global_batch,
            "order": self.order,
            "colocated": self.colocated,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RuntimeLayout:
        missing = {"encoder", "llm", "num_microbatches", "global_batch"} - set(data)
        if missing:
            raise ValueError(f"RuntimeLayout dict lacks {sorted(missing)}")
        return cls(
            encoder=ModuleLayout.from_dict(data["encoder"]),
            llm=ModuleLayout.from_dict(data["llm"]),
            num_microbatches=data["num_microbatches"],
            global_batch=data["global_batch"],
            order=data.get("order"),
            colocated=data.get("colocated", False),
        )

    @classmethod
    def simple(
        cls,
        encoder_dp: int = 1,
        encoder_pp: int = 1,
        llm_dp: int = 1,
        llm_pp: int = 1,
        *,
        encoder_layers: int,
        llm_layers: int,
        num_microbatches: int,
        global_batch: int,
        encoder_tp: int = 1,
        llm_tp: int = 1,
        llm_virtual_stages: int = 1,
        order: str | None = None,
        colocated: bool = False,
        encoder_recompute: bool = False,
        llm_recompute: bool = False,
    ) -> RuntimeLayout:
        """A layout with uniform layer splits (:func:`uniform_layer_ranges`); with
        ``colocated`` the encoder's sizes are ignored (:meth:`colocated_encoder`)."""
        llm = ModuleLayout(
            llm_tp,
            llm_pp,
            llm_dp,
            uniform_layer_ranges(llm_layers, llm_pp * llm_virtual_stages),
            llm_virtual_stages,
            recompute=llm_recompute,
        )
        encoder = (
            cls.colocated_encoder(encoder_layers, llm)
            if colocated
            else ModuleLayout(
                encoder_tp,
                encoder_pp,
                encoder_dp,
                uniform_layer_ranges(encoder_layers, encoder_pp),
                recompute=encoder_recompute,
            )
        )
        return cls(
            encoder=encoder,
            llm=llm,
            num_microbatches=num_microbatches,
            global_batch=global_batch,
            order=order,
            colocated=colocated,
        )


@dataclass(frozen=True)
class RankInfo:
    """Everything a rank needs to know about its place in the layout.

    ``prev_rank`` / ``next_rank`` are the neighbouring pipeline stages of the same module,
    DP replica and TP index (None at the module's first / last stage: the encoder-to-LLM
    hop goes through the bridge instead). With virtual stages (interleaved LLM) a rank holds
    several chunks: :func:`rank_info` describes the rank (its stage; ``layer_range`` its
    first chunk's) and :func:`chunk_infos` each chunk, whose neighbours wrap from the last
    stage to the first for the next chunk (``virtual_stage``, ``chunk``, ``layer_range``,
    ``prev_rank``, ``next_rank`` and the first / last flags are then the chunk's).
    ``is_bridge_sender`` is true on the last encoder stage's tp-rank-0 ranks and
    ``is_bridge_receiver`` on the first LLM stage's tp-rank-0 ranks: exactly the members of
    the bridge group (with tp > 1 the other TP ranks of those stages get or give the
    features through their TP group).
    """

    rank: int
    module: Module
    tp_rank: int
    pp_rank: int
    dp_rank: int
    global_stage: int
    num_global_stages: int
    prev_rank: int | None
    next_rank: int | None
    layer_range: tuple[int, int]
    is_bridge_sender: bool
    is_bridge_receiver: bool
    virtual_stage: int = -1
    """The (first) chunk's virtual stage along the whole pipeline (encoder stages first);
    equal to ``global_stage`` without virtual stages."""
    chunk: int = 0
    """Which of the rank's chunks this describes (0 for :func:`rank_info`)."""
    num_chunks: int = 1
    """Chunks per stage of the rank's module (its ``virtual_stages``)."""
    prev_chunk: int = 0
    """The chunk index, on ``prev_rank``, of the previous virtual stage (``chunk - 1``
    across the interleaved wrap-around, else ``chunk``)."""
    next_chunk: int = 0
    """The chunk index, on ``next_rank``, of the next virtual stage."""
    holds_encoder: bool = False
    """A colocated layout's first LLM stage: the rank runs the encoder and projector on
    its microbatches' images itself (no bridge)."""

    @property
    def is_first_stage(self) -> bool:
        """First stage of its module."""
        return self.prev_rank is None

    @property
    def is_last_stage(self) -> bool:
        """Last stage of its module."""
        return self.next_rank is None


def rank_info(layout: RuntimeLayout, rank: int) -> RankInfo:
    """The place of ``rank`` in ``layout`` (pure: no torch.distributed)."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise InputTypeError(f"rank must be an integer, got {rank!r}")
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank={rank} is out of range [0, {layout.world_size})")
    name: Module = "llm" if layout.colocated or rank >= layout.encoder.num_gpus else "encoder"
    mod = layout.module(name)
    offset = rank - layout.first_rank(name)
    tp_idx = offset % mod.tp
    pp_idx = (offset // mod.tp) % mod.pp
    dp_idx = offset // (mod.tp * mod.pp)
    stage_base = 0 if name == "encoder" else layout.encoder_stages
    layer_ranges = mod.stage_layer_ranges(pp_idx)
    return RankInfo(
        rank=rank,
        module=name,
        tp_rank=tp_idx,
        pp_rank=pp_idx,
        dp_rank=dp_idx,
        global_stage=stage_base + pp_idx,
        num_global_stages=layout.num_global_stages,
        prev_rank=rank - mod.tp if pp_idx > 0 else None,
        next_rank=rank + mod.tp if pp_idx < mod.pp - 1 else None,
        layer_range=layer_ranges[0],
        is_bridge_sender=name == "encoder" and pp_idx == mod.pp - 1 and tp_idx == 0,
        is_bridge_receiver=name == "llm" and pp_idx == 0 and tp_idx == 0 and not layout.colocated,
        virtual_stage=stage_base + pp_idx,
        num_chunks=mod.virtual_stages,
        holds_encoder=layout.colocated and pp_idx == 0,
    )


def chunk_infos(layout: RuntimeLayout, rank: int) -> tuple[RankInfo, ...]:
    """One :class:`RankInfo` per model chunk ``rank`` holds (one without virtual stages:
    :func:`rank_info`'s). Chunk c of stage p of a module with P stages is virtual stage
    ``c * P + p`` of the module; its previous chunk is on stage p - 1, or, for p = 0, on
    stage P - 1 (chunk c - 1): the wrap-around of the interleaved schedule."""
    info = rank_info(layout, rank)
    mod = layout.module(info.module)
    if mod.virtual_stages == 1:
        return (info,)
    stage_base = 0 if info.module == "encoder" else layout.encoder_stages
    last = mod.pp - 1
    out = []
    for c, layer_range in enumerate(mod.stage_layer_ranges(info.pp_rank)):
        prev_rank, next_rank = info.prev_rank, info.next_rank
        prev_chunk = next_chunk = c
        if info.pp_rank == 0 and c > 0:
            prev_rank = layout.rank_of(info.module, info.dp_rank, last, info.tp_rank)
            prev_chunk = c - 1
        if info.pp_rank == last and c < mod.virtual_stages - 1:
            next_rank = layout.rank_of(info.module, info.dp_rank, 0, info.tp_rank)
            next_chunk = c + 1
        out.append(
            dataclasses.replace(
                info,
                prev_rank=prev_rank,
                next_rank=next_rank,
                prev_chunk=prev_chunk,
                next_chunk=next_chunk,
                layer_range=layer_range,
                virtual_stage=stage_base + c * mod.pp + info.pp_rank,
                chunk=c,
            )
        )
    return tuple(out)


def _module_groups(layout: RuntimeLayout, name: Module) -> tuple[list[list[int]], list[list[int]]]:
    """(DP groups, TP groups) of a module as lists of global ranks, in a fixed order."""
    mod = layout.module(name)
    dp_groups = [
        [layout.rank_of(name, d, p, t) for d in range(mod.dp)]
        for p in range(mod.pp)
        for t in range(mod.tp)
    ]
    tp_groups = [
        [layout.rank_of(name, d, p, t) for t in range(mod.tp)]
        for d in range(mod.dp)
        for p in range(mod.pp)
    ]
    return dp_groups, tp_groups


@dataclass(frozen=True, eq=False)
class Topology:
    """A rank's :class:`RankInfo` plus its process groups.

    Attributes:
        layout: the runtime layout.
        info: this rank's place in it.
        dp_group: the ranks of the same module, stage and TP index over its DP replicas
            (gradient all-reduce).
        tp_group: the ranks of the same module, replica and stage (tensor parallelism).
        bridge_group: the bridge ranks (``layout.bridge_ranks``) if this rank is one of
            them, else None. The communicator's point-to-point transfers run on it.
        dp_ranks, tp_ranks: the global ranks of this rank's DP and TP groups.
        bridge_ranks: all bridge ranks (the same on every rank).
        timeout_s: the groups' collective timeout.
        embedding_group: on the first and last LLM stage of a pipeline of >= 2 stages,
            the group of those two ranks (same replica and TP index): a model whose
            head is tied to its token embedding sums the two copies' gradients over it.
            None elsewhere.
    """

    layout: RuntimeLayout
    info: RankInfo
    dp_group: Any
    tp_group: Any
    bridge_group: Any
    dp_ranks: tuple[int, ...]
    tp_ranks: tuple[int, ...]
    bridge_ranks: tuple[int, ...]
    timeout_s: float
    embedding_group: Any = None

    @property
    def rank(self) -> int:
        return self.info.rank

    @classmethod
    def create(
        cls, layout: RuntimeLayout, rank: int | None = None, *, timeout_s: float | None = None
    ) -> Topology:
        """Create all process groups of ``layout``; call it on EVERY rank, same arguments.

        torch.distributed requires every rank to call ``new_group`` for every group, in the
        same order, even for groups it is not a member of, so this creates them all in a
        fixed order (encoder DP groups, encoder TP groups, LLM DP groups, LLM TP groups, the
        bridge group, the LLM's embedding groups) and keeps this rank's. ``rank`` defaults to the default group's rank
        and must equal it; the world size must equal ``layout.world_size``.
        """
        from dflop.runtime import dist

        if not dist.is_initialized():
            raise RuntimeError("Topology.create needs torch.distributed to be initialised first")
        world = dist.get_world_size()
        if world != layout.world_size:
            needs = (
                f"LLM {layout.llm.num_gpus}, the encoder colocated"
                if layout.colocated
                else f"encoder {layout.encoder.num_gpus} + LLM {layout.llm.num_gpus}"
            )
            raise ValueError(
                f"the layout needs {layout.world_size} ranks ({needs}) but the world has {world}"
            )
        if rank is None:
            rank = dist.get_rank()
        elif rank != dist.get_rank():
            raise ValueError(f"rank={rank} differs from torch.distributed's rank {dist.get_rank()}")
        info = rank_info(layout, rank)
        timeout_s = DEFAULT_GROUP_TIMEOUT_S if timeout_s is None else float(timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)

        mine: dict[str, tuple[Any, tuple[int, ...]]] = {}

        def create_all(kind: str, groups: Sequence[list[int]]) -> None:
            for ranks in groups:
                group = dist.new_group(ranks=ranks, timeout=timeout)
                if rank in ranks:
                    mine[kind] = (group, tuple(ranks))

        # A colocated encoder's parameters live in the first LLM stage's module: the LLM's
        # groups are its groups.
        for name in ("llm",) if layout.colocated else ("encoder", "llm"):
            dp_groups, tp_groups = _module_groups(layout, name)
            create_all("dp", dp_groups)
            create_all("tp", tp_groups)
        bridge = list(layout.bridge_ranks)
        create_all("bridge", [bridge] if bridge else [])
        bridge_group = mine["bridge"][0] if "bridge" in mine else None
        create_all("embedding", _embedding_groups(layout))
        return cls(
            layout=layout,
            info=info,
            dp_group=mine["dp"][0],
            tp_group=mine["tp"][0],
            bridge_group=bridge_group,
            dp_ranks=mine["dp"][1],
            tp_ranks=mine["tp"][1],
            bridge_ranks=tuple(bridge),
            timeout_s=timeout_s,
            embedding_group=mine["embedding"][0] if "embedding" in mine else None,
        )


def _embedding_groups(layout: RuntimeLayout) -> list[list[int]]:
    """[first LLM stage rank, last LLM stage rank] per LLM replica and TP index (none for a
    one-stage LLM)."""
    llm = layout.llm
    if llm.pp < 2:
        return []
    first = layout.first_rank("llm")
    return [
        [first + d * llm.tp * llm.pp + t, first + d * llm.tp * llm.pp + (llm.pp - 1) * llm.tp + t]
        for d in range(llm.dp)
        for t in range(llm.tp)
    ]
