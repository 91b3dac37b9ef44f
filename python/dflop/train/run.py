"""Running a training job: prepare (layout, cost model), launch the ranks, write outputs.

- Local (no ``RANK``/``WORLD_SIZE`` in the environment): this process prepares, then
  :func:`~dflop.runtime.launch.spawn_local` starts one process per rank (gloo on CPU;
  NCCL when every rank gets a GPU). A rank that raises, exits or is killed stops the run
  at once with :class:`~dflop.runtime.launch.SpawnError` naming it; nothing hangs.
- torchrun: this process is one rank; rank 0 prepares and broadcasts the layout and the
  performance model, and writes the outputs. Every collective has ``timeout_s``, so a
  rank whose peer died fails (and torchrun tears the job down) instead of waiting forever.

What runs where: on CPU/gloo every layout: encoder and LLM pipeline stages, data-parallel
replicas and tensor parallelism (for correctness: sharding small CPU matmuls only adds
communication, so the planner is told ``max_tp=1`` for local processes). On GPUs the same
code runs with NCCL, one GPU per rank.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from dflop.runtime.topology import RuntimeLayout
from dflop.train.config import TrainConfig, check_local_processes
from dflop.train.metrics import ModeSummary, summarise

__all__ = ["Prepared", "calibrate", "prepare", "print_summary", "run_training", "write_timelines"]


@dataclass
class Prepared:
    """What every rank needs before training: the layout and rank 0's prior cost model,
    and the plan that scored the layout (its prediction and cluster)."""

    layout: RuntimeLayout
    performance_model: dict[str, Any] | None
    distribution: Any
    description: str
    predicted_step_time_s: float = math.nan
    """The plan's predicted step time for this layout (nan without one)."""
    plan: Any = None
    """The :class:`~dflop.planner.Plan` the layout comes from or was scored in."""
    cluster: dict[str, Any] | None = None
    """The planner's cluster (rank 0 predicts every step with it)."""
    forward_fraction: tuple[float, float] | None = None
    """The forward shares the plan was scored with (rank 0 starts from them)."""
    resumed: bool = False
    """The layout and cost model are a resumed run's saved ones."""


def _plan_forward_fraction(plan: Any) -> tuple[float, float] | None:
    """The forward shares ``plan`` was scored with (recorded in ``Plan.inputs``)."""
    value = (plan.inputs or {}).get("forward_fraction") if plan is not None else None
    return None if value is None else (float(value[0]), float(value[1]))


