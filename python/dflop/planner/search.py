"""Calling the native search on the planner's inputs (:mod:`dflop.planner.inputs`) and
assembling the :class:`Plan`."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from dflop import _core
from dflop.data.costs import EncoderConfig, LLMConfig, SampleCostModel
from dflop.errors import InputTypeError
from dflop.planner.inputs import (
    PlannerInputs,
    core_options,
    prepare_inputs,
    sample_record,
    single_batch_inputs,
)
from dflop.planner.model import ClusterSpec, PlannerConfig
from dflop.planner.result import LayoutPlan, ModulePlan, Plan, StepPrediction
from dflop.planner.steps import StepAudit
from dflop.scheduling.balance import InfeasibleError

__all__ = [
    "InfeasibleClusterError",
    "PlannerInputs",
    "audited",
    "evaluate_layout",
    "plan",
    "prepare_inputs",
    "search_layouts",
    "simulate_layout",
    "single_batch_inputs",
]


_DEFAULT_CONFIG = PlannerConfig()


class InfeasibleClusterError(ValueError):
    """No layout fits the cluster's memory; the message says what does not fit and the
    smallest memory per GPU or GPU count that would."""


PerformanceModelLike = SampleCostModel
"""The old name of :class:`dflop.data.costs.SampleCostModel` (kept for callers)."""


def _layout_plan(
    raw: dict[str, Any], global_batch: int, strategy: str, encoder_heads: int
) -> LayoutPlan:
    layout = raw["layout"]
    colocated = bool(layout["colocated"])
    enc = layout["encoder"]
    padded = 0
    if colocated and encoder_heads % int(enc["tp"]):
        padded = int(_core.padded_heads(encoder_heads, int(enc["tp"])))
    encoder = ModulePlan(
        tp=int(enc["tp"]),
        pp=int(enc["pp"]),
        dp=int(enc["dp"]),
        first_rank=int(enc["first_rank"]),
        layers_per_stage=tuple(int(n) for n in enc["layers_per_stage"]),
        colocated=colocated,
        recompute=bool(enc.get("recompute", False)),
        padded_heads=padded,
    )
    g = layout["llm"]
    llm = ModulePlan(
        tp=int(g["tp"]),
        pp=int(g["pp"]),
        dp=int(g["dp"]),
        first_rank=int(g["first_rank"]),
        layers_per_stage=tuple(int(n) for n in g["layers_per_stage"]),
        recompute=bool(g.get("recompute", False)),
        virtual_stages=int(g.get("virtual_stages", 1)),
    )
    steps = raw["steps"]
    compute = np.mean([s["stage_compute_s"] for s in steps], axis=0)
    allreduce = np.mean([s["stage_allreduce_s"] for s in steps], axis=0)
    step_time = float(raw["mean_step_time_s"])
    bubble = np.maximum(step_time - compute - allreduce, 0.0)
    prediction = StepPrediction(
        step_time_s=step_time,
        throughput_samples_per_s=global_batch / step_time if step_time > 0 else 0.0,
        idle_fraction=float(raw["mean_idle_fraction"]),
        lower_bound_s=float(raw["lower_bound_s"]),
        step_time_as_scheduled_s=float(raw["mean_step_time_as_scheduled_s"]),
        stage_compute_s=tuple(float(v) for v in compute),
        stage_allreduce_s=tuple(float(v) for v in allreduce),
        stage_bubble_s=tuple(float(v) for v in bubble),
        transfer_s=float(np.mean([s["transfer_s"] for s in steps])),
        peak_memory_bytes=float(raw["peak_memory_bytes"]),
        stage_memory_bytes=tuple(float(v) for v in raw.get("stage_memory_bytes", ())),
        step_times_s=tuple(float(s["step_time_s"]) for s in steps),
        microbatch_orders=tuple(str(s["order"]) for s in steps),
        estimate_s=float(raw.get("estimate_s", 0.0)),
    )
    return LayoutPlan(
        encoder,
        llm,
        int(layout["num_microbatches"]),
        global_batch,
        prediction,
        colocated,
        scheduler="data_blind" if strategy == "data_blind" else "balanced",
        order=layout.get("order"),
    )


def search_layouts(
    cluster: ClusterSpec,
    inputs: PlannerInputs,
    config: PlannerConfig = _DEFAULT_CONFIG,
    *,
    strategy: str = "data_aware",
    top_k: int | None = None,
) -> tuple[list[LayoutPlan], dict[str, Any]]:
    """Run one native search. ``strategy``: "data_aware" (dflop), "data_blind" (the
    Megatron-LM-style colocated baseline) or "mean_shape" (the reference's optimizer).

    Returns the layouts (best first; empty when nothing fits) and the raw result's stats
    and memory shortfall: ``{"stats": ..., "shortfall": ...}``.
    """
    if not isinstance(cluster, ClusterSpec):
        raise InputTypeError(f"cluster must be a ClusterSpec, got {type(cluster).__name__}")
    raw = _core.plan_layouts(
        cluster.to_dict(),
        inputs.encoder.to_dict(),
        inputs.llm.to_dict(),
        inputs.samples,
        core_options(config, strategy, inputs.global_batch, top_k or config.top_k),
    )
    layouts = [
        _layout_plan(r, inputs.global_batch, strategy, inputs.encoder.num_heads)
        for r in raw["best"]
    ]
    return layouts, {"stats": dict(raw["stats"]), "shortfall": dict(raw["shortfall"])}


_MAX_WIDENED_TOP_K = 256
"""The furthest :func:`choose_layouts` looks down the search's ranking for a layout that
fits as the trainer runs it."""


def choose_layouts(
    cluster: ClusterSpec,
    inputs: PlannerInputs,
    config: PlannerConfig = _DEFAULT_CONFIG,
    *,
    strategy: str = "data_aware",
    top_k: int | None = None,
) -> tuple[list[LayoutPlan], dict[str, Any]]:
    """What :func:`plan` chooses from: :func:`search_layouts`, then (with
    ``config.runtime_schedule``) the kept layouts re-scored with the schedules dflop's
    trainer computes (:func:`runtime_scored`) and re-ranked, so that every number is one
    the runtime reaches. Only the best keeps its step records (a plan for thousands of
    GPUs would otherwise carry several copies); :func:`simulate_layout` rebuilds others'."""
    layouts, raw = search_layouts(cluster, inputs, config, strategy=strategy, top_k=top_k)
    if strategy != "data_aware" or not any(_runs_runtime_schedule(lp, config) for lp in layouts):
        return layouts, raw  # the baselines rank by their own rules
    keep = min(len(layouts), top_k or config.top_k)  # the search may keep more to pick from
    if set(config.virtual_stage_choices) != {1}:
        # The search ranks with its balanced schedule, which favours interleaved layouts
        # over what the trainer's scheduler makes of them: also re-score the 1F1B-only
        # search's layouts, so that allowing interleaving never loses that plan.
        plain, _ = search_layouts(
            cluster, inputs, replace(config, virtual_stage_choices=(1,)), strategy=strategy,
            top_k=top_k,
        )  # fmt: skip
        seen = {json.dumps(lp.core_dict(), sort_keys=True) for lp in layouts}
        layouts += [lp for lp in plain if json.dumps(lp.core_dict(), sort_keys=True) not in seen]

    def as_run(layout: LayoutPlan) -> LayoutPlan | None:
        try:
            return runtime_scored(cluster, inputs, layout, config)
        except InfeasibleError:  # the trainer's schedule needs more memory than fits
            return None

    # In threads: the core releases the GIL. Stable: ties keep the search's order.
    threads = config.num_threads or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=min(threads, len(layouts))) as pool:
        scored = [lp for lp in pool.map(as_run, layouts) if lp is not None]
    raw["stats"]["num_over_memory_as_run"] = len(layouts) - len(scored)
    wider = 4 * (top_k or config.top_k)
    if not scored and len(layouts) >= (top_k or config.top_k) and wider <= _MAX_WIDENED_TOP_K:
        # Every kept layout needs more memory under the trainer's schedules than the
        # search's: look further down the search's ranking before calling it infeasible.
        found, raw = choose_layouts(cluster, inputs, config, strategy=strategy, top_k=wider)
        return found[: top_k or config.top_k], raw
    if not scored:
        return [], raw
    scored.sort(key=lambda lp: lp.prediction.step_time_s)
    scored = scored[:keep]
    scored[1:] = [replace(lp, steps=()) for lp in scored[1:]]
    return scored, raw


