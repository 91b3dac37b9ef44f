"""The embedded demos (no dataset, no GPU).

- :func:`run_full_demo` (``dflop demo``, the main job): profile the model on this CPU,
  profile the synthetic data, plan for two local processes (the planner's choice: an
  encoder stage and an LLM stage, or both processes colocated), then train a few dozen steps, every step both with dflop's scheduling and
  data-blind on the same weights and batch; print the comparison and write the measured
  timelines.
- :func:`run_demo` (``dflop demo --scheduler-only``): dflop's scheduler against a
  data-blind split on synthetic steps priced by the analytic FLOP cost model of a large
  model (no training).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import TextIO

import numpy as np

from dflop.data import AnalyticCostModel, synthetic_shapes
from dflop.scheduling.balance import data_blind_schedule, schedule

__all__ = ["DemoConfig", "DemoStep", "FullDemoConfig", "run_demo", "run_full_demo"]


@dataclass(frozen=True)
class DemoConfig:
    num_steps: int = 20
    global_batch: int = 256
    num_microbatches: int = 8
    dp_size: int = 4
    encoder: str = "siglip-400m"
    llm: str = "llm-7b"
    seed: int = 0
    time_budget_ms: float | None = None

    def validate(self) -> None:
        for name in ("num_steps", "global_batch", "num_microbatches", "dp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name}={getattr(self, name)} must be >= 1")
        num_bins = self.num_microbatches * self.dp_size
        if self.global_batch < num_bins:
            raise ValueError(
                f"DemoConfig.global_batch={self.global_batch} must be >= num_microbatches x "
                f"dp_size = {num_bins} (every microbatch needs a sample on every rank)"
            )


@dataclass(frozen=True)
class DemoStep:
    step: int
    lower_bound_s: float
    blind_max_load_s: float
    dflop_max_load_s: float
    blind_schedule_time_ms: float
    dflop_schedule_time_ms: float

    @property
    def blind_ratio(self) -> float:
        return self.blind_max_load_s / self.lower_bound_s

    @property
    def dflop_ratio(self) -> float:
        return self.dflop_max_load_s / self.lower_bound_s


def run_demo(config: DemoConfig) -> list[DemoStep]:
    """Balance ``config.num_steps`` synthetic global batches both ways."""
    config.validate()
    cost_model = AnalyticCostModel(encoder=config.encoder, llm=config.llm)
    steps = []
    for step in range(config.num_steps):
        shapes = synthetic_shapes(config.global_batch, seed=config.seed * 1_000_003 + step)
        costs = cost_model.costs(shapes)
        start_s = time.perf_counter()
        blind = data_blind_schedule(costs, config.num_microbatches, config.dp_size)
        blind_ms = (time.perf_counter() - start_s) * 1e3
        start_s = time.perf_counter()
        balanced = schedule(
            costs,
            config.num_microbatches,
            config.dp_size,
            seed=config.seed,
            time_budget_ms=config.time_budget_ms,
        )
        dflop_ms = (time.perf_counter() - start_s) * 1e3
        steps.append(
            DemoStep(
                step=step,
                lower_bound_s=balanced.lower_bound,
                blind_max_load_s=blind.makespan,
                dflop_max_load_s=balanced.makespan,
                blind_schedule_time_ms=blind_ms,
                dflop_schedule_time_ms=dflop_ms,
            )
        )
    return steps


def print_demo(config: DemoConfig, steps: list[DemoStep], out: TextIO = sys.stdout) -> None:
    """Per-step and total table: largest bin load (s), lower bound, ratio, time taken."""
    print(
        f"dflop demo: {config.num_steps} steps, global batch {config.global_batch}, "
        f"{config.num_microbatches} microbatches x {config.dp_size} DP ranks, "
        f"{config.encoder} + {config.llm} (analytic FLOP costs, embedded synthetic data)",
        file=out,
    )
    header = (
        f"{'step':>5} {'bound s':>9} {'blind max s':>12} {'ratio':>7} {'ms':>7}"
        f" {'dflop max s':>12} {'ratio':>7} {'ms':>7} {'speed-up':>9}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for s in steps:
        print(
            f"{s.step:>5} {s.lower_bound_s:>9.3f} {s.blind_max_load_s:>12.3f} "
            f"{s.blind_ratio:>7.3f} {s.blind_schedule_time_ms:>7.2f} "
            f"{s.dflop_max_load_s:>12.3f} {s.dflop_ratio:>7.4f} {s.dflop_schedule_time_ms:>7.2f} "
            f"{s.blind_max_load_s / s.dflop_max_load_s:>8.2f}x",
            file=out,
        )
    print("-" * len(header), file=out)
    bound = sum(s.lower_bound_s for s in steps)
    blind = sum(s.blind_max_load_s for s in steps)
    balanced = sum(s.dflop_max_load_s for s in steps)
    blind_ms = sum(s.blind_schedule_time_ms for s in steps)
    dflop_ms = sum(s.dflop_schedule_time_ms for s in steps)
    print(
        f"{'total':>5} {bound:>9.3f} {blind:>12.3f} {blind / bound:>7.3f} {blind_ms:>7.2f} "
        f"{balanced:>12.3f} {balanced / bound:>7.4f} {dflop_ms:>7.2f} {blind / balanced:>8.2f}x",
        file=out,
    )
    worst = max(s.dflop_ratio for s in steps)
    print(
        f"\nThe largest bin load bounds the step (every rank waits for the slowest bin). "
        f"dflop is within {100 * (balanced / bound - 1):.2f}% of the lower bound in total "
        f"(worst step {100 * (worst - 1):.2f}%); the data-blind split is "
        f"{100 * (blind / bound - 1):.1f}% above it.",
        file=out,
    )


def demo_json(config: DemoConfig, steps: list[DemoStep]) -> str:
    rows = [
        {**asdict(s), "blind_ratio": s.blind_ratio, "dflop_ratio": s.dflop_ratio} for s in steps
    ]
    summary = {
        "blind_max_load_s": float(np.sum([s.blind_max_load_s for s in steps])),
        "dflop_max_load_s": float(np.sum([s.dflop_max_load_s for s in steps])),
        "lower_bound_s": float(np.sum([s.lower_bound_s for s in steps])),
    }
    return json.dumps({"config": asdict(config), "steps": rows, "total": summary}, indent=2)


# ---------------------------------------------------------------------------- full demo

DEMO_MIX = {"single_image": 0.4, "multi_image": 0.0, "video": 0.1, "text": 0.5}
"""The demo's synthetic mix: LLaVA-OneVision-like samples with a larger text share, so
that some microbatches load the encoder and others the LLM."""
DEMO_SCALER = {
    "max_units_per_sample": 8,
    "unit_divisor": 2,
    "text_divisor": 1,
    "max_text_tokens": 512,
}
"""ShapeScaler settings mapping the real shapes onto the small demo model."""


@dataclass(frozen=True)
class FullDemoConfig:
    """Settings of :func:`run_full_demo` (errors name the field).

    ``preset`` ``small+tiny`` pairs the small vision tower with the tiny LLM: with the
    tiny tower the encoder costs a few percent of the LLM and no schedule could matter.
    """

    steps: int = 24
    global_batch: int = 24
    num_microbatches: int = 8
    preset: str = "small+tiny"
    out_dir: str = "dflop-demo-out"
    seed: int = 0

    def validate(self) -> None:
        for name in ("steps", "global_batch", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"FullDemoConfig.{name}={getattr(self, name)} must be >= 1")
        if self.global_batch < self.num_microbatches:
            raise ValueError(
                f"FullDemoConfig.global_batch={self.global_batch} must be >= "
                f"num_microbatches={self.num_microbatches}"
            )


def run_full_demo(config: FullDemoConfig, out: TextIO = sys.stdout) -> dict:
    """Profile, plan, train both ways; returns the summary (also in ``out_dir/summary.json``)."""
    import os

    from dflop.commands.demo_figure import paired_steps, write_demo_png
    from dflop.data import ShapeDistribution
    from dflop.models import model_config
    from dflop.profiling import CostModel
    from dflop.train import TrainConfig
    from dflop.train.data import ScaledShapes, StepShapes
    from dflop.train.planning import plan_local, quick_profile
    from dflop.train.run import Prepared, print_summary, run_training

    config.validate()
    model = model_config(config.preset)
    os.makedirs(config.out_dir, exist_ok=True)
    path = lambda name: os.path.join(config.out_dir, name)  # noqa: E731

    def log(text: str) -> None:
        print(text, file=out, flush=True)

    start_s = time.perf_counter()
    # In the 2 processes the run will train on (cores allowing), 1 thread each.
    processes = max(1, min(2, os.cpu_count() or 1))
    log(
        f"[1/4] profiling the {config.preset} model on this CPU ({processes} process(es) x "
        "1 thread, quick) ..."
    )
    perf = quick_profile(config.preset, threads=1, processes=processes, seed=config.seed)
    perf.save(path("perf.json"))
    log(perf.summary())

    log("\n[2/4] profiling the data (embedded synthetic LLaVA-OneVision-like mix) ...")
    step_shapes = StepShapes(
        model, config.global_batch, seed=config.seed, mix=DEMO_MIX, scaler=DEMO_SCALER
    )
    scaled = ScaledShapes(step_shapes).sample(4096, seed=config.seed)
    shapes = ShapeDistribution(samples=scaled, family="llava-ov", source="synthetic demo mix")
    shapes.save(path("shapes.json"))
    counts = ", ".join(f"{k} {v}" for k, v in shapes.modality_counts().items() if v)
    log(
        f"4096 samples ({counts}); scaled to the model: units/sample mean "
        f"{scaled.encoder_units.mean():.1f} (max {scaled.encoder_units.max()}), sequence "
        f"mean {scaled.seq_len.mean():.0f} (max {scaled.seq_len.max()}) tokens"
    )

    log("\n[3/4] planning for 2 local processes ...")
    local = plan_local(
        CostModel(perf),
        model,
        2,
        config.global_batch,
        step_shapes,
        seed=config.seed,
        num_microbatches=config.num_microbatches,
    )
    local.plan.save(path("plan.json"))
    log(f"{local.description}: predicted step {local.predicted_step_time_s:.3f} s")

    log(
        f"\n[4/4] training {config.steps} steps; every step runs with dflop's schedule and "
        "data-blind (same weights, same batch) ..."
    )
    train_config = TrainConfig(
        model=config.preset,
        global_batch=config.global_batch,
        num_microbatches=config.num_microbatches,
        steps=config.steps,
        seed=config.seed,
        scheduler="compare",
        mix=DEMO_MIX,
        scaler=DEMO_SCALER,
        trace=path("timeline.json"),
        trace_steps=config.steps,  # every step: the figure shows a representative one
        log_every=max(1, config.steps // 6),
        progress=False,
        timeout_s=120.0,
    )
    prepared = Prepared(
        local.layout,
        perf.to_dict(),
        None,
        local.description,
        predicted_step_time_s=local.predicted_step_time_s,
        plan=local.plan,
        cluster=local.plan.cluster.to_dict(),
    )
    report = run_training(train_config, log=log, prepared=prepared)
    log("")
    warmup = min(2, config.steps - 1)
    rows = print_summary(report, out=out, warmup=warmup)
    paired = paired_steps(report.metrics, warmup)
    log("\n" + paired.headline())
    figure = None
    if importlib.util.find_spec("matplotlib") is not None:
        figure = path("dflop-vs-blind.png")
        layout = local.layout
        shown = write_demo_png(
            report,
            paired,
            figure,
            layout.encoder_stages,
            trace_steps=config.steps,
            colocated=layout.colocated,
        )
        log(f"wrote {figure}: step {shown + 1} (the median one) under both schedules")
    else:
        log("skipped the figure: matplotlib is not installed (pip install 'dflop[plot]')")
    summary = {
        "config": asdict(config),
        "layout": report.layout,
        "summary": {k: v.to_dict() for k, v in rows.items()},
        "paired_steps": {
            "steps": [int(s) + 1 for s in paired.steps],
            "dflop_step_time_s": paired.dflop_s.tolist(),
            "blind_step_time_s": paired.blind_s.tolist(),
            "median_ratio": float(np.median(paired.ratios)),
        },
        "wall_s": time.perf_counter() - start_s,
    }
    with open(path("summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    log(
        f"\nfiles in {config.out_dir}/: perf.json, shapes.json, plan.json, summary.json, "
        + ("dflop-vs-blind.png, " if figure else "")
        + "timeline-dflop.json and timeline-blind.json (every step; open them in "
        f"ui.perfetto.dev); {summary['wall_s']:.0f} s in total"
    )
    return summary
