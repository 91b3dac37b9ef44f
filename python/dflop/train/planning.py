"""Where the ranks' layout and the cost model come from: a plan file, a manual layout, or
the planner run for the local processes; a performance model file or a quick profile.

The planner thinks in GPUs; for local CPU processes it is given a "cluster" of ``nproc``
devices on one node (memory: this host's RAM split between them, links: shared memory)
and ``max_tp=1``: tensor parallelism runs on gloo (for correctness), but sharding small
CPU matmuls over processes on shared cores only adds communication. Manual layouts
(``enc_tp=2,...``) and plan files may use tp > 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop.models.registry import model_spec
from dflop.models.spec import ModelSpec
from dflop.planner.model import DEFAULT_LOSS_CHUNK_TOKENS
from dflop.runtime.topology import ModuleLayout, RuntimeLayout, uniform_layer_ranges

__all__ = [
    "MAX_LOCAL_GLOBAL_BATCH",
    "Calibration",
    "LocalPlan",
    "MemoryBudget",
    "check_local_global_batch",
    "core_layout",
    "cost_configs",
    "evaluate_local",
    "layout_from_plan",
    "local_cluster",
    "memory_budget",
    "parse_layout",
    "plan_local",
    "profiled_tokens",
    "quick_profile",
    "runtime_layout",
    "runtime_planner_config",
]

_LAYOUT_KEYS = {
    "enc_dp": "encoder_dp",
    "enc_pp": "encoder_pp",
    "enc_tp": "encoder_tp",
    "llm_dp": "llm_dp",
    "llm_pp": "llm_pp",
    "llm_tp": "llm_tp",
    "llm_v": "llm_virtual_stages",
    "m": "num_microbatches",
}


_RECOMPUTE_FLAGS = {"enc_rc": "encoder_recompute", "llm_rc": "llm_recompute"}
"""Layout words that turn a module's activation recompute on (the plan table's ``rc``)."""


def parse_layout(
    spec: str, model: ModelSpec | str, global_batch: int, num_microbatches: int | None = None
) -> RuntimeLayout:
    """``"enc_dp=1,enc_pp=1,llm_dp=1,llm_pp=1[,llm_v=2][,m=4][,enc_rc][,llm_rc]"`` as a
    :class:`RuntimeLayout` with uniform layer splits (``llm_v``: the LLM's virtual stages per
    stage, run under interleaved 1F1B; ``enc_rc`` / ``llm_rc``: that module's activation
    recompute); ``"colocated,llm_dp=2[,...]"``: the encoder inside the LLM's first stage
    (no ``enc_*`` sizes; ``llm_rc`` recomputes the encoder too). Missing sizes are 1; ``m`` defaults to
    ``num_microbatches`` or ``min(4, global_batch // llm_dp)`` (interleaved: rounded up to a
    multiple of ``llm_pp``)."""
    values: dict[str, int] = {}
    colocated = False
    recompute: dict[str, bool] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part == "colocated":
            colocated = True
            continue
        if part in _RECOMPUTE_FLAGS:
            recompute[_RECOMPUTE_FLAGS[part]] = True
            continue
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in _LAYOUT_KEYS:
            raise ValueError(
                f"layout {spec!r}: {part!r} is not 'colocated', 'enc_rc', 'llm_rc' or "
                f"KEY=VALUE with KEY in {sorted(_LAYOUT_KEYS)}"
            )
        try:
            values[_LAYOUT_KEYS[key]] = int(value)
        except ValueError:
            raise ValueError(f"layout {spec!r}: {key}={value!r} is not an integer") from None
        if values[_LAYOUT_KEYS[key]] < 1:
            raise ValueError(f"layout {spec!r}: {key} must be >= 1")
    llm_dp = values.get("llm_dp", 1)
    m = values.pop("num_microbatches", None) or num_microbatches
    if m is None:
        m = max(1, min(4, global_batch // llm_dp))
        if values.get("llm_virtual_stages", 1) > 1:
            pp = values.get("llm_pp", 1)
            m = -(-m // pp) * pp
    layers = model_spec(model)
    for key, module, count in (
        ("enc_pp", "encoder_pp", layers.encoder_layers),
        ("llm_pp", "llm_pp", layers.llm_layers),
    ):
        if values.get(module, 1) > count:
            raise ValueError(
                f"layout {spec!r}: {key}={values[module]} pipeline stages for a module of "
                f"{count} layers (at most {count})"
            )
    chunks = values.get("llm_pp", 1) * values.get("llm_virtual_stages", 1)
    if chunks > layers.llm_layers:
        raise ValueError(
            f"layout {spec!r}: llm_pp x llm_v = {chunks} model chunks for an LLM of "
            f"{layers.llm_layers} layers (at most {layers.llm_layers})"
        )
    if colocated:
        given = sorted(
            k for k, v in _LAYOUT_KEYS.items() if v.startswith("encoder_") and v in values
        )
        given += ["enc_rc"] if "encoder_recompute" in recompute else []
        if given:
            raise ValueError(
                f"layout {spec!r}: {', '.join(given)} with 'colocated': a colocated encoder "
                "runs on the LLM's first stage, with its tp, dp and recompute (drop them)"
            )
    return RuntimeLayout.simple(
        **values,
        **recompute,
        encoder_layers=layers.encoder_layers,
        llm_layers=layers.llm_layers,
        num_microbatches=m,
        global_batch=global_batch,
        colocated=colocated,
    )


MAX_LOCAL_GLOBAL_BATCH = 1 << 16
"""The largest global batch ``dflop train --plan`` runs (65,536 samples per step): the
plan's ``global_batch``, or the run's ``--global-batch`` that replaces it. Every rank of
the local run builds each step's per-sample arrays (shapes, costs, the schedule's
assignment) for the whole global batch and the scheduler balances all of it every step,
so a larger batch costs gigabytes and minutes per rank before the first step (10^7
samples: 3.8 GB and 40 s, then a failure inside a rank). A plan for a bigger batch (a
cluster's) is refused before any process starts. (Plan files themselves may hold up to
``dflop.planner.plan_check.MAX_PLAN_GLOBAL_BATCH``, the planner's own bound.)"""


def check_local_global_batch(global_batch: int, path: str | os.PathLike[str] | None = None) -> int:
    """``global_batch`` if ``dflop train`` can run it locally (at most
    :data:`MAX_LOCAL_GLOBAL_BATCH`); else a ValueError naming where it came from: the plan
    file ``path`` (its ``global_batch`` field), or the run's ``global_batch`` setting."""
    if global_batch > MAX_LOCAL_GLOBAL_BATCH:
        where = (
            f"{os.fspath(path)}: global_batch" if path is not None else "TrainConfig.global_batch"
        )
        raise ValueError(
            f"{where}={global_batch:,} is more than dflop train runs on local processes: "
            f"at most {MAX_LOCAL_GLOBAL_BATCH:,} samples per step (every rank builds each "
            "step's per-sample arrays for the whole batch)"
        )
    return global_batch


def check_plan_settings(inputs: dict[str, Any], path: Any) -> None:
    """Refuse a plan priced for training settings ``dflop train`` does not execute: bf16
    (``inputs.element_bytes`` 2) or a ZeRO-1 optimizer (``inputs.zero1``), in one line
    naming them and the ``dflop plan`` flags that price what runs."""
    from dflop.planner.result import plan_element_bytes, plan_zero1

    unrun = []
    element_bytes = plan_element_bytes(inputs)
    if element_bytes != RUNTIME_ELEMENT_BYTES:
        unrun.append(f"{element_bytes}-byte (bf16) training (inputs.element_bytes={element_bytes})")
    if plan_zero1(inputs):
        unrun.append("optimizer states sharded over the data-parallel replicas (inputs.zero1)")
    if unrun:
        raise ValueError(
            f"{path}: the plan prices {' and '.join(unrun)}, which dflop train does not "
            "execute yet (it trains float32 weights and activations, every optimizer state "
            "on every replica), so the plan's memory and step times are not what would run: "
            "plan again with dflop plan ... --precision fp32 --no-zero1"
        )


def layout_from_plan(
    path: str | os.PathLike[str],
    model: ModelSpec | str,
    global_batch: int | None = None,
    num_microbatches: int | None = None,
) -> RuntimeLayout:
    """The best layout of a plan JSON as a :class:`RuntimeLayout`; ``global_batch`` and
    ``num_microbatches`` (when given) replace the plan's. The plan file is checked whole
    at load (:meth:`dflop.planner.Plan.load`), here against ``model`` and the local run.

    Raises:
        ValueError: one line naming the file and the field: a field that breaks the plan
            format's rules, a colocated layout with padded encoder heads
            (:func:`runtime_layout`), layer counts that do not match ``model``, or a global
            batch above :data:`MAX_LOCAL_GLOBAL_BATCH`.
    """
    from dflop.planner import Plan

    plan = Plan.load(path)
    check_plan_settings(plan.inputs, path)
    best = plan.best
    if global_batch is None:
        check_local_global_batch(best.global_batch, path)
    else:
        check_local_global_batch(global_batch)
    spec = model_spec(model)
    for name, part, layers in (
        ("encoder", best.encoder, spec.encoder_layers),
        ("llm", best.llm, spec.llm_layers),
    ):
        if sum(part.layers_per_stage) != layers:
            raise ValueError(
                f"{path}: layouts[0].{name}.layers_per_stage={list(part.layers_per_stage)} "
                f"sum to {sum(part.layers_per_stage)} layers, the model's {name} has "
                f"{layers}: plan for the same model (dflop plan --encoder/--llm, or --local)"
            )
    try:
        return runtime_layout(
            best,
            num_microbatches=num_microbatches or best.num_microbatches,
            global_batch=global_batch or best.global_batch,
        )
    except ValueError as error:
        raise ValueError(f"{path}: layouts[0]: {error}") from None


def runtime_layout(
    lp: Any, *, num_microbatches: int | None = None, global_batch: int | None = None
) -> RuntimeLayout:
    """A plan's layout (:class:`~dflop.planner.LayoutPlan`) as the
    :class:`RuntimeLayout` that runs it (a colocated one with the encoder in the first LLM
    stage); ``num_microbatches`` and ``global_batch`` replace the plan's.

    Raises:
        ValueError: a colocated layout whose encoder heads were padded to its TP degree
            (the runtime shards heads without padding).
    """
    if lp.colocated and lp.encoder.padded_heads:
        raise ValueError(
            f"the colocated layout ({lp.describe()}) pads the encoder's heads to "
            f"{lp.encoder.padded_heads} for tp={lp.llm.tp}; dflop's runtime shards heads "
            "without padding: plan again (dflop's own colocated candidates use a tp that "
            "divides the heads)"
        )
    llm = ModuleLayout(
        lp.llm.tp,
        lp.llm.pp,
        lp.llm.dp,
        tuple(lp.llm.layer_ranges),
        lp.llm.virtual_stages,
        recompute=bool(lp.llm.recompute),
    )
    encoder_layers = sum(lp.encoder.layers_per_stage)
    encoder = (
        RuntimeLayout.colocated_encoder(encoder_layers, llm)
        if lp.colocated
        else ModuleLayout(
            lp.encoder.tp,
            lp.encoder.pp,
            lp.encoder.dp,
            tuple(lp.encoder.layer_ranges),
            recompute=bool(lp.encoder.recompute),
        )
    )
    return RuntimeLayout(
        encoder=encoder,
        llm=llm,
        num_microbatches=num_microbatches or lp.num_microbatches,
        global_batch=global_batch or lp.global_batch,
        order=lp.order,
        colocated=lp.colocated,
    )


PLANNED_DATA_SETTINGS: tuple[str, ...] = (
    "data",
    "image_folder",
    "video_folder",
    "family",
    "mix",
    "scaler",
    "seed",
)
"""The data settings a local plan records (``TrainConfig`` fields of the same names)."""


PLANNED_PATHS = ("data", "image_folder", "video_folder")
"""The plan inputs that are paths: written absolute; a relative one (a plan written by
hand, or moved with its data) is relative to the plan file's folder."""


def resolved_model(model: str, base: str = ".") -> str:
    """``model`` with a Hugging Face folder made absolute (``hf:./m``, ``hf:m/`` and
    ``hf:/abs/m`` name one model), relative paths taken from ``base``; a preset as is."""
    if isinstance(model, str) and model.startswith("hf:"):
        return "hf:" + os.path.realpath(os.path.join(base, model[3:]))
    return model


def resolved_path(value: Any, base: str = ".") -> Any:
    """A data path made absolute from ``base`` (``"synthetic"``, None: as is)."""
    if isinstance(value, str) and value and value != "synthetic":
        return os.path.realpath(os.path.join(base, value))
    return value


def planned_settings(plan: Any, plan_path: str | None = None) -> dict[str, Any]:
    """The ``TrainConfig`` settings ``plan`` was made for: its training regime, and for a
    plan of local processes its model and data (what ``dflop train --plan`` trains unless
    told otherwise), paths absolute (relative ones from ``plan_path``'s folder)."""
    inputs = plan.inputs
    base = os.path.dirname(os.path.abspath(plan_path)) if plan_path else "."
    settings = {key: inputs[key] for key in ("trainable", "lora_rank") if key in inputs}
    if inputs.get("local"):
        if inputs.get("preset") is not None:
            settings["model"] = resolved_model(inputs["preset"], base)
        settings.update({key: inputs[key] for key in PLANNED_DATA_SETTINGS if key in inputs})
        for key in PLANNED_PATHS:
            if key in settings:
                settings[key] = resolved_path(settings[key], base)
    return settings


def cost_configs(model: ModelSpec | str) -> tuple[Any, Any]:
    """(EncoderConfig, LLMConfig) of ``model`` for the planner: its spec's one
    architecture description (:meth:`~dflop.models.spec.ModelSpec.architecture`)."""
    return model_spec(model).architecture()


def quick_profile(
    model: ModelSpec | str,
    *,
    threads: int = 1,
    processes: int = 1,
    seed: int = 0,
    max_units: int = 16,
    max_tokens: int = 1024,
    num_totals: int = 4,
    repeats: int = 3,
    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
) -> Any:
    """A :class:`~dflop.profiling.PerformanceModel` of ``model`` on this CPU, measured in a
    few seconds (fewer repeats and shapes than ``dflop profile-model``): its spec's whole
    encoder and LLM (:meth:`~dflop.models.spec.ModelSpec.whole_module`): LLM microbatches
    of ``max_tokens`` tokens and ``num_totals - 1`` halvings of it, packed several ways
    (:func:`~dflop.profiling.default_seq_len_mixes`).

    ``processes``: local processes that measure at once, each a share of the shapes with
    ``threads`` threads, as the run's ranks will compute side by side on this machine's
    cores; the profile takes about ``1 / processes`` of the time. The shares are balanced
    on the analytic cost model's estimate of each shape. More than one needs ``model`` by
    name (a preset or ``"hf:PATH"``, which each process loads) and the fork-server start
    method; otherwise one process measures everything, in this one."""
    from dflop.profiling import (
        default_seq_len_mixes,
        default_unit_counts,
        fit_performance_model,
        merge_profiles,
    )
    from dflop.profiling.model_profiler import DEFAULT_FROZEN_SHAPES, DEFAULT_TARGET_FRACTIONS

    spec = model_spec(model)
    units = default_unit_counts(max_units)
    mixes = default_seq_len_mixes(min(max_tokens, spec.max_seq_len), num_totals=num_totals)
    fractions = [
        DEFAULT_TARGET_FRACTIONS[i % len(DEFAULT_TARGET_FRACTIONS)] for i in range(len(mixes))
    ]
    options = dict(threads=threads, seed=seed, repeats=repeats, loss_chunk_tokens=loss_chunk_tokens)
    import multiprocessing

    parallel = isinstance(model, str) and "forkserver" in multiprocessing.get_all_start_methods()
    processes = max(1, min(int(processes), len(units) + len(mixes))) if parallel else 1
    if processes == 1:
        share = (list(range(len(units))), list(range(len(mixes))))
        result, unit_tokens = _profile_share_of(
            spec, units, mixes, fractions, share, frozen_shapes=DEFAULT_FROZEN_SHAPES, **options
        )
        return per_token(fit_performance_model(result, seed=seed), unit_tokens)
    from dflop.profiling import ProfileResult
    from dflop.runtime.launch import spawn_local

    shares = _balanced_shares(spec, units, mixes, fractions, processes)
    frozen = -(-DEFAULT_FROZEN_SHAPES // processes)  # each share's part of the default
    parts = spawn_local(
        _profile_process,
        processes,
        args=(model, units, mixes, fractions, shares, {**options, "frozen_shapes": frozen}),
        timeout_s=_PROFILE_TIMEOUT_S,
        num_threads=threads,
    )
    result = merge_profiles(
        [ProfileResult.from_dict(data) for data, _ in parts],
        [share[0] for share in shares],
        [share[1] for share in shares],
    )
    unit_tokens = next((tokens for (data, tokens), share in zip(parts, shares) if share[0]), None)
    return per_token(fit_performance_model(result, seed=seed), unit_tokens)


_PROFILE_TIMEOUT_S = 24 * 3600.0
"""A profile's processes do not communicate: a limit against a stuck kernel only."""


def _profile_share_of(
    spec: ModelSpec,
    units: list[int],
    mixes: list[tuple[int, ...]],
    fractions: list[float],
    share: tuple[list[int], list[int]],
    *,
    threads: int,
    seed: int,
    repeats: int,
    loss_chunk_tokens: int,
    frozen_shapes: int,
) -> tuple[Any, int | None]:
    """The profile of the encoder's unit counts and the LLM's mixes at the grid positions
    in ``share`` (each mix with its own target share), and the profiled unit's tokens."""
    from dflop.profiling import profile_model

    unit_share, mix_share = share
    encoder, image_shape, unit_tokens = None, None, None
    if unit_share:
        encoder, image_shape, unit_tokens = spec.profiled_encoder(seed=seed)
    result = profile_model(
        encoder,
        spec.whole_module("llm", seed=seed) if mix_share else None,
        device="cpu",
        image_shape=image_shape,
        vocab_size=spec.architecture()[1].vocab_size,
        unit_counts=[units[i] for i in unit_share] or None,
        seq_len_mixes=[mixes[i] for i in mix_share] or None,
        target_fractions=[fractions[i] for i in mix_share] or fractions,
        warmup=1,
        repeats=repeats,
        seed=seed,
        num_threads=threads,
        measure_memory=True,
        loss_chunk_tokens=loss_chunk_tokens,
        frozen_shapes=frozen_shapes,
    )
    return result, unit_tokens


def _profile_process(
    rank: int,
    world_size: int,
    model: str,
    units: list[int],
    mixes: list[tuple[int, ...]],
    fractions: list[float],
    shares: list[tuple[list[int], list[int]]],
    options: dict[str, Any],
) -> tuple[dict[str, Any], int | None]:
    """One process of a parallel :func:`quick_profile`: its share, as a dict."""
    result, unit_tokens = _profile_share_of(
        model_spec(model), units, mixes, fractions, shares[rank], **options
    )
    return result.to_dict(), unit_tokens


def _balanced_shares(
    spec: ModelSpec,
    units: list[int],
    mixes: list[tuple[int, ...]],
    fractions: list[float],
    processes: int,
) -> list[tuple[list[int], list[int]]]:
    """Grid positions of the unit counts and mixes each process measures: every shape,
    heaviest first, to the process with the least estimated work so far (the analytic
    cost model's seconds; deterministic)."""
    from dflop.profiling.model_profiler import _target_lens

    estimate = analytic_performance_model(spec)
    enc, llm = estimate.encoder, estimate.llm
    jobs = [(enc.per_unit_s * u + enc.constant_s, 0, i) for i, u in enumerate(units)]
    for i, mix in enumerate(mixes):
        targets = sum(_target_lens(mix, fractions[i]))
        seconds = (
            llm.per_token_s * sum(mix)
            + llm.per_token_sq_s * sum(s * s for s in mix)
            + llm.per_target_token_s * targets
            + llm.constant_s
        )
        jobs.append((seconds, 1, i))
    load = [0.0] * processes
    shares: list[tuple[list[int], list[int]]] = [([], []) for _ in range(processes)]
    for seconds, module, i in sorted(jobs, key=lambda job: (-job[0], job[1], job[2])):
        k = min(range(processes), key=lambda p: (load[p], p))
        load[k] += seconds
        shares[k][module].append(i)
    return [(sorted(u), sorted(m)) for u, m in shares]


def profiled_tokens(seq_lens: Any) -> tuple[int, int]:
    """``(max_tokens, num_totals)`` of a quick profile for data of these sequence lengths:
    the LLM microbatches reach the data's 99th percentile (a power of two, 1,024 to
    4,096 tokens), so the attention term, quadratic in the length, is measured where the
    data needs it rather than extrapolated from short sequences; longer grids drop their
    smallest total to keep the profile's time."""
    lens = np.asarray(seq_lens, dtype=np.float64)
    longest = float(np.quantile(lens, 0.99)) if lens.size else 0.0
    tokens = 1024
    while tokens < min(longest, 4096):
        tokens *= 2
    return tokens, 4 if tokens == 1024 else 3


NOMINAL_CPU_FLOPS = 2e10
"""FLOP/s one local process is assumed to reach in :func:`analytic_performance_model`."""


def analytic_performance_model(
    model: ModelSpec | str, flops_per_s: float = NOMINAL_CPU_FLOPS
) -> Any:
    """A :class:`~dflop.profiling.PerformanceModel` of ``model`` from its FLOP counts (the
    analytic cost model's formulas) at a nominal rate, with no timing: the same on every
    machine and run, as ``--deterministic`` needs. Relative costs (which samples are heavy,
    encoder vs LLM) follow the architecture; absolute times are nominal, plus 1 ms per
    microbatch and module."""
    from dflop.profiling import PerformanceModel
    from dflop.profiling.perf_model import EncoderTimeCoefficients, LLMTimeCoefficients

    spec = model_spec(model)
    encoder, llm = spec.architecture()
    train = 3.0 / float(flops_per_s)  # forward + backward (2x forward)
    # Units of any size (a patch-sequence encoder): priced per 1,024 tokens.
    unit_tokens = encoder.tokens_per_unit if spec.tokens_per_unit else 1024
    tokens = np.array([unit_tokens])
    per_unit = float(encoder.forward_flops(np.ones(1), tokens, llm.hidden_size)[0])
    _, attention = llm.forward_flops_parts(np.ones(1))
    perf = PerformanceModel(
        encoder=EncoderTimeCoefficients(per_unit_s=per_unit * train, constant_s=1e-3),
        llm=LLMTimeCoefficients(
            per_token_s=float(llm.linear_flops_per_token) * train,
            per_token_sq_s=float(attention[0]) * train,
            per_target_token_s=float(llm.head_flops_per_target) * train,
            constant_s=1e-3,
        ),
        tokens_per_unit=int(unit_tokens),
        metadata={"source": "analytic", "flops_per_s": float(flops_per_s)},
    )
    return per_token(perf, None if spec.tokens_per_unit else unit_tokens)


def per_token(perf: Any, unit_tokens: int | None) -> Any:
    """``perf`` of a patch-sequence encoder profiled on units of ``unit_tokens`` tokens:
    its encoder time is per that many tokens (None: unchanged)."""
    from dataclasses import replace

    if unit_tokens is None:
        return perf
    return replace(perf, tokens_per_unit=int(unit_tokens), encoder_per_token=True)


@dataclass(frozen=True)
class Calibration:
    """What a short run of the real runtime measured on this machine: the performance
    model corrected from the measured action times, the per-transfer latency that the
    step model needs to reproduce the measured steps, and the forward shares."""

    performance_model: Any
    link_latency_s: float
    forward_fraction: tuple[float, float]


RUNTIME_ELEMENT_BYTES = 4
"""dflop's runtime trains in float32 (weights, gradients, activations, Adam states) and
keeps every optimizer state on its rank."""

LOCAL_PLAN_BATCHES = 16
"""Global batches a local plan is scored on (the cluster planner's default is 4): on a
small or varied dataset four batches' mean step is 10-15% off the run's, and a local
plan, which searches few layouts, can afford more."""


def _local_planning(
    nproc: int,
    seed: int,
    budget: MemoryBudget | None,
    calibration: Calibration | None,
    loss_chunk_tokens: int,
    trainable: str = "full",
    lora_rank: int = 16,
    **config: Any,
) -> tuple[Any, Any]:
    """(cluster, PlannerConfig) for local processes, calibrated when given: what dflop's
    runtime runs (fp32 weights and Adam, no optimizer sharding, the run's chunked loss)."""
    latency = None if calibration is None else calibration.link_latency_s
    cluster = local_cluster(nproc, budget, link_latency_s=latency)
    if calibration is not None:
        config["forward_fraction"] = calibration.forward_fraction
    return cluster, runtime_planner_config(
        loss_chunk_tokens,
        trainable=trainable,
        lora_rank=lora_rank,
        seed=seed,
        max_tp=1,
        baseline=False,
        num_batches=LOCAL_PLAN_BATCHES,
        **config,
    )


def runtime_planner_config(loss_chunk_tokens: int, **settings: Any) -> Any:
    """A :class:`~dflop.planner.PlannerConfig` of what dflop's runtime executes (float32
    training, no optimizer sharding, the run's chunked loss), with ``settings``."""
    from dflop.planner import PlannerConfig

    return PlannerConfig(
        element_bytes=RUNTIME_ELEMENT_BYTES,
        zero1=False,
        loss_chunk_tokens=loss_chunk_tokens,
        **settings,
    )


def evaluate_local(
    cost_model: Any,
    model: ModelSpec | str,
    layout: RuntimeLayout,
    shapes: Any,
    *,
    seed: int = 0,
    budget: MemoryBudget | None = None,
    calibration: Calibration | None = None,
    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    trainable: str = "full",
    lora_rank: int = 16,
) -> Any:
    """A :class:`~dflop.planner.Plan` holding one given layout for its local processes,
    scored and audited as the planner scores its own choices (to force a layout): with
    the schedules the trainer computes (``runtime_scored``). ``shapes``: as for
    :func:`plan_local`."""
    from dflop.planner import Plan, evaluate_layout, prepare_inputs, runtime_scored

    encoder, llm = cost_configs(model)
    cluster, config = _local_planning(
        layout.world_size, seed, budget, calibration, loss_chunk_tokens, trainable, lora_rank
    )
    inputs = prepare_inputs(
        cost_model,
        encoder,
        llm,
        global_batch=layout.global_batch,
        shapes=shapes,
        num_batches=config.num_batches,
        seed=seed,
        forward_fraction=config.forward_fraction,
        element_bytes=config.element_bytes,
        loss_chunk_tokens=config.loss_chunk_tokens,
        trainable=config.trainable,
        lora_rank=config.lora_rank,
    )
    scored = evaluate_layout(cluster, inputs, core_layout(layout), config)
    return Plan(
        cluster=cluster,
        global_batch=layout.global_batch,
        layouts=[runtime_scored(cluster, inputs, scored, config)],
        inputs={"forward_fraction": list(inputs.forward_fraction), "trainable": config.trainable},
    )


@dataclass(frozen=True)
class LocalPlan:
    """The planner's answer for the local processes."""

    layout: RuntimeLayout
    description: str
    predicted_step_time_s: float
    plan: Any


def plan_local(
    cost_model: Any,
    model: ModelSpec | str,
    nproc: int,
    global_batch: int,
    shapes: Any,
    *,
    seed: int = 0,
    num_microbatches: int | None = None,
    budget: MemoryBudget | None = None,
    calibration: Calibration | None = None,
    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    trainable: str = "full",
    lora_rank: int = 16,
    placement: str = "any",
) -> LocalPlan:
    """Plan ``model`` on ``nproc`` local processes with ``dflop.planner.plan``.

    ``shapes``: the run's steps (a :class:`~dflop.train.data.StepShapes`: the plan is
    scored on its first :data:`LOCAL_PLAN_BATCHES` steps, the batches the run trains on),
    or a distribution with ``.sample(n, seed)`` of the scaled shapes the model is trained
    on. ``num_microbatches`` restricts the planner's choice of m. A
    ``calibration`` (a short run's measurements) sets the link latency and forward shares.
    ``trainable``: the run's training regime (:class:`~dflop.models.trainable.TrainableParts`).
    ``placement``: where the encoder may go: ``"any"``, ``"disaggregated"`` (ranks of its
    own) or ``"colocated"`` (inside the LLM's first stage).
    """
    from dflop.planner import plan
    from dflop.planner.model import placement_candidates

    encoder, llm = cost_configs(model)
    choices = None if num_microbatches is None else (int(num_microbatches),)
    if choices is None:
        choices = tuple(m for m in (1, 2, 3, 4, 6, 8, 12, 16) if m <= global_batch)
    cluster, config = _local_planning(
        nproc,
        seed,
        budget,
        calibration,
        loss_chunk_tokens,
        trainable,
        lora_rank,
        microbatch_choices=choices,
        top_k=20,
        **placement_candidates(placement),
    )
    result = plan(
        cost_model, encoder, llm, cluster, global_batch=global_batch, shapes=shapes, config=config
    )
    # Every local process used, and a layout the runtime runs (no padded heads).
    usable = [
        lp
        for lp in result.layouts
        if lp.encoder.num_gpus + lp.llm.num_gpus == nproc
        and not (lp.colocated and lp.encoder.padded_heads)
    ]
    if not usable:
        raise ValueError(
            f"the planner found no {'' if placement == 'any' else placement + ' '}layout the "
            f"runtime runs over {nproc} processes (found: "
            f"{[lp.describe() for lp in result.layouts]}); pass a layout "
            "(--layout enc_dp=1,llm_pp=1)"
        )
    best = usable[0]
    layout = runtime_layout(best, global_batch=global_batch)
    return LocalPlan(layout, best.describe("processes"), best.prediction.step_time_s, result)


CPU_MEMORY_SHARE = 0.8
"""Local CPU processes: the share of this host's RAM they may use together (the rest: the
system, the launcher, the interpreters); each gets ``share / processes`` of it."""

GPU_MEMORY_RESERVE = 0.08
"""A GPU rank: the share of the device's memory kept free (CUDA context, NCCL buffers,
the allocator's fragmentation), at least 1 GB."""


@dataclass(frozen=True)
class MemoryBudget:
    """The memory one local rank may use: ``memory_bytes``, of which ``reserve_bytes`` are
    kept free (the planner's ``memory_reserve_bytes``), and where the figure comes from."""

    memory_bytes: float
    reserve_bytes: float
    source: str

    def describe(self) -> str:
        usable = (self.memory_bytes - self.reserve_bytes) / 1e9
        return f"{usable:.1f} GB per process ({self.source})"


def memory_budget(nproc: int, device: str = "cpu", memory_gb: float | None = None) -> MemoryBudget:
    """What each of ``nproc`` local ranks may hold on ``device`` (``"cpu"`` or
    ``"cuda"``): ``memory_gb`` when given (``TrainConfig.memory_gb``); else on a CPU
    :data:`CPU_MEMORY_SHARE` of this host's RAM split evenly; on GPUs the device's memory
    (shared by the ranks a GPU holds) less :data:`GPU_MEMORY_RESERVE`."""
    if memory_gb is not None:
        return MemoryBudget(float(memory_gb) * 1e9, 0.0, f"--memory-gb {memory_gb:g}")
    if device == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        ranks = -(-nproc // max(torch.cuda.device_count(), 1))
        total = float(props.total_memory) / ranks
        reserve = max(1e9, GPU_MEMORY_RESERVE * total)
        shared = f", shared by {ranks} ranks" if ranks > 1 else ""
        return MemoryBudget(
            total,
            reserve,
            f"{props.name}'s {props.total_memory / 1e9:.1f} GB{shared}, less a "
            f"{reserve / 1e9:.1f} GB reserve; set --memory-gb to change",
        )
    host = _host_memory_bytes()
    return MemoryBudget(
        CPU_MEMORY_SHARE * host / nproc,
        0.0,
        f"{CPU_MEMORY_SHARE:.0%} of this host's {host / 1e9:.1f} GB of RAM over {nproc} "
        "processes; set --memory-gb to change",
    )


def local_cluster(
    nproc: int, budget: MemoryBudget | None = None, link_latency_s: float | None = None
) -> Any:
    """The planner's "cluster" of ``nproc`` local processes: one node, each with the
    memory of ``budget`` (default: :func:`memory_budget` on the CPU), shared-memory links,
    gloo's loopback latency (or a calibrated one)."""
    from dflop.planner import ClusterSpec

    budget = budget or memory_budget(nproc)
    return ClusterSpec(
        num_gpus=max(2, nproc),
        gpus_per_node=max(2, nproc),
        gpu_memory_bytes=float(budget.memory_bytes),
        intra_node_bandwidth_bytes_per_s=5e9,  # shared memory between local processes
        inter_node_bandwidth_bytes_per_s=5e9,
        link_latency_s=1e-4 if link_latency_s is None else float(link_latency_s),
        memory_reserve_bytes=float(budget.reserve_bytes),
    )


def core_layout(layout: RuntimeLayout) -> dict[str, Any]:
    """A runtime layout in the planner core's form (``LayoutPlan.core_dict()``): encoder
    ranks first, then the LLM's (a colocated layout: the LLM's from rank 0)."""

    def module(part: ModuleLayout, first_rank: int) -> dict[str, Any]:
        return {
            "tp": part.tp,
            "pp": part.pp,
            "dp": part.dp,
            "first_rank": first_rank,
            "layers_per_stage": [end - start for start, end in part.layer_ranges],
            "recompute": part.recompute,
            "virtual_stages": part.virtual_stages,
        }

    encoder = layout.encoder
    return {
        "colocated": layout.colocated,
        "encoder": module(encoder, 0),
        "llm": module(layout.llm, 0 if layout.colocated else encoder.num_gpus),
        "num_microbatches": layout.num_microbatches,
        "order": layout.order,
    }


def default_layout(model: ModelSpec | str, nproc: int, global_batch: int, m: int) -> RuntimeLayout:
    """Fallback without the planner: one encoder process, the others LLM pipeline stages."""
    llm_pp = nproc - 1
    spec = model_spec(model)
    return RuntimeLayout(
        encoder=ModuleLayout(1, 1, 1, uniform_layer_ranges(spec.encoder_layers, 1)),
        llm=ModuleLayout(1, llm_pp, 1, uniform_layer_ranges(spec.llm_layers, llm_pp)),
        num_microbatches=m,
        global_batch=global_batch,
    )


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9