def _threads_per_rank(config: TrainConfig, world_size: int) -> int:
    return config.threads or max(1, (os.cpu_count() or 1) // world_size)


def prepare(
    config: TrainConfig, log: Callable[[str], None] = print, *, launches: bool = True
) -> Prepared:
    """Resolve the data source, the performance model and the layout: a plan file (its
    layout, cluster and, unless ``perf`` is given, the performance model it was made
    with), a manual layout (scored by the planner for the local processes), or the
    planner run for ``nproc`` local processes. A run resuming a checkpoint first compares
    its settings with the checkpoint's (:mod:`dflop.train.resume`): a change it cannot
    honour is a ValueError naming the setting. ``launches``: local processes will run
    (their fork server starts while this prepares)."""
    from dflop.train.metrics import check_loggers
    from dflop.train.resume import check_data, check_layout, check_settings, resume_point

    if launches:
        check_loggers(config)  # W&B's key and server, before profiling and the ranks
    point = resume_point(config.checkpoint_dir)
    if point is not None:
        check_settings(config, point, log)
    prepared = _prepare(config, log, launches)
    fingerprint = getattr(prepared.distribution, "fingerprint", None)
    if fingerprint is not None and config.checkpoint_dir:
        fingerprint()  # once, here: the ranks receive the records with it
    if point is not None:
        check_data(config, prepared.distribution, point, log)
        check_layout(config, prepared.layout, point)
    _check_lora_layout(config, prepared.layout)
    return prepared


def _start_ranks_imports(config: TrainConfig, model: Any) -> None:
    """Local processes: the fork server that will fork the ranks starts now and imports
    what every rank needs (torch, the trainer, the model's code) while this process reads
    the data, profiles and plans."""
    if _under_torchrun() or config.launch == "threads":
        return
    from dflop.runtime.launch import start_fork_server

    model_class = getattr(model, "model_class", None)  # a Hugging Face family's model
    start_fork_server(
        [
            __name__,
            "dflop.train.trainer",
            type(model).__module__,
            *([model_class.__module__] if model_class is not None else []),
        ]
    )


def _with_order(layout: RuntimeLayout, config: TrainConfig) -> RuntimeLayout:
    """``layout`` under ``--pipeline-order`` (unchanged without it); a ValueError naming the
    flag when the order cannot run the layout (zb-h1 with llm_v > 1)."""
    from dataclasses import replace

    if config.pipeline_order is None:
        return layout
    try:
        return replace(layout, order=config.pipeline_order)
    except ValueError as error:
        raise ValueError(f"--pipeline-order {config.pipeline_order}: {error}") from None


def _check_lora_layout(config: TrainConfig, layout: RuntimeLayout) -> None:
    """LoRA dropout on a tensor-parallel module would draw a different mask on each TP
    rank: say so before any process starts."""
    parts = config.trainable_parts()
    for module in ("encoder", "llm"):
        tp = layout.module(module).tp
        if parts.mode(module) == "lora" and tp > 1 and parts.lora.dropout > 0:
            raise ValueError(
                f"--lora-dropout {parts.lora.dropout}: LoRA dropout on a tensor-parallel "
                f"{module} ({module} tp={tp}) is not supported (each TP rank would draw its "
                f"own mask); use --lora-dropout 0 or a layout with {module} tp 1"
            )


def _prepare(config: TrainConfig, log: Callable[[str], None], launches: bool) -> Prepared:
    from dflop.data.reader import RecordSet
    from dflop.models.registry import model_spec
    from dflop.planner import Plan
    from dflop.train.data import StepShapes, describe_records, length_policy, load_distribution
    from dflop.train.planning import (
        check_local_global_batch,
        evaluate_local,
        layout_from_plan,
        local_cluster,
        memory_budget,
        parse_layout,
        plan_local,
    )

    if config.global_batch is not None:
        check_local_global_batch(config.global_batch)
    model = model_spec(config.model)
    if launches:
        _start_ranks_imports(config, model)
    length = length_policy(model, config.max_seq_len, config.too_long)
    distribution = load_distribution(
        config.data,
        config.family,
        image_folder=config.image_folder,
        video_folder=config.video_folder,
        model=model,
        length=length,
        allow_outside_paths=config.allow_outside_paths,
    )
    if isinstance(distribution, RecordSet):
        account, poor = describe_records(distribution)
        if len(distribution) == 0:
            raise ValueError(f"TrainConfig.data={config.data!r}: {_why_empty(distribution)}")
        log(account)
        if poor:
            log(
                "warning: most of the dataset is unusable or it has no visual sample left: "
                "the run will not exercise the encoder as the data intends"
            )
    forced = (  # a manual layout, parsed once
        _with_order(
            parse_layout(config.layout, model, config.global_batch or 16, config.num_microbatches),
            config,
        )
        if config.layout is not None
        else None
    )
    if forced is not None and not _under_torchrun():
        # Refused before any profiling: a layout too big to start here.
        check_local_processes(forced.world_size, config.oversubscribe)
    saved = _saved_run(config, log)
    if saved is not None:
        saved["layout"] = _with_order(saved["layout"], config)
        return Prepared(distribution=distribution, **saved)
    plan_file = Plan.load(config.plan) if config.plan is not None else None
    if plan_file is not None:  # checked in full before any profiling
        _check_plan_inputs(plan_file, config, log)
        layout = layout_from_plan(config.plan, model, config.global_batch, config.num_microbatches)
        if config.pipeline_order is not None and _with_order(layout, config) != layout:
            layout = _with_order(layout, config)
            log(
                f"note: --pipeline-order {layout.order} replaces the plan's "
                f"{plan_file.best.pipeline_order}; its prediction was for that order"
            )
    perf = None
    if "dflop" in config.modes or plan_file is None:
        seq_lens = distribution.distribution.samples.seq_len if model.family else ()
        perf = _performance_model(config, plan_file, model, config.nproc or 2, log, seq_lens)
    if plan_file is not None:
        best = plan_file.best
        same = (layout.global_batch, layout.num_microbatches, layout.pipeline_order) == (
            best.global_batch,
            best.num_microbatches,
            best.pipeline_order,
        )
        return Prepared(
            layout=layout,
            performance_model=perf.to_dict() if perf is not None else None,
            distribution=distribution,
            description=f"plan {config.plan}",
            predicted_step_time_s=best.prediction.step_time_s if same else math.nan,
            plan=plan_file,
            cluster=plan_file.cluster.to_dict(),
            forward_fraction=_plan_forward_fraction(plan_file),
        )
    global_batch = config.global_batch or 16
    # The plan is scored on the run's own first steps (the batches it will train on).
    shapes = StepShapes(
        model,
        global_batch,
        seed=config.seed,
        distribution=distribution,
        family=config.family,
        mix=config.mix,
        scaler=config.scaler,
        length=length,
    )

    nproc = forced.world_size if forced is not None else config.nproc or 2
    budget = memory_budget(nproc, _planning_device(config), config.memory_gb)

    def local_plan(calibration: Any = None, data: Any = shapes) -> tuple[RuntimeLayout, Any, str]:
        """(layout, plan, description): the forced layout scored, or the planner's choice,
        for the run's steps (``data``: other shapes, to find what fits)."""
        from dflop.profiling import CostModel

        cost_model = CostModel(perf if calibration is None else calibration.performance_model)
        common = {
            "seed": config.seed,
            "calibration": calibration,
            "loss_chunk_tokens": config.loss_chunk_tokens,
            "budget": budget,
            "trainable": config.trainable,
            "lora_rank": config.lora_rank,
        }
        if forced is not None:
            plan = evaluate_local(cost_model, model, forced, data, **common)
            return forced, plan, f"layout {config.layout}"
        local = plan_local(
            cost_model,
            model,
            nproc,
            global_batch,
            data,
            num_microbatches=config.num_microbatches,
            placement=config.placement or "any",
            **common,
        )
        description = f"planned for {nproc} local processes: {local.description}"
        layout = _with_order(local.layout, config)
        if layout != local.layout:  # the planner's layout under the order asked for
            plan = evaluate_local(cost_model, model, layout, data, **common)
            return layout, plan, f"{description}, {layout.order}"
        return local.layout, local.plan, description

    def fitted_plan(calibration: Any = None) -> tuple[RuntimeLayout, Any, str]:
        """:func:`local_plan`, or a ValueError naming what does not fit in memory."""
        from dflop.planner import InfeasibleClusterError
        from dflop.scheduling.balance import InfeasibleError

        try:
            return local_plan(calibration)
        except (InfeasibleClusterError, InfeasibleError) as error:
            raise ValueError(
                _memory_failure(
                    error,
                    budget,
                    distribution,
                    lambda data: local_plan(calibration, data),
                    config,
                    model,
                )
            ) from None

    if perf is None:  # a manual layout run data-blind: nothing to plan with
        layout, plan, description = forced, None, f"layout {config.layout}"
    else:
        layout, plan, description = fitted_plan()
    if plan is not None and config.calibrate_steps:
        calibration = calibrate(config, layout, perf, distribution, log)
        perf = calibration.performance_model
        layout, plan, description = fitted_plan(calibration)
        description += f" (calibrated by {config.calibrate_steps} steps)"
    if config.nproc is not None and config.nproc != layout.world_size:
        raise ValueError(
            f"TrainConfig.nproc={config.nproc} but the layout needs {layout.world_size} "
            f"processes ({description})"
        )
    if plan is not None:
        plan.inputs = {**(plan.inputs or {}), **_local_inputs(config, global_batch, perf)}
    return Prepared(
        layout=layout,
        performance_model=perf.to_dict() if perf is not None else None,
        distribution=distribution,
        description=description,
        predicted_step_time_s=plan.best.prediction.step_time_s if plan else math.nan,
        plan=plan,
        cluster=(plan.cluster if plan else local_cluster(layout.world_size, budget)).to_dict(),
        forward_fraction=_plan_forward_fraction(plan),
    )


def _planning_device(config: TrainConfig) -> str:
    """The device the ranks will most likely train on, for their memory budget (before a
    layout is chosen: ``_device_kind`` decides with it)."""
    if config.device == "cpu" or not _torch_may_have_cuda():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 1 else "cpu"


def _torch_may_have_cuda() -> bool:
    """False when the installed torch is a CPU-only build (its ``version.py`` says
    ``cuda = None``), read without importing torch: the launcher plans without torch's
    seconds of import, which its ranks' fork server pays at the same time."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if "torch" in sys.modules or spec is None or not spec.submodule_search_locations:
        return True  # imported already, or not found: torch itself answers
    version = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        with open(version, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return True
    return re.search(r"^cuda\b[^=\n]*=\s*None\s*$", text, re.M) is None


def _memory_failure(
    error: Exception,
    budget: Any,
    distribution: Any,
    plan_for: Any,
    config: TrainConfig,
    model: Any,
) -> str:
    """Why no layout fits this run's memory, naming the settings and the samples: the LM
    head's chunk when its logits take much of the budget, and, with a dataset, the longest
    sequence some layout fits (the run's own steps planned with the samples cut to each
    length, as ``--max-seq-len`` would cut them) and the samples longer than it, with what
    to do about them."""
    from dflop.data.length import LengthPolicy
    from dflop.data.reader import RecordSet
    from dflop.planner.model import logit_bytes
    from dflop.train.data import StepShapes
    from dflop.train.planning import RUNTIME_ELEMENT_BYTES

    head = f"{error}\nmemory: {budget.describe()}"
    vocab = model.architecture()[1].vocab_size
    per_row = vocab * logit_bytes(RUNTIME_ELEMENT_BYTES)
    chunk = config.loss_chunk_tokens
    usable = budget.memory_bytes - budget.reserve_bytes
    if chunk * per_row > 0.25 * usable:  # the head's logits: a chunk a tenth of the budget
        smaller = max(1, 2 ** int(math.log2(max(1.0, 0.1 * usable / per_row))))
        head += (
            f"; the LM head computes {chunk} target tokens at a time (--loss-chunk-tokens), "
            f"{chunk * per_row / 1e9:.2f} GB of logits at a vocabulary of {vocab:,}: "
            f"--loss-chunk-tokens {smaller} holds {smaller * per_row / 1e9:.2f} GB"
        )
    if not isinstance(distribution, RecordSet) or model.family is None:  # scaled shapes
        return head + "; or give each process more (--memory-gb), or use more processes"
    shapes = distribution.distribution.samples
    lengths = np.unique(shapes.seq_len)

    counter = model.dataset_inputs().text_counter()

    def fits(limit: int) -> bool:
        policy = LengthPolicy(max(2, limit), "truncate")
        steps = StepShapes(
            model,
            config.global_batch or 16,
            seed=config.seed,
            distribution=distribution.limited(policy, counter),
            family=config.family,
            mix=config.mix,
            scaler=config.scaler,
            length=policy,
        )
        try:
            plan_for(steps)
        except ValueError:
            return False
        return True

    low, high = 0, len(lengths) - 1  # the longest length that fits: lengths[low - 1]
    if not fits(int(lengths[0])):
        return (
            head + f"; even the shortest samples ({int(lengths[0])} tokens) do not fit: the "
            "model's states and one microbatch need more memory per process (--memory-gb) "
            "or more processes"
        )
    low = 1
    while low <= high:
        mid = (low + high) // 2
        if fits(int(lengths[mid])):
            low = mid + 1
        else:
            high = mid - 1
    limit = int(lengths[low - 1])
    over = np.flatnonzero(shapes.seq_len > limit)
    names = ", ".join(
        f"{distribution.records[int(i)].where} ({int(shapes.seq_len[i])} tokens)" for i in over[:3]
    )
    more = f" and {len(over) - 3} more" if len(over) > 3 else ""
    return (
        head + f"; {len(over)} sample(s) are too long for it: {names}{more}. Layouts fit "
        f"samples of up to {limit} tokens: --max-seq-len {limit} with --too-long truncate "
        "(cut their text), skip (leave them out, counted) or error; or give each process "
        "more memory (--memory-gb)"
    )


_RUN_FILE = "run.json"


def _why_empty(records: Any) -> str:
    """One line: why no record of a dataset can be trained on."""
    dist = records.distribution
    if dist.num_read == 0:
        return "the dataset holds no record"
    reasons = []
    for reason, count in sorted(dist.skipped.items(), key=lambda kv: -kv[1]):
        example = next((e for e in dist.skipped_examples if e["reason"] == reason), None)
        reasons.append(f"{reason} x{count}" + (f": {example['message']}" if example else ""))
    hint = (
        "; image and video paths are relative to --image-folder / --video-folder (default: "
        "the dataset file's folder)"
        if any(r in dist.skipped for r in ("missing_image", "missing_video"))
        else ""
    )
    return f"none of its {dist.num_read} records can be trained on ({'; '.join(reasons)}){hint}"


def _saved_run(config: TrainConfig, log: Callable[[str], None]) -> dict[str, Any] | None:
    """A resumed run's layout and cost model: those the first run chose, saved beside its
    checkpoints (re-planning from a fresh timing profile could choose another layout and
    refuse the run's own checkpoint). Only without --plan/--layout, and only when an
    intact checkpoint is there to resume."""

    from dflop.runtime.topology import RuntimeLayout
    from dflop.train.checkpoint import find_checkpoint

    if not config.checkpoint_dir or config.plan is not None or config.layout is not None:
        return None
    path = os.path.join(config.checkpoint_dir, _RUN_FILE)
    if not os.path.isfile(path):
        return None
    try:  # read and checked in full here: a bad file is named before any process starts
        from dflop.profiling import PerformanceModel
        from dflop.safe_io import load_json, open_regular

        with open_regular(path, "r", "run file") as f:
            saved = load_json(f)
        layout = RuntimeLayout.from_dict(saved["layout"])
        fraction = saved.get("forward_fraction")
        if fraction is not None:
            fraction = tuple(float(share) for share in fraction)
            if len(fraction) != 2 or not all(0 < share < 1 for share in fraction):
                raise ValueError(f"forward_fraction={list(fraction)} must be 2 shares in (0, 1)")
        performance_model = saved.get("performance_model")
        if performance_model is not None:
            PerformanceModel.from_dict(performance_model)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        what = f"missing field {error}" if isinstance(error, KeyError) else str(error)
        raise ValueError(
            f"{path} (the layout and cost model a resumed run reuses) cannot be read: "
            f"{' '.join(what.split())[:300]}; restore it, or resume with --plan or --layout"
        ) from None
    if find_checkpoint(config.checkpoint_dir, layout.world_size, log=lambda m: None) is None:
        return None
    log(f"resuming: the layout and cost model the run chose, from {path}")
    if config.perf:  # honoured: the schedules of the resumed steps use it
        performance_model = PerformanceModel.load(config.perf).to_dict()
    return {
        "layout": layout,
        "performance_model": performance_model,
        "description": f"{saved.get('description', 'saved run')} (resumed)",
        "predicted_step_time_s": float(saved.get("predicted_step_time_s", math.nan)),
        "cluster": saved.get("cluster"),
        "forward_fraction": fraction,
        "resumed": True,
    }


def _save_run(config: TrainConfig, prepared: Prepared) -> None:
    """Write what :func:`_saved_run` reads (a resumed run keeps what it read)."""
    import json

    from dflop.output import write_text

    if not config.checkpoint_dir or prepared.resumed:
        return
    path = os.path.join(config.checkpoint_dir, _RUN_FILE)
    os.makedirs(config.checkpoint_dir, exist_ok=True)
    data = {
        "layout": prepared.layout.to_dict(),
        "performance_model": prepared.performance_model,
        "description": prepared.description,
        "predicted_step_time_s": prepared.predicted_step_time_s,
        "cluster": prepared.cluster,
        "forward_fraction": prepared.forward_fraction,
    }
    write_text(path, json.dumps(data, indent=1, default=float))


def calibrate(
    config: TrainConfig,
    layout: RuntimeLayout,
    perf: Any,
    distribution: Any,
    log: Callable[[str], None] = print,
) -> Any:
    """Run ``config.calibrate_steps`` real training steps of ``layout`` on local processes
    (dflop's schedule, adaptive correction) and return what they measured: a
    :class:`~dflop.train.planning.Calibration`. The weights are thrown away."""
    from dataclasses import replace

    from dflop.profiling import PerformanceModel
    from dflop.train.planning import Calibration, local_cluster

    steps = config.calibrate_steps
    log(f"calibrating: {steps} steps of the layout on {layout.world_size} local processes ...")
    run = replace(
        config,
        steps=steps,
        scheduler="dflop",
        plan=None,
        checkpoint_dir=None,
        trace=None,
        png=None,
        log_every=0,
        progress=False,
        calibrate_steps=0,
        metrics_jsonl="",  # the calibration steps are the plan's, not a run's: no file
    )
    prepared = Prepared(
        layout,
        perf.to_dict(),
        distribution,
        "calibration",
        cluster=local_cluster(layout.world_size).to_dict(),
    )
    report = run_training(run, log=lambda text: None, prepared=prepared)
    stats = report.stats
    latency = stats.get("link_latency_s")
    fractions = stats["forward_fraction"]
    calibration = Calibration(
        performance_model=PerformanceModel.from_dict(report.performance_model),
        link_latency_s=1e-4 if latency is None else float(latency),
        forward_fraction=(float(fractions["encoder"]), float(fractions["llm"])),
    )
    measured = summaries(report)["dflop"]
    log(
        f"calibrated on steps of {measured.step_time_s:.3f} s (simulated "
        f"{measured.predicted_step_time_s:.3f} s): per-transfer latency "
        f"{1e3 * calibration.link_latency_s:.2f} ms, forward "
        f"share encoder {calibration.forward_fraction[0]:.2f} / LLM "
        f"{calibration.forward_fraction[1]:.2f}; corrected "
        + "; ".join(
            line.strip() for line in calibration.performance_model.summary().splitlines()[1:3]
        )
    )
    return calibration


def _performance_model(
    config: TrainConfig,
    plan: Any,
    model: Any,
    nproc: int,
    log: Callable[[str], None],
    seq_lens: Any = (),
) -> Any:
    """``config.perf``, else the model a local plan was made with, else a quick profile
    over the sequence lengths the model trains on (``seq_lens``, the data's as the model
    sees them; none: the default grid)."""
    from dflop.profiling import PerformanceModel
    from dflop.train.planning import profiled_tokens, quick_profile

    if config.perf:
        return PerformanceModel.load(config.perf)
    if plan is not None and plan.inputs.get("performance_model"):
        return PerformanceModel.from_dict(plan.inputs["performance_model"])
    if config.deterministic:
        from dflop.train.planning import analytic_performance_model

        log("deterministic: the analytic cost model (FLOP counts at a nominal rate, no timing)")
        return analytic_performance_model(model)
    threads = _threads_per_rank(config, nproc)
    # As many processes as the ranks will be (cores allowing), each with a rank's threads.
    processes = max(1, min(nproc, (os.cpu_count() or 1) // threads))
    log(f"profiling {config.model} on this CPU ({processes} process(es) x {threads} thread(s)) ...")
    tokens, totals = profiled_tokens(seq_lens)
    perf = quick_profile(
        config.model if isinstance(config.model, str) else model,
        threads=threads,
        processes=processes,
        seed=config.seed,
        max_tokens=tokens,
        num_totals=totals,
        loss_chunk_tokens=config.loss_chunk_tokens,
    )
    log(perf.summary())
    return perf


def _local_inputs(config: TrainConfig, global_batch: int, perf: Any) -> dict[str, Any]:
    """What a plan for local processes was made from (``dflop train --plan`` checks it
    and reuses the performance model)."""
    from dflop.train.planning import resolved_model, resolved_path

    return {  # paths absolute: the plan trains from any folder
        "local": True,
        "preset": resolved_model(config.model),
        "data": resolved_path(config.data),
        "image_folder": resolved_path(config.image_folder),
        "video_folder": resolved_path(config.video_folder),
        "family": config.family,
        "mix": config.mix,
        "scaler": config.scaler,
        "seed": config.seed,
        "global_batch": global_batch,
        "performance_model": perf.to_dict() if perf is not None else None,
    }


def _check_plan_inputs(plan: Any, config: TrainConfig, log: Callable[[str], None]) -> None:
    """A plan made for local processes names its model and data: training another model
    is an error, other data makes its prediction meaningless (said, not fatal); so does
    another training regime (any plan)."""
    inputs = plan.inputs
    planned = inputs.get("trainable", "full")  # plans before the setting priced full training
    if planned != config.trainable:
        log(
            f"note: {config.plan} was planned to train {planned}, this run trains "
            f"{config.trainable}: its layout and predicted step time are for the other "
            f"regime (plan again with --trainable {config.trainable})"
        )
    if not inputs.get("local"):
        return
    from dflop.train.planning import (
        PLANNED_DATA_SETTINGS,
        planned_settings,
        resolved_model,
        resolved_path,
    )

    planned = planned_settings(plan, config.plan)  # paths resolved as the plan means them
    if "model" in planned and planned["model"] != resolved_model(config.model):
        raise ValueError(
            f"{config.plan} was planned for the model {inputs['preset']!r}, not "
            f"{config.model!r}: pass --model {planned['model']} (or leave --model out)"
        )
    mine_paths = {
        key: resolved_path(getattr(config, key)) for key in ("data", "image_folder", "video_folder")
    }
    for key in PLANNED_DATA_SETTINGS:
        mine = mine_paths.get(key, getattr(config, key))
        theirs = planned.get(key)
        if key in inputs and theirs != mine and not (key == "scaler" and not mine):
            log(
                f"note: {config.plan} was planned with {key}={theirs!r}, this run uses "
                f"{mine!r}: the plan's predicted step time does not apply"
            )


def _device_for(kind: str, rank: int) -> str:
    if kind == "cuda":
        import torch

        return f"cuda:{rank % torch.cuda.device_count()}"
    return "cpu"


def _device_kind(config: TrainConfig, layout: RuntimeLayout) -> str:
    if config.device == "cpu":
        return "cpu"
    if config.device == "auto" and not _torch_may_have_cuda():
        return "cpu"
    import torch

    available = torch.cuda.is_available() and torch.cuda.device_count() >= 1
    if config.device == "cuda" and not available:
        raise ValueError("TrainConfig.device='cuda' but no CUDA device is available")
    if not available:
        return "cpu"
    # Fewer GPUs than ranks: local NCCL processes need a GPU each, and threads (which
    # share one) run tp=1 layouts only; device=auto then trains on the CPU instead.
    threads_fit = config.launch != "processes" and _threads_can_run(layout)
    if (
        config.device == "auto"
        and torch.cuda.device_count() < layout.world_size
        and not threads_fit
    ):
        return "cpu"
    return "cuda"


def _threads_can_run(layout: RuntimeLayout) -> bool:
    """Thread worlds run tp=1 layouts only (tensor parallelism shards over
    torch.distributed's device mesh)."""
    return max(layout.encoder.tp, layout.llm.tp) == 1


def _launch_kind(config: TrainConfig, device_kind: str, layout: RuntimeLayout) -> str:
    """``"processes"`` or ``"threads"`` (see ``TrainConfig.launch``)."""
    world_size = layout.world_size
    gpus = 0
    if device_kind == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    kind = config.launch
    if kind == "auto":
        kind = "threads" if device_kind == "cuda" and gpus < world_size else "processes"
    if kind == "processes" and device_kind == "cuda" and gpus < world_size:
        raise ValueError(
            f"{world_size} ranks on {gpus} GPU(s): NCCL needs one GPU per process (it refuses "
            "two ranks on one device); set TrainConfig.launch='threads' (--launch threads) "
            "or device='cpu'"
        )
    if kind == "threads" and not _threads_can_run(layout):
        raise ValueError(
            "TrainConfig.launch='threads' runs tp=1 layouts only (tensor parallelism shards "
            "over torch.distributed's device mesh): set launch='processes' or plan with tp=1"
        )
    return kind


def _rank_main(
    rank: int,
    world_size: int,
    config: TrainConfig,
    layout: dict[str, Any],
    perf: dict[str, Any] | None,
    distribution: Any,
    device_kind: str,
    cluster: dict[str, Any] | None = None,
    forward_fraction: tuple[float, float] | None = None,
) -> Any:
    from dflop.runtime.launch import StopRequested
    from dflop.runtime.thread_world import current
    from dflop.train.trainer import Trainer

    StopRequested.install()  # SIGTERM, Ctrl-C: stop cleanly after the current step
    member = current()  # a rank of spawn_threads: every rank on the world's device
    device = member[0].device if member is not None else _device_for(device_kind, rank)
    if config.deterministic:
        import torch

        torch.use_deterministic_algorithms(True)
    trainer = Trainer(
        config,
        RuntimeLayout.from_dict(layout),
        perf,
        device=device,
        distribution=distribution,
        cluster=cluster,
        forward_fraction=forward_fraction,
    )
    return trainer.train()


def run_training(
    config: TrainConfig, log: Callable[[str], None] = print, prepared: Prepared | None = None
) -> Any:
    """Train as configured; returns rank 0's :class:`~dflop.train.trainer.TrainReport`
    (None on other torchrun ranks). Writes the trace/PNG files when configured.
    ``prepared``: a layout and performance model already resolved (local runs only).

    Raises:
        SpawnError: a local rank failed (the message names it and carries its traceback).
    """
    if _under_torchrun():
        return _run_torchrun(config, log)
    with checkpoint_lock(config, log):
        return _run_local(config, log, prepared)


def _under_torchrun() -> bool:
    """This process is one rank of a torchrun job (else a local launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def checkpoint_lock(config: TrainConfig, log: Callable[[str], None] = print) -> Any:
    """The run's exclusive hold on its checkpoint folder (a no-op without one): taken
    before the folder is read, released when the run ends however it ends."""
    from dflop.train.checkpoint import CheckpointLock

    if not config.checkpoint_dir:
        return contextlib.nullcontext()
    return CheckpointLock(config.checkpoint_dir, log)


def _run_local(config: TrainConfig, log: Callable[[str], None], prepared: Prepared | None) -> Any:
    if prepared is None:
        prepared = prepare(config, log)
    layout = prepared.layout
    world_size = layout.world_size
    check_local_processes(world_size, config.oversubscribe)
    _save_run(config, prepared)
    device_kind = _device_kind(config, layout)
    launch_kind = _launch_kind(config, device_kind, layout)
    chunks = layout.llm.virtual_stages
    interleaved = f" x {chunks} virtual stages" if chunks > 1 else ""
    rc = {name: " rc" if layout.module(name).recompute else "" for name in ("encoder", "llm")}
    encoder = (
        "encoder colocated in the first LLM stage"
        if layout.colocated
        else f"encoder tp={layout.encoder.tp} pp={layout.encoder.pp} dp={layout.encoder.dp}"
        f"{rc['encoder']}"
    )
    log(
        f"{prepared.description}: {encoder} | LLM tp={layout.llm.tp} pp={layout.llm.pp}{interleaved} "
        f"dp={layout.llm.dp}{rc['llm']}{' (rc: activation recompute)' if any(rc.values()) else ''} | "
        f"{layout.num_microbatches} microbatches x global batch "
        f"{layout.global_batch} | {world_size} {launch_kind} on {device_kind} | scheduler "
        f"{config.scheduler}, pipeline {layout.pipeline_order} | trains {config.trainable}"
    )
    args = (
        config,
        layout.to_dict(),
        prepared.performance_model,
        prepared.distribution,
        device_kind,
        prepared.cluster,
        prepared.forward_fraction,
    )
    results = LAUNCHERS[launch_kind](config, world_size, device_kind, args)
    report = results[0]
    report.planned_step_time_s = prepared.predicted_step_time_s
    write_timelines(report, config, log)
    return report


def _launch_processes(
    config: TrainConfig, world_size: int, device_kind: str, args: tuple[Any, ...]
) -> list[Any]:
    """One process per rank (gloo on CPU, NCCL with a GPU each)."""
    from dflop.runtime.launch import spawn_local

    return spawn_local(
        _rank_main,
        world_size,
        args=args,
        timeout_s=_run_timeout_s(config),
        backend="nccl" if device_kind == "cuda" else "gloo",
        collective_timeout_s=config.timeout_s,
        num_threads=_threads_per_rank(config, world_size),
        stop_on_interrupt=True,  # Ctrl-C: stop after the step, with a checkpoint
    )


def _launch_threads(
    config: TrainConfig, world_size: int, device_kind: str, args: tuple[Any, ...]
) -> list[Any]:
    """One thread per rank in this process, sharing the first GPU or the CPU."""
    from dflop.runtime.launch import spawn_threads

    if device_kind == "cpu":  # the ranks' threads share the cores' intra-op threads
        import torch

        torch.set_num_threads(_threads_per_rank(config, world_size))
    return spawn_threads(
        _rank_main,
        world_size,
        args=args,
        timeout_s=_run_timeout_s(config),
        device=_device_for(device_kind, 0),
        collective_timeout_s=config.timeout_s,
        stop_on_interrupt=True,
    )


def _run_timeout_s(config: TrainConfig) -> float:
    return config.run_timeout_s or 7 * 24 * 3600.0


LAUNCHERS: dict[str, Callable[[TrainConfig, int, str, tuple[Any, ...]], list[Any]]] = {
    "processes": _launch_processes,
    "threads": _launch_threads,
}
"""How local ranks start (``TrainConfig.launch``): ``(config, world_size, device kind,
rank arguments) -> every rank's result``; :func:`_launch_kind` picks one."""


def _run_torchrun(config: TrainConfig, log: Callable[[str], None]) -> Any:
    from dflop.runtime.launch import StopRequested, init_from_env

    StopRequested.install()  # torchrun passes a SIGTERM on to its workers
    info = init_from_env(timeout_s=config.timeout_s)
    # Rank 0 holds the checkpoint folder for the run (ranks on other nodes share it
    # through the file system; the lock is one per run, not per rank).
    with checkpoint_lock(config, log) if info.rank == 0 else contextlib.nullcontext():
        return _torchrun_rank(config, log, info)


def _torchrun_rank(config: TrainConfig, log: Callable[[str], None], info: Any) -> Any:
    import torch
    import torch.distributed as dist

    from dflop.train.trainer import Trainer

    payload: list[Any] = [None]
    if info.rank == 0:
        prepared = prepare(config, log)
        _save_run(config, prepared)
        payload = [
            (
                prepared.layout.to_dict(),
                prepared.performance_model,
                prepared.distribution,
                prepared.cluster,
                prepared.forward_fraction,
                prepared.predicted_step_time_s,
            )
        ]
    dist.broadcast_object_list(payload, src=0)
    layout, perf, distribution, cluster, forward_fraction, planned = payload[0]
    device = f"cuda:{info.local_rank}" if info.backend == "nccl" else "cpu"
    if device == "cpu" and config.threads:
        torch.set_num_threads(config.threads)
    trainer = Trainer(
        config,
        RuntimeLayout.from_dict(layout),
        perf,
        device=device,
        distribution=distribution,
        cluster=cluster,
        forward_fraction=forward_fraction,
    )
    report = trainer.train()
    if report is not None:
        report.planned_step_time_s = planned
        write_timelines(report, config, log)
    dist.destroy_process_group()
    return report


def timeline_path(path: str, mode: str, config: TrainConfig) -> str:
    """``path`` itself, or with ``-MODE`` before the extension in ``compare`` mode."""
    if len(config.modes) == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}-{mode}{ext}"


def write_timelines(report: Any, config: TrainConfig, log: Callable[[str], None] = print) -> None:
    """The measured timelines of the last steps as Chrome-trace JSON and PNG."""
    from dflop.timeline import make_events, write_chrome_trace, write_gantt_png

    for mode, records in report.timelines.items():
        if not records:
            continue
        events = make_events(records)
        if config.trace:
            path = timeline_path(config.trace, mode, config)
            write_chrome_trace(events, path)
            log(f"wrote {path}")
        if config.png and importlib.util.find_spec("matplotlib") is None:
            log("skipped the PNG timeline: matplotlib is not installed (pip install 'dflop[plot]')")
        elif config.png:
            path = timeline_path(config.png, mode, config)
            title = f"measured: last {config.trace_steps} step(s), {mode} schedule"
            write_gantt_png(events, path, title=title)
            log(f"wrote {path}")


def summaries(report: Any, warmup: int = 1) -> dict[str, ModeSummary]:
    modes = list(dict.fromkeys(m.mode for m in report.metrics))
    return {mode: summarise(report.metrics, mode, warmup=warmup) for mode in modes}


def print_summary(report: Any, out: Any = None, warmup: int = 1) -> dict[str, ModeSummary]:
    """Per-mode means (step time, idle share, throughput) and, with both modes, dflop's
    reductions over the data-blind split."""
    out = out or sys.stdout
    if not report.metrics:
        print("no steps were run (the checkpoint is already at --steps)", file=out)
        return {}
    rows = summaries(report, warmup)
    num_stages = len(next(iter(rows.values())).busy_share)
    busy_head = " ".join(f"{'busy s' + str(s):>8}" for s in range(num_stages))
    header = (
        f"{'scheduler':<9} {'steps':>5} {'step s':>8} {'sim s':>8} {'idle':>6} "
        f"{'samples/s':>10} {'tokens/s':>10} {busy_head} {'loss':>8}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for s in rows.values():
        busy = " ".join(f"{100 * b:>7.0f}%" for b in s.busy_share)
        sim = "" if math.isnan(s.predicted_step_time_s) else f"{s.predicted_step_time_s:.3f}"
        print(
            f"{s.mode:<9} {s.num_steps:>5} {s.step_time_s:>8.3f} {sim:>8} "
            f"{100 * s.idle_share:>5.1f}% {s.samples_per_s:>10.1f} {s.tokens_per_s:>10,.0f} "
            f"{busy} {s.final_loss:>8.4f}",
            file=out,
        )
    if "dflop" in rows and "blind" in rows:
        d, b = rows["dflop"], rows["blind"]
        print(
            f"\ndflop vs data-blind on the same steps: step time "
            f"{100 * (1 - d.step_time_s / b.step_time_s):.1f}% shorter, idle time "
            f"{100 * (1 - d.idle_s / b.idle_s):.1f}% lower, throughput "
            f"{d.samples_per_s / b.samples_per_s:.2f}x",
            file=out,
        )
    for s in rows.values():
        if not math.isnan(s.prediction_error):
            print(
                f"simulator vs measured ({s.mode}): predicted {s.predicted_step_time_s:.3f} s, "
                f"measured {s.step_time_s:.3f} s ({100 * s.prediction_error:.1f}% off)",
                file=out,
            )
    planned = getattr(report, "planned_step_time_s", math.nan)
    d = rows.get("dflop")
    if d is not None and not math.isnan(d.plan_model_step_time_s):
        # The plan's uncorrected model on the measured steps: the plan's own figure is a
        # mean over the batches it was scored on, which a short run need not match.
        mean = "" if math.isnan(planned) else f"; the plan's mean over its batches: {planned:.3f} s"
        print(
            f"plan vs measured (dflop): the plan's model predicted "
            f"{d.plan_model_step_time_s:.3f} s for these steps, measured {d.step_time_s:.3f} s "
            f"({100 * d.plan_prediction_error:.1f}% off){mean}",
            file=out,
        )
    return rows
