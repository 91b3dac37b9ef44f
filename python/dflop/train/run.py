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

import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from dflop.runtime.topology import RuntimeLayout
from dflop.train.config import TrainConfig
from dflop.train.metrics import ModeSummary, summarise

__all__ = ["Prepared", "prepare", "print_summary", "run_training", "write_timelines"]


@dataclass
class Prepared:
    """What every rank needs before training: the layout and rank 0's prior cost model."""

    layout: RuntimeLayout
    performance_model: dict[str, Any] | None
    distribution: Any
    description: str
    predicted_step_time_s: float = math.nan


def _threads_per_rank(config: TrainConfig, world_size: int) -> int:
    return config.threads or max(1, (os.cpu_count() or 1) // world_size)


def prepare(config: TrainConfig, log: Callable[[str], None] = print) -> Prepared:
    """Resolve the data source, the performance model (file or quick profile) and the
    layout (plan file, manual layout, or the planner for ``nproc`` local processes)."""
    from dflop.models import model_config
    from dflop.train.data import ScaledShapes, StepShapes, load_distribution
    from dflop.train.planning import layout_from_plan, parse_layout, plan_local, quick_profile

    model = model_config(config.model)
    distribution = load_distribution(config.data, config.family)
    auto_plan = config.plan is None and config.layout is None
    nproc = config.nproc or 2
    perf = None
    if "dflop" in config.modes or auto_plan:
        from dflop.profiling import PerformanceModel

        if config.perf:
            perf = PerformanceModel.load(config.perf)
        else:
            threads = _threads_per_rank(config, nproc)
            log(f"profiling {config.model} on this CPU ({threads} thread(s)) ...")
            perf = quick_profile(model, threads=threads, seed=config.seed)
            log(perf.summary())
    if config.plan is not None:
        layout = layout_from_plan(config.plan, model, config.global_batch, config.num_microbatches)
        description = f"plan {config.plan}"
        predicted = math.nan
    elif config.layout is not None:
        layout = parse_layout(
            config.layout, model, config.global_batch or 16, config.num_microbatches
        )
        description = f"layout {config.layout}"
        predicted = math.nan
    else:
        from dflop.profiling import CostModel

        global_batch = config.global_batch or 16
        shapes = ScaledShapes(
            StepShapes(
                model,
                global_batch,
                seed=config.seed,
                distribution=distribution,
                family=config.family,
                mix=config.mix,
                scaler=config.scaler,
            )
        )
        local = plan_local(
            CostModel(perf),
            model,
            nproc,
            global_batch,
            shapes,
            seed=config.seed,
            num_microbatches=config.num_microbatches,
        )
        layout, description, predicted = (
            local.layout,
            local.description,
            local.predicted_step_time_s,
        )
        description = f"planned for {nproc} local processes: {description}"
    if config.nproc is not None and config.nproc != layout.world_size:
        raise ValueError(
            f"TrainConfig.nproc={config.nproc} but the layout needs {layout.world_size} "
            f"processes ({description})"
        )
    return Prepared(
        layout=layout,
        performance_model=perf.to_dict() if perf is not None else None,
        distribution=distribution,
        description=description,
        predicted_step_time_s=predicted,
    )


def _device_for(kind: str, rank: int) -> str:
    if kind == "cuda":
        import torch

        return f"cuda:{rank % torch.cuda.device_count()}"
    return "cpu"


def _device_kind(config: TrainConfig, world_size: int) -> str:
    import torch

    if config.device == "cpu":
        return "cpu"
    available = torch.cuda.is_available() and torch.cuda.device_count() >= 1
    if config.device == "cuda" and not available:
        raise ValueError("TrainConfig.device='cuda' but no CUDA device is available")
    if not available:
        return "cpu"
    if config.device == "auto" and torch.cuda.device_count() < world_size:
        return "cpu"  # local NCCL ranks need a GPU each
    return "cuda"


def _rank_main(
    rank: int,
    world_size: int,
    config: TrainConfig,
    layout: dict[str, Any],
    perf: dict[str, Any] | None,
    distribution: Any,
    device_kind: str,
) -> Any:
    from dflop.train.trainer import Trainer

    trainer = Trainer(
        config,
        RuntimeLayout.from_dict(layout),
        perf,
        device=_device_for(device_kind, rank),
        distribution=distribution,
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
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_torchrun(config, log)
    from dflop.runtime.launch import spawn_local

    if prepared is None:
        prepared = prepare(config, log)
    layout = prepared.layout
    world_size = layout.world_size
    device_kind = _device_kind(config, world_size)
    log(
        f"{prepared.description}: encoder tp={layout.encoder.tp} pp={layout.encoder.pp} "
        f"dp={layout.encoder.dp} | LLM tp={layout.llm.tp} pp={layout.llm.pp} dp={layout.llm.dp} "
        f"| {layout.num_microbatches} microbatches x global batch {layout.global_batch} | "
        f"{world_size} processes on {device_kind} | schedule {config.schedule}"
    )
    results = spawn_local(
        _rank_main,
        world_size,
        args=(
            config,
            layout.to_dict(),
            prepared.performance_model,
            prepared.distribution,
            device_kind,
        ),
        timeout_s=config.run_timeout_s or 7 * 24 * 3600.0,
        backend="nccl" if device_kind == "cuda" else "gloo",
        collective_timeout_s=config.timeout_s,
        num_threads=_threads_per_rank(config, world_size),
    )
    report = results[0]
    write_timelines(report, config, log)
    return report


def _run_torchrun(config: TrainConfig, log: Callable[[str], None]) -> Any:
    import torch
    import torch.distributed as dist

    from dflop.runtime.launch import init_from_env
    from dflop.train.trainer import Trainer

    info = init_from_env(timeout_s=config.timeout_s)
    payload: list[Any] = [None]
    if info.rank == 0:
        prepared = prepare(config, log)
        payload = [(prepared.layout.to_dict(), prepared.performance_model, prepared.distribution)]
    dist.broadcast_object_list(payload, src=0)
    layout, perf, distribution = payload[0]
    device = f"cuda:{info.local_rank}" if info.backend == "nccl" else "cpu"
    if device == "cpu" and config.threads:
        torch.set_num_threads(config.threads)
    trainer = Trainer(
        config, RuntimeLayout.from_dict(layout), perf, device=device, distribution=distribution
    )
    report = trainer.train()
    if report is not None:
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
        f"{'schedule':<9} {'steps':>5} {'step s':>8} {'sim s':>8} {'idle':>6} "
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
    return rows
