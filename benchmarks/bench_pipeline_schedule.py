"""Benchmark ``dflop.pipeline_schedule()``: simulated step of the encoder -> LLM pipeline.

For each setting and batch (seed), draws the embedded synthetic workload (LLaVA-OneVision
mix priced by the analytic cost model), splits each module's cost over its pipeline
stages, and simulates one 1F1B step (``PipelineModel.step_time_s``, the same simulation
for every method) of the schedules of:

- data-blind: equal-count microbatches in dataset order;
- balanced: ``dflop.schedule`` (per-dimension makespan), microbatches in index order;
- balanced + order: the best of the constructive orders (``time_budget_ms=0``);
- pipeline: ``dflop.pipeline_schedule`` with its default budget, and with 100 ms;
- peers (``peers.py``, re-implemented from their descriptions): verl's Karmarkar-Karp
  with a free and with an equal count per bin, and its greedy partition, over each
  sample's summed cost (what a one-dimensional balancer can do with these costs; verl
  balances token counts), microbatches in index order.

Reported per method: the median over batches of step / lower bound, where the lower bound
is the busiest stage's total work (no schedule can finish before every stage has done
its work), the median step reduction against data-blind, and the median solve time.

Settings: the bench_train shape (48 samples, 24 microbatches, one stage each) with its
text-heavy mix; 256 samples over 16 microbatches, 1 + 2 stages; 1,024 samples over 32
microbatches x 4 LLM replicas with an encoder shared by the replicas (a microbatch
dimension), 2 + 4 stages. SigLIP-400M + 7B LLM priced analytically, the encoder's cost
scaled so that both modules carry equal work per stage over the batch (as a planner
sizing the modules' GPU shares aims for).

    python benchmarks/bench_pipeline_schedule.py
    python benchmarks/bench_pipeline_schedule.py --markdown benchmarks/README.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import baselines  # noqa: E402
import dflop  # noqa: E402
import peers  # noqa: E402
from dflop.data import synthetic_costs  # noqa: E402
from dflop.data.synthetic import MixSpec  # noqa: E402


@dataclass(frozen=True)
class Setting:
    name: str
    num_samples: int
    num_microbatches: int
    dp_size: int
    stages: tuple[int, int]
    mix: dict[str, float] | None


SETTINGS = [
    Setting(
        "48 samples / 24 mb, 1+1 stages",
        48,
        24,
        1,
        (1, 1),
        {"single_image": 0.35, "multi_image": 0.0, "video": 0.1, "text": 0.55},
    ),
    Setting("256 samples / 16 mb, 1+2 stages", 256, 16, 1, (1, 2), None),
    Setting("1,024 samples / 32 mb x 4 replicas, 2+4 stages", 1024, 32, 4, (2, 4), None),
]


def stage_costs(setting: Setting, seed: int) -> np.ndarray:
    """(N, 2) per-stage seconds: each module's cost split over its stages (and the shared
    encoder's over the replicas, which split every microbatch between them), the encoder's
    scaled so that both modules' stages carry equal work over the batch, as a planner
    sizing the two modules' GPU shares aims for: what remains is the per-sample skew."""
    mix = MixSpec.from_mapping(setting.mix) if setting.mix else None
    costs = synthetic_costs(setting.num_samples, seed=seed, mix=mix)
    costs[:, 0] /= setting.stages[0] * setting.dp_size
    costs[:, 1] /= setting.stages[1]
    costs[:, 0] *= costs[:, 1].sum() / setting.dp_size / costs[:, 0].sum()
    return costs


def lower_bound(costs: np.ndarray, model: dflop.PipelineModel, s: dflop.Schedule) -> float:
    """The busiest stage's total work (constants included): no step is shorter."""
    m, dp = s.num_microbatches, s.dp_size
    loads = s.loads.reshape(m, dp, 2)
    encoder = loads[:, :, 0].sum(axis=1)  # shared by the replicas
    bound = float(np.sum(np.where(encoder > 0, encoder + model.microbatch_constant_s[0], 0.0)))
    for r in range(dp):
        llm = loads[:, r, 1]
        bound = max(
            bound, float(np.sum(np.where(llm > 0, llm + model.microbatch_constant_s[1], 0.0)))
        )
    return bound