def _smallest_fitting_gpus(
    cluster: ClusterSpec, inputs: PlannerInputs, config: PlannerConfig
) -> int | None:
    """The smallest GPU count (whole nodes, up to 64x) with a layout that fits."""
    quick = replace(config, num_batches=1, top_k=1, order_microbatches=False)
    one = replace(
        inputs,
        num_batches=1,
        samples={
            k: (v[: inputs.global_batch] if isinstance(v, np.ndarray) else v)
            for k, v in inputs.samples.items()
        }
        | {"num_batches": 1},
    )
    step = cluster.gpus_per_node
    num = -(-cluster.num_gpus // step) * step
    if num == cluster.num_gpus:
        num += step
    while num <= 64 * cluster.num_gpus:
        layouts, _ = search_layouts(replace(cluster, num_gpus=num), one, quick, top_k=1)
        if layouts:
            return num
        num *= 2 if num >= 8 * step else 1
        num += 0 if num >= 8 * step else step
    return None


def _infeasible(
    cluster: ClusterSpec, inputs: PlannerInputs, config: PlannerConfig, shortfall: dict
) -> InfeasibleClusterError:
    available = cluster.gpu_memory_bytes
    needed = float(shortfall.get("needed_bytes", 0.0))
    what = (
        f"the {shortfall.get('module', 'llm')} stage {shortfall.get('stage', 0)} of the "
        f"least memory-hungry layout needs {needed / 1e9:.1f} GB per GPU (model states + "
        f"activations in flight + {cluster.memory_reserve_bytes / 1e9:.1f} GB reserve)"
        if shortfall.get("found")
        else "no layout satisfies the parallelism constraints"
    )
    gpus = _smallest_fitting_gpus(cluster, inputs, config)
    fix = [f"gpu_memory_bytes >= {needed / 1e9:.1f} GB"] if shortfall.get("found") else []
    if gpus is not None:
        fix.append(f"num_gpus >= {gpus}")
    return InfeasibleClusterError(
        f"no layout fits {cluster.num_gpus} GPUs of {available / 1e9:.1f} GB: {what}, more "
        f"than the {available / 1e9:.1f} GB available; it would fit with "
        + (" or ".join(fix) if fix else "a larger cluster")
    )


def plan(
    performance_model: SampleCostModel,
    encoder: EncoderConfig,
    llm: LLMConfig,
    cluster: ClusterSpec,
    *,
    global_batch: int,
    shapes: Any = None,
    config: PlannerConfig = _DEFAULT_CONFIG,
    inputs_description: dict[str, Any] | None = None,
) -> Plan:
    """Plan the parallel layout of an encoder + LLM on ``cluster``.

    Args:
        performance_model: per-sample costs (``.costs(shapes) -> (N, 2)`` seconds of the
            whole encoder / LLM on one GPU) and ``.microbatch_constant_s``.
        encoder, llm: the model configs (parameters, layers, heads, hidden size).
        cluster: the GPUs.
        global_batch: samples per step.
        shapes: a distribution with ``.sample(n, seed)``, a SampleShapes to bootstrap
            from, None / "synthetic" for the embedded synthetic mix, or a run's steps
            (``.shapes(step)`` gives step's global batch, as dflop.train's StepShapes):
            then the sampled batches are the run's first ``config.num_batches`` steps, so
            the plan predicts the batches the run trains on.
        config: search settings.
        inputs_description: stored in ``Plan.inputs`` so that ``dflop simulate`` can
            rebuild the sampled batches.

    Raises:
        InfeasibleClusterError: (a ValueError) nothing fits in memory.
    """
    if not isinstance(config, PlannerConfig):
        raise InputTypeError(f"config must be a PlannerConfig, got {type(config).__name__}")
    start = time.perf_counter()
    inputs = prepare_inputs(
        performance_model,
        encoder,
        llm,
        global_batch=global_batch,
        shapes=shapes,
        num_batches=config.num_batches,
        seed=config.seed,
        forward_fraction=config.forward_fraction,
        element_bytes=config.element_bytes,
        loss_chunk_tokens=config.loss_chunk_tokens,
        trainable=config.trainable,
        lora_rank=config.lora_rank,
    )
    layouts, raw = choose_layouts(cluster, inputs, config)
    if not layouts:
        raise _infeasible(cluster, inputs, config, raw["shortfall"])
    if not layouts[0].steps:
        layouts[0] = audited(cluster, inputs, layouts[0], config)
    baseline = reference = None
    if config.baseline:
        found, _ = search_layouts(cluster, inputs, config, strategy="data_blind", top_k=1)
        baseline = found[0] if found else None
    if config.reference:
        found, _ = search_layouts(cluster, inputs, config, strategy="mean_shape", top_k=1)
        reference = found[0] if found else None
    description = dict(inputs_description or {})
    description.setdefault("encoder", _config_dict(encoder))
    description.setdefault("llm", _config_dict(llm))
    description.setdefault("num_batches", config.num_batches)
    description.setdefault("seed", config.seed)
    description.setdefault("forward_fraction", list(inputs.forward_fraction))
    description.setdefault("element_bytes", config.element_bytes)
    description.setdefault("zero1", config.zero1)
    description.setdefault("loss_chunk_tokens", config.loss_chunk_tokens)
    description.setdefault("trainable", config.trainable)
    description.setdefault("lora_rank", config.lora_rank)
    return Plan(
        cluster=cluster,
        global_batch=int(global_batch),
        layouts=layouts,
        baseline=baseline,
        reference=reference,
        inputs=description,
        stats=raw["stats"],
        planning_time_s=time.perf_counter() - start,
    )


def _config_dict(config: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(config)


def _layout_args(
    cluster: ClusterSpec,
    inputs: PlannerInputs,
    layout: LayoutPlan | dict[str, Any],
    config: PlannerConfig,
) -> tuple[str, tuple[Any, ...]]:
    """The scheduling strategy of ``layout`` and the core's arguments to evaluate it."""
    if isinstance(layout, LayoutPlan):
        core, blind = layout.core_dict(), layout.scheduler == "data_blind"
    else:
        core, blind = dict(layout), False
    strategy = "data_blind" if blind else "data_aware"
    return strategy, (
        cluster.to_dict(),
        inputs.encoder.to_dict(),
        inputs.llm.to_dict(),
        inputs.samples,
        core_options(config, strategy, inputs.global_batch, 1),
        core,
    )


def evaluate_layout(
    cluster: ClusterSpec,
    inputs: PlannerInputs,
    layout: LayoutPlan | dict[str, Any],
    config: PlannerConfig = _DEFAULT_CONFIG,
    *,
    assignments: list[Any] | None = None,
) -> LayoutPlan:
    """Score a given layout on ``inputs`` (a colocated one with the data-blind schedule).
    ``layout``: a :class:`LayoutPlan` or its ``core_dict()`` form (e.g. a runtime layout
    through :func:`dflop.train.planning.core_layout`; scored with the balanced schedule).
    ``assignments``: one schedule per sampled batch (bins; microbatch indices are the
    execution order) to score instead of the planner's own.

    Raises:
        dflop.InfeasibleError: (a ValueError) the layout does not fit in memory.
    """
    strategy, args = _layout_args(cluster, inputs, layout, config)
    if assignments is not None:
        assignments = [np.ascontiguousarray(a, dtype=np.int64) for a in assignments]
    raw = _core.evaluate_layout(*args, assignments=assignments)
    return _layout_plan(raw, inputs.global_batch, strategy, inputs.encoder.num_heads)


def audited(
    cluster: ClusterSpec,
    inputs: PlannerInputs,
    layout: LayoutPlan,
    config: PlannerConfig = _DEFAULT_CONFIG,
) -> LayoutPlan:
    """``layout`` with its :class:`StepAudit` per sampled batch: the schedule, split and
    per-replica times the planner scored it with (``LayoutPlan.steps``)."""
    _, args = _layout_args(cluster, inputs, layout, config)
    steps = tuple(
        StepAudit.from_core(
            _core.build_step(*args, b), sample_record(inputs.samples, b, inputs.global_batch)
        )
        for b in range(inputs.num_batches)
    )
    return replace(layout, steps=steps)


def _runs_runtime_schedule(layout: LayoutPlan, config: PlannerConfig) -> bool:
    """Whether dflop's trainer would schedule ``layout``'s steps itself: a disaggregated
    layout scored with the split it executes (ablations keep the planner's schedule)."""
    return (
        config.runtime_schedule
        and not layout.colocated
        and layout.scheduler != "data_blind"
        and config.encoder_split == "unit"
    )


def runtime_scored(
    cluster: ClusterSpec,
    inputs: PlannerInputs,
    layout: LayoutPlan,
    config: PlannerConfig = _DEFAULT_CONFIG,
) -> LayoutPlan:
    """``layout`` scored on ``inputs`` and audited as dflop runs it: with the schedules
    dflop's trainer computes for its steps (:func:`dflop.pipeline_schedule` on the
    simulated encoder -> LLM step, the encoder's replicas sharing microbatches by unit,
    microbatches in the order it chose) instead of the search's own balanced schedule, so
    the prediction is of what the runtime executes. The search ranks candidates with the
    cheaper schedule; this re-scores the few it keeps. Colocated and data-blind layouts
    (and ablation splits) are scored with the planner's own schedule.

    Raises:
        dflop.InfeasibleError: (a ValueError) the layout does not fit in memory.
    """
    from dflop.scheduling.pipeline_schedule import PipelineModel, pipeline_schedule

    if not _runs_runtime_schedule(layout, config):
        return audited(cluster, inputs, evaluate_layout(cluster, inputs, layout, config), config)
    _, args = _layout_args(cluster, inputs, layout, config)
    n, samples = inputs.global_batch, inputs.samples
    assignments = []
    for b in range(inputs.num_batches):
        seen = _core.stage_costs(*args, b)
        model = PipelineModel.for_layout(
            layout,
            stage_constant_s=seen["constants"],
            # what the trainer's scheduler uses: the shares under the training regime
            forward_fraction=(inputs.encoder.forward_share, inputs.llm.forward_share),
            link_latency_s=cluster.link_latency_s,
            modules=(inputs.encoder, inputs.llm),
            last_stage_weight_extra=seen["last_stage_weight_extra"],
        )
        # As the trainer's scheduler does for step b: its seed offset by the step.
        chosen = pipeline_schedule(
            seen["costs"],
            layout.num_microbatches,
            layout.llm.dp,
            pipeline=model,
            microbatch_dims=(0,),
            seed=config.seed + b,
            units=samples["encoder_units"][b * n : (b + 1) * n],
        )
        assignments.append(np.ascontiguousarray(chosen.assignment, dtype=np.int64))
    scored = evaluate_layout(cluster, inputs, layout, config, assignments=assignments)
    steps = tuple(
        StepAudit.from_core(
            _core.step_from_assignment(*args, b, assignments[b]),
            sample_record(samples, b, n),
        )
        for b in range(inputs.num_batches)
    )
    return replace(scored, steps=steps)


def simulate_layout(
    cluster: ClusterSpec,
    inputs: PlannerInputs,
    layout: LayoutPlan,
    config: PlannerConfig = _DEFAULT_CONFIG,
    *,
    batch: int = 0,
) -> Any:
    """Simulate sampled batch ``batch`` under ``layout`` with events recorded: a
    :class:`dflop.simulator.SimulationResult` (write_chrome_trace / write_gantt_png).

    Stages are the encoder's then the LLM's; replicas are the LLM's DP ranks (encoder
    stages repeat in every replica: its DP replicas share each microbatch). The step is the
    one the layout's prediction was made with: its recorded step, or else rebuilt the same
    way (with the trainer's schedule where the runtime schedules it).
    """
    if not layout.steps and _runs_runtime_schedule(layout, config):
        layout = runtime_scored(cluster, inputs, layout, config)
    if layout.steps:
        return layout.steps[int(batch)].simulate()
    _, args = _layout_args(cluster, inputs, layout, config)
    return StepAudit.from_core(_core.build_step(*args, int(batch))).simulate()
