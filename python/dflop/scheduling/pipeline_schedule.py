"""Pipeline-aware scheduling: ``dflop.pipeline_schedule()`` and ``dflop.PipelineModel``.

:func:`dflop.schedule` makes every dimension's largest microbatch load small. When the
dimensions are modules of one pipeline (a vision encoder's stages feeding an LLM's), that
is not what sets the step time: in steady state the pipeline moves at the pace of the
slower module in each microbatch, so a step is about ``fill + sum_j max_c load(j, c) +
drain``. A microbatch of two images and one of two long texts have the same makespan as
two microbatches of one image and one text each, but the first pair idles the LLM and
then the encoder. :func:`pipeline_schedule` starts from the balanced schedule and searches
(in the native core) which samples share a microbatch and in which order the microbatches
run, minimising the step time simulated under 1F1B, while no microbatch grows past
``max_growth`` times the balanced makespan (the memory bound the balance gave).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from dflop import _core
from dflop.errors import InputTypeError
from dflop.scheduling.actions import pipeline_order_name
from dflop.scheduling.balance import (
    Schedule,
    _as_costs,
    _as_dims,
    _as_int,
    as_time_budget_ms,
    as_time_limit_s,
    schedule,
    schedule_from_assignment,
)

__all__ = ["PipelineModel", "pipeline_schedule"]


def _per_module_counts(name: str, value: Any, num_modules: int) -> tuple[int, ...]:
    """A PipelineModel field of one integer >= 1 per module."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise InputTypeError(f"PipelineModel.{name} must be a sequence, got {value!r}")
    if len(value) != num_modules:
        raise ValueError(
            f"PipelineModel.{name} needs one entry per module ({num_modules}), got {len(value)}"
        )
    counts = tuple(_as_int(f"PipelineModel.{name}[{k}]", v) for k, v in enumerate(value))
    for k, v in enumerate(counts):
        if v < 1:
            raise ValueError(f"PipelineModel.{name}[{k}] must be >= 1, got {v}")
    return counts


def _per_module_floats(
    name: str, value: Any, num_modules: int, ok: Any, what: str
) -> tuple[float, ...]:
    """A PipelineModel field of one number per module, each passing ``ok`` (``what`` says
    which)."""
    values = tuple(_as_float(f"PipelineModel.{name}[{k}]", v) for k, v in enumerate(value))
    if len(values) != num_modules or not all(ok(v) for v in values):
        raise ValueError(
            f"PipelineModel.{name}={value!r} needs one {what} per module ({num_modules})"
        )
    return values