def run_setting(setting: Setting, seeds: list[int]) -> list[dict[str, object]]:
    model = dflop.PipelineModel(
        stages=setting.stages,
        forward_fraction=(1 / 3, 1 / 3),
        microbatch_constant_s=(0.002, 0.002),
        link_latency_s=0.0005,
    )
    m, dp = setting.num_microbatches, setting.dp_size
    rows: dict[str, dict[str, list[float]]] = {}

    def record(name: str, costs: np.ndarray, s: dflop.Schedule, ms: float, blind: float) -> float:
        step = model.step_time_s(costs, s)
        row = rows.setdefault(name, {"ratio": [], "reduction": [], "ms": []})
        row["ratio"].append(step / lower_bound(costs, model, s))
        row["reduction"].append(1 - step / blind)
        row["ms"].append(ms)
        return step

    for seed in seeds:
        costs = stage_costs(setting, seed)
        kwargs = dict(microbatch_dims=(0,), seed=seed)
        blind = dflop.data_blind_schedule(costs, m, dp, microbatch_dims=(0,))
        blind_step = model.step_time_s(costs, blind)
        record("data-blind", costs, blind, 0.0, blind_step)
        t = time.perf_counter()
        balanced = dflop.schedule(costs, m, dp, **kwargs)
        record(
            "balanced (dflop.schedule)",
            costs,
            balanced,
            1e3 * (time.perf_counter() - t),
            blind_step,
        )
        total = costs.sum(axis=1)
        bins_b = m * dp
        for label, split, extra in (
            ("verl Karmarkar-Karp", peers.karmarkar_karp, ()),
            ("verl Karmarkar-Karp, equal counts", peers.karmarkar_karp, (True,)),
            ("verl greedy partition", peers.greedy_partition, ()),
        ):
            t = time.perf_counter()
            bins = split(total, bins_b, *extra)
            ms = 1e3 * (time.perf_counter() - t)
            assignment = np.empty(len(total), dtype=np.int64)
            for b, members in enumerate(bins):
                assignment[members] = b
            peer = dflop.schedule_from_assignment(costs, assignment, m, dp, microbatch_dims=(0,))
            record(label, costs, peer, ms, blind_step)
        for label, budget in (
            ("balanced + order", 0.0),
            ("pipeline_schedule", None),
            ("pipeline_schedule, 100 ms budget", 100.0),
        ):
            t = time.perf_counter()
            s = dflop.pipeline_schedule(
                costs, m, dp, pipeline=model, time_budget_ms=budget, **kwargs
            )
            ms = 1e3 * (time.perf_counter() - t)
            record(label, costs, s, ms, blind_step)
    return [
        {
            "setting": setting.name,
            "method": name,
            "ratio": float(np.median(v["ratio"])),
            "worst": float(np.max(v["ratio"])),
            "reduction": float(np.median(v["reduction"])),
            "ms": float(np.median(v["ms"])),
        }
        for name, v in rows.items()
    ]


def render(results: list[dict[str, object]], command: str, seeds: int) -> str:
    lines = [
        f"Command: `{command}`; {seeds} batches per setting; "
        f"{datetime.date.today().isoformat()}; {baselines.machine_info()}.",
        "",
        "| setting | method | median step / LB | worst | median step reduction vs data-blind "
        "| median ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['setting']} | {r['method']} | {r['ratio']:.4f} | {r['worst']:.4f} "
            f"| {100 * r['reduction']:.1f}% | {r['ms']:.2f} |"
        )
    lines += [
        "",
        "LB: the busiest stage's total work; every schedule's ratio also holds the 1F1B "
        "fill and drain (about stages - 1 microbatches). Steps are simulated (1F1B; forward "
        "a third of each stage's time; 2 ms per microbatch and stage; 0.5 ms per transfer).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="batches per setting")
    parser.add_argument("--markdown", metavar="PATH", help="write the table into PATH")
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_pipeline_schedule.py " + shlex.join(
        a for a in (argv if argv is not None else sys.argv[1:])
    )
    results: list[dict[str, object]] = []
    for setting in SETTINGS:
        results += run_setting(setting, list(range(args.seeds)))
    section = render(results, command.strip(), args.seeds)
    print(section)
    if args.markdown:
        baselines.write_section(
            args.markdown, "bench_pipeline_schedule", section, "## `bench_pipeline_schedule.py`"
        )
        print(f"wrote the table into {args.markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