@dataclass(frozen=True)
class PipelineModel:
    """How the cost columns map onto a pipeline (one entry per column, in pipeline order).

    Column ``c`` of the costs is module ``c``: it has ``stages[c]`` consecutive pipeline
    stages, each taking ``costs[i, c]`` seconds for sample ``i`` (the module's work split
    evenly over its stages) plus ``microbatch_constant_s[c]`` per microbatch that has work
    for it (cost sum > 0: an encoder skips a text-only microbatch); ``forward_fraction[c]``
    of it is the forward pass. Each transfer between stages adds ``link_latency_s``.

    ``replicas[c] > 1`` (a microbatch dimension only): module ``c`` runs as that many
    data-parallel replicas that share each microbatch by visual unit, as dflop's runtime
    executes an encoder: its stage time is the slowest replica's under
    :func:`dflop.runtime.routing.split_units` (pass the samples' ``units``), not the
    microbatch's cost divided evenly. The costs stay one replica's seconds.
    ``chunks[c] > 1`` (the last module only): its stages hold that many model chunks and run
    interleaved 1F1B (:func:`dflop.scheduling.pipeline_program`), each chunk taking
    ``1 / chunks[c]`` of a stage's time; the microbatch count must be a multiple of
    ``stages[c]``.

    ``backward[c]`` (default "all"): which of module ``c``'s stages run a backward, as
    dflop's runtime executes a training regime: "all", "last" (a trained projector behind
    a frozen tower) or "none" (frozen, nothing trained before it); a stage that runs
    none is sent no gradient. ``backward_gate[c]`` (default None): another module whose
    load gates module ``c``'s backward: a replica's share with no cost in it runs none
    (a frozen LLM passes gradients back only for microbatches with visual rows).

    ``order`` (default None: :func:`dflop.scheduling.pipeline_order_for` the stages and
    chunks): the pipeline order every replica runs, e.g. ``"zb-h1"``. Its split backwards
    take ``weight_fraction[c]`` (default 0.5) of a module ``c`` stage's backward in ``W``,
    the rest in ``I``; a stage whose input takes no gradient runs all of it in ``W``, as
    dflop's runtime does. ``last_stage_weight_extra[c]`` (default 0): what ``W`` adds on
    module ``c``'s last stage, as a fraction of the microbatch's cost in column ``c``
    (dflop's chunked LM head remakes its logits there; the planner's
    ``_core.stage_costs`` gives it).
    """

    stages: tuple[int, ...] = (1, 1)
    forward_fraction: tuple[float, ...] = (1 / 3, 1 / 3)
    microbatch_constant_s: tuple[float, ...] = (0.0, 0.0)
    link_latency_s: float = 0.0
    replicas: tuple[int, ...] | None = None
    chunks: tuple[int, ...] | None = None
    backward: tuple[str, ...] | None = None
    backward_gate: tuple[int | None, ...] | None = None
    order: str | None = None
    weight_fraction: tuple[float, ...] | None = None
    last_stage_weight_extra: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("stages", "forward_fraction", "microbatch_constant_s"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
                raise InputTypeError(f"PipelineModel.{name} must be a sequence, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        sizes = {len(self.stages), len(self.forward_fraction), len(self.microbatch_constant_s)}
        if len(sizes) != 1:
            raise ValueError(
                "PipelineModel.stages, .forward_fraction and .microbatch_constant_s need one "
                f"entry per module, got lengths {len(self.stages)}, "
                f"{len(self.forward_fraction)}, {len(self.microbatch_constant_s)}"
            )
        stages = tuple(_as_int(f"PipelineModel.stages[{k}]", v) for k, v in enumerate(self.stages))
        for k, v in enumerate(stages):
            if v < 1:
                raise ValueError(f"PipelineModel.stages[{k}] must be >= 1, got {v}")
        fractions = tuple(
            _as_float(f"PipelineModel.forward_fraction[{k}]", v)
            for k, v in enumerate(self.forward_fraction)
        )
        for k, v in enumerate(fractions):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"PipelineModel.forward_fraction[{k}] must be in [0, 1], got {v}")
        constants = tuple(
            _as_float(f"PipelineModel.microbatch_constant_s[{k}]", v)
            for k, v in enumerate(self.microbatch_constant_s)
        )
        for k, v in enumerate(constants):
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(
                    f"PipelineModel.microbatch_constant_s[{k}] must be finite and >= 0, got {v}"
                )
        latency = _as_float("PipelineModel.link_latency_s", self.link_latency_s)
        if not (math.isfinite(latency) and latency >= 0):
            raise ValueError(f"PipelineModel.link_latency_s must be finite and >= 0, got {latency}")
        if self.replicas is not None:
            replicas = _per_module_counts("replicas", self.replicas, len(stages))
            object.__setattr__(self, "replicas", replicas)
        if self.chunks is not None:
            chunks = _per_module_counts("chunks", self.chunks, len(stages))
            for k, v in enumerate(chunks[:-1]):
                if v > 1:
                    raise ValueError(
                        f"PipelineModel.chunks[{k}]={v}: only the last module (the LLM) has "
                        "chunks > 1"
                    )
            object.__setattr__(self, "chunks", chunks)
        if self.backward is not None:
            backward = tuple(self.backward)
            if len(backward) != len(stages) or any(
                b not in ("all", "last", "none") for b in backward
            ):
                raise ValueError(
                    f"PipelineModel.backward={self.backward!r} needs one of 'all', 'last' or "
                    f"'none' per module ({len(stages)})"
                )
            object.__setattr__(self, "backward", backward)
        if self.backward_gate is not None:
            gates = tuple(self.backward_gate)
            if len(gates) != len(stages) or any(
                g is not None and (isinstance(g, bool) or g not in range(len(stages)) or g == c)
                for c, g in enumerate(gates)
            ):
                raise ValueError(
                    f"PipelineModel.backward_gate={self.backward_gate!r} needs, per module "
                    f"({len(stages)}), None or the index of another module"
                )
            object.__setattr__(self, "backward_gate", gates)
        if self.order is not None:
            object.__setattr__(self, "order", pipeline_order_name(self.order))
        if self.weight_fraction is not None:
            object.__setattr__(
                self,
                "weight_fraction",
                _per_module_floats(
                    "weight_fraction",
                    self.weight_fraction,
                    len(stages),
                    lambda w: 0.0 <= w <= 1.0,
                    "value in [0, 1]",
                ),  # fmt: skip
            )
        if self.last_stage_weight_extra is not None:
            object.__setattr__(
                self,
                "last_stage_weight_extra",
                _per_module_floats(
                    "last_stage_weight_extra",
                    self.last_stage_weight_extra,
                    len(stages),
                    lambda x: math.isfinite(x) and x >= 0,
                    "finite value >= 0",
                ),  # fmt: skip
            )
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "forward_fraction", fractions)
        object.__setattr__(self, "microbatch_constant_s", constants)
        object.__setattr__(self, "link_latency_s", latency)

    @classmethod
    def encoder_llm(
        cls,
        *,
        encoder_pp: int,
        encoder_dp: int,
        llm_pp: int,
        stage_constant_s: tuple[float, float],
        forward_fraction: tuple[float, float],
        link_latency_s: float,
        llm_chunks: int = 1,
        backward: tuple[str, str] = ("all", "all"),
        llm_backward_needs_visual: bool = False,
        order: str | None = None,
        weight_fraction: tuple[float, float] | None = None,
        last_stage_weight_extra: tuple[float, float] | None = None,
    ) -> PipelineModel:
        """dflop's encoder -> LLM pipeline as its trainer schedules every step (and the
        planner scores a plan): the encoder's replicas share each microbatch by unit.
        Costs and constants are an average stage's
        (:meth:`dflop.planner.StepPredictor.stage_costs`); ``llm_chunks``: the LLM's virtual
        stages per stage (interleaved 1F1B); ``backward`` and ``llm_backward_needs_visual``:
        the training regime (``PlannerModule.backward_stages`` and
        ``.backward_needs_visual``); ``order``, ``weight_fraction`` and
        ``last_stage_weight_extra``: the pipeline order, the W share of a stage's backward
        and what W adds on the last stage (:class:`PipelineModel`)."""
        return cls(
            stages=(int(encoder_pp), int(llm_pp)),
            forward_fraction=tuple(float(f) for f in forward_fraction),
            microbatch_constant_s=tuple(float(c) for c in stage_constant_s),
            link_latency_s=float(link_latency_s),
            replicas=(int(encoder_dp), 1),
            chunks=(1, int(llm_chunks)),
            backward=tuple(backward),
            backward_gate=(None, 0 if llm_backward_needs_visual else None),
            order=order,
            weight_fraction=weight_fraction,
            last_stage_weight_extra=last_stage_weight_extra,
        )

    @classmethod
    def for_layout(
        cls,
        layout: Any,
        *,
        stage_constant_s: tuple[float, float],
        forward_fraction: tuple[float, float],
        link_latency_s: float,
        modules: tuple[Any, Any] | None = None,
        last_stage_weight_extra: tuple[float, float] | None = None,
    ) -> PipelineModel:
        """:meth:`encoder_llm` of a planner / runtime layout (``layout.encoder`` and
        ``layout.llm`` with ``pp``, ``dp`` and ``virtual_stages``, and its ``order``): the one pipeline the
        trainer's scheduler and the planner's re-scoring both use. ``modules``: the
        planner's (encoder, LLM) :class:`dflop.planner.PlannerModule` under the training
        regime (None: full training); ``last_stage_weight_extra``: the planner's stage
        costs' (what a split order's W adds on each module's last stage)."""
        regime = {}
        if modules is not None:
            regime = {
                "backward": tuple(m.backward_stages for m in modules),
                "llm_backward_needs_visual": modules[1].backward_needs_visual,
                "weight_fraction": (modules[0].weight_share, modules[1].weight_share),
            }
        return cls.encoder_llm(
            encoder_pp=layout.encoder.pp,
            encoder_dp=layout.encoder.dp,
            llm_pp=layout.llm.pp,
            stage_constant_s=stage_constant_s,
            forward_fraction=forward_fraction,
            link_latency_s=link_latency_s,
            llm_chunks=layout.llm.virtual_stages,
            order=getattr(layout, "order", None),
            last_stage_weight_extra=last_stage_weight_extra,
            **regime,
        )

    @property
    def num_modules(self) -> int:
        return len(self.stages)

    @property
    def is_replicated(self) -> bool:
        """Whether a module's replicas share microbatches by unit (``units`` needed)."""
        return self.replicas is not None and any(r > 1 for r in self.replicas)

    def _core_args(self, num_dims: int) -> dict[str, Any]:
        """The core's keywords describing this pipeline."""
        if num_dims != self.num_modules:
            raise ValueError(
                f"costs has D={num_dims} columns but the PipelineModel describes "
                f"{self.num_modules} modules (one column per module, in pipeline order)"
            )
        return {
            "stages": list(self.stages),
            "forward_fraction": list(self.forward_fraction),
            "microbatch_constant_s": list(self.microbatch_constant_s),
            "link_latency_s": self.link_latency_s,
            "chunks": list(self.chunks or ()),
            "backward_from_stage": self._backward_from_stage(),
            "backward_gate": [-1 if g is None else g for g in self.backward_gate or ()],
            "order": self.order or "",
            "weight_fraction": list(self.weight_fraction or ()),
            "last_stage_weight_extra": list(self.last_stage_weight_extra or ()),
        }

    def _backward_from_stage(self) -> list[int]:
        """The core's ``backward_from_stage``: per module, its first virtual stage that
        runs a backward."""
        if self.backward is None:
            return []
        virtual = [s * c for s, c in zip(self.stages, self.chunks or (1,) * len(self.stages))]
        first = {"all": lambda v: 0, "last": lambda v: v - 1, "none": lambda v: v}
        return [first[b](v) for b, v in zip(self.backward, virtual)]

    def _replica_args(self, units: Any, num_samples: int) -> dict[str, list[int]]:
        """The core's ``replicas`` / ``units`` keywords."""
        if not self.is_replicated:
            return {}
        if units is None:
            raise ValueError(
                f"PipelineModel.replicas={self.replicas}: pass the samples' units (the "
                "replicated module shares each microbatch by visual unit)"
            )
        unit_array = np.asarray(units)
        if unit_array.shape != (num_samples,) or unit_array.dtype.kind not in "iu":
            raise ValueError(
                f"units must be a 1-D integer array with one entry per sample ({num_samples}), "
                f"got {unit_array.dtype} {unit_array.shape}"
            )
        return {"replicas": list(self.replicas or ()), "units": unit_array.tolist()}

    def balance_costs(self, costs: np.ndarray) -> np.ndarray:
        """What :func:`dflop.schedule` balances: a replicated module's cost per replica."""
        if not self.is_replicated:
            return costs
        return costs / np.asarray(self.replicas, dtype=np.float64)

    def step_time_s(self, costs: Any, schedule: Schedule, units: Any = None) -> float:
        """The simulated step (the pipeline's order) of ``schedule`` (microbatches run in index order) under
        this model: the same simulation :func:`pipeline_schedule` minimises. ``units``:
        the samples' visual units, needed when a module is replicated."""
        cost_array = _as_costs(costs)
        if cost_array.shape[0] != schedule.num_samples:
            raise ValueError(
                f"costs has {cost_array.shape[0]} rows but the schedule has "
                f"{schedule.num_samples} samples"
            )
        return float(
            _core.simulated_step_time(
                cost_array,
                assignment=np.asarray(schedule.assignment, dtype=np.int64).tolist(),
                num_microbatches=schedule.num_microbatches,
                dp_size=schedule.dp_size,
                microbatch_dims=list(schedule.microbatch_dims),
                **self._core_args(cost_array.shape[1]),
                **self._replica_args(units, cost_array.shape[0]),
            )
        )


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise InputTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def pipeline_schedule(
    costs: Any,
    num_microbatches: int,
    dp_size: int = 1,
    *,
    pipeline: PipelineModel | None = None,
    microbatch_dims: Sequence[int] = (),
    capacity: Sequence[float] | None = None,
    max_growth: float = 1.05,
    seed: int = 0,
    time_budget_ms: float | None = None,
    time_limit_s: float | None = None,
    start: Schedule | None = None,
    balance_time_budget_ms: float | None = None,
    units: Any = None,
) -> Schedule:
    """A schedule for a module pipeline: balanced, then refined on the simulated step.

    Args:
        costs: (N, D) per-sample seconds of one stage of each module (column ``c`` =
            module ``c`` of the pipeline, e.g. encoder then LLM).
        num_microbatches, dp_size, microbatch_dims, capacity, seed: as for
            :func:`dflop.schedule`.
        pipeline: the stages, forward share, per-microbatch constants and link latency
            (default: one stage per column, forward a third, no constants or latency).
        max_growth: no microbatch's load of a dimension may exceed ``max_growth`` x the
            balanced schedule's makespan of that dimension (>= 1; ``inf``: capacities only).
        time_budget_ms: effort of the refinement (deterministic, like ``schedule``'s).
        time_limit_s: wall-clock deadline for balance and refinement together.
        start: the schedule to refine (default: ``dflop.schedule`` with the same arguments
            and ``balance_time_budget_ms`` as its ``time_budget_ms``; a replicated module's
            costs divided by its replicas).
        balance_time_budget_ms: the balance's effort when ``start`` is not given.
        units: (N,) visual units per sample, needed when ``pipeline.replicas`` replicates a
            module (its replicas share each microbatch by unit).

    Returns:
        A :class:`Schedule` whose microbatch indices are the execution order. Its ``stats``
        hold ``step_time_s`` (simulated), ``start_step_time_s`` (the start, in index
        order), ``ordered_step_time_s`` (after the constructive order), ``evaluations``,
        ``work_used``, ``work_budget``, ``improving_moves``, ``perturbations``,
        ``stopped_by_time_limit``, and ``balance_solve_time_s`` (0 when ``start`` was
        given).

    Raises:
        TypeError, ValueError, InfeasibleError: as :func:`dflop.schedule`, and for a
            pipeline or start that does not fit the costs.
    """
    cost_array = _as_costs(costs)
    num_microbatches = _as_int("num_microbatches", num_microbatches)
    dp_size = _as_int("dp_size", dp_size)
    dims = _as_dims(microbatch_dims)
    if pipeline is None:
        d = cost_array.shape[1]
        pipeline = PipelineModel((1,) * d, (1 / 3,) * d, (0.0,) * d)
    elif not isinstance(pipeline, PipelineModel):
        raise InputTypeError(f"pipeline must be a dflop.PipelineModel, got {pipeline!r}")
    core_args = pipeline._core_args(cost_array.shape[1])
    replica_args = pipeline._replica_args(units, cost_array.shape[0])
    balance_costs = pipeline.balance_costs(cost_array)
    if replica_args and not set(c for c, r in enumerate(pipeline.replicas or ()) if r > 1).issubset(
        dims
    ):
        raise ValueError(
            f"PipelineModel.replicas={pipeline.replicas}: a replicated module must be in "
            f"microbatch_dims={dims} (its replicas share each microbatch)"
        )
    if isinstance(max_growth, bool) or not isinstance(max_growth, (int, float, np.number)):
        raise InputTypeError(f"max_growth must be a number, got {max_growth!r}")
    if time_limit_s is not None:
        limit = _as_float("time_limit_s", time_limit_s)
        if not (math.isfinite(limit) and limit >= 0):
            raise ValueError(f"time_limit_s must be a finite number >= 0, got {time_limit_s!r}")
    seed = _as_int("seed", seed, upper=2**64 - 1)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    began = time.perf_counter()
    # Efforts and limits checked before any work: a bad value fails at once.
    limit = as_time_limit_s("time_limit_s", time_limit_s)
    limited = limit is not None and math.isfinite(limit)
    time_budget_ms = as_time_budget_ms("time_budget_ms", time_budget_ms, limited)
    as_time_budget_ms("balance_time_budget_ms", balance_time_budget_ms, limited)
    if start is None:
        start = schedule(
            balance_costs,
            num_microbatches,
            dp_size,
            microbatch_dims=dims,
            capacity=capacity,
            seed=seed,
            time_budget_ms=balance_time_budget_ms,
            time_limit_s=time_limit_s,
        )
        balance_solve_time_s = start.solve_time_s
    elif not isinstance(start, Schedule):
        raise InputTypeError(f"start must be a dflop.Schedule, got {type(start).__name__}")
    elif (start.num_microbatches, start.dp_size, start.num_samples) != (
        num_microbatches,
        dp_size,
        cost_array.shape[0],
    ):
        raise ValueError(
            f"start has {start.num_samples} samples in {start.num_microbatches} x "
            f"{start.dp_size} bins; expected {cost_array.shape[0]} in {num_microbatches} x {dp_size}"
        )
    elif start.microbatch_dims != dims:
        raise ValueError(
            f"start was balanced with microbatch_dims={start.microbatch_dims}, not {dims}"
        )
    else:
        balance_solve_time_s = 0.0
    remaining = None
    if time_limit_s is not None:
        remaining = max(0.0, float(time_limit_s) - (time.perf_counter() - began))
    cap_list = None if capacity is None else [float(v) for v in capacity]
    raw = _core.pipeline_schedule(
        cost_array,
        start_assignment=np.asarray(start.assignment, dtype=np.int64).tolist(),
        num_microbatches=num_microbatches,
        dp_size=dp_size,
        microbatch_dims=list(dims),
        **core_args,
        capacity=cap_list,
        max_growth=float(max_growth),
        seed=seed,
        time_budget_ms=time_budget_ms,
        time_limit_s=remaining,
        **replica_args,
    )
    refined = schedule_from_assignment(
        balance_costs, raw["assignment"], num_microbatches, dp_size, microbatch_dims=dims
    )
    stats = dict(raw["stats"], step_time_s=float(raw["step_time_s"]))
    stats["balance_solve_time_s"] = balance_solve_time_s
    return Schedule(
        assignment=refined.assignment,
        loads=refined.loads,
        microbatch_loads=refined.microbatch_loads,
        makespan=refined.makespan,
        lower_bound=refined.lower_bound,
        num_microbatches=num_microbatches,
        dp_size=dp_size,
        microbatch_dims=dims,
        seed=seed,
        solve_time_s=time.perf_counter() - began,
        stats=MappingProxyType(stats),
    )
