"""Measured training: dflop's per-step scheduling vs data-blind equal-count microbatches.

Two local processes (gloo): rank 0 holds the encoder (one stage), rank 1 the LLM (one
stage). Every step runs twice in the same run, on the same weights and global batch: once
with dflop's schedule (``dflop.pipeline_schedule``: balanced on the measured, adaptively
corrected cost model, then refined in the background thread on the simulated encoder ->
LLM 1F1B step: which samples share a microbatch and the microbatch order) and once split
data-blind (equal-count microbatches in dataset order); which goes first alternates.
Reported: mean step time, idle rank-seconds, throughput, and the simulator's predicted
step time (cost model + pipeline simulator, before the step) against the measured one.
The first ``--warmup`` steps are excluded.

Workload: the embedded synthetic LLaVA-OneVision-like shapes with a heavier text share
(``--mix``), mapped onto the small model by ShapeScaler (``--max-units``,
``--unit-divisor``, ``--text-divisor``, ``--max-text``) so that image samples load the
encoder and long text samples the LLM: the skew that a count-based split cannot see.
Two samples per microbatch (48 samples, 24 microbatches) keep the 1F1B fill/drain bubble
small (about one microbatch of each stage) and leave dflop room to pair samples, while a
data-blind split often puts two images, or two long texts, together.

    python benchmarks/bench_train.py                 # prints the table and JSON
    python benchmarks/bench_train.py --repeats 3 --write-readme  # + benchmarks/README.md

The machine's own timing noise is large (the same microbatch repeated alone varies by
8-16% on the 2-core development VM), so one run's reduction moves by 1-2 points;
``--repeats`` runs the whole comparison again in fresh processes and reports the median.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import baselines  # noqa: E402

README = Path(__file__).with_name("README.md")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small+tiny", help="model (vision+decoder presets)")
    p.add_argument("--steps", type=int, default=41)
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the means")
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--num-microbatches", type=int, default=24)
    p.add_argument(
        "--mix",
        # About equal total encoder and LLM work for one process each (a planner would
        # size the two modules that way): what remains is per-microbatch skew.
        default='{"single_image": 0.35, "multi_image": 0.0, "video": 0.1, "text": 0.55}',
        help="synthetic mix (JSON)",
    )
    p.add_argument("--max-units", type=int, default=16, help="ShapeScaler.max_units_per_sample")
    p.add_argument("--unit-divisor", type=int, default=2, help="ShapeScaler.unit_divisor")
    p.add_argument("--text-divisor", type=int, default=1, help="ShapeScaler.text_divisor")
    p.add_argument("--max-text", type=int, default=512, help="ShapeScaler.max_text_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-train-out", help="timelines go here")
    p.add_argument("--repeats", type=int, default=1, help="whole runs (fresh processes)")
    p.add_argument("--write-readme", action="store_true")
    return p.parse_args(argv)


def run_once(args: argparse.Namespace, out: str) -> dict:
    """One training run (fresh processes): both schedules on every step."""
    from dflop.train import TrainConfig
    from dflop.train.run import print_summary, run_training, summaries

    os.makedirs(out, exist_ok=True)
    config = TrainConfig(
        model=args.preset,
        layout=f"enc_dp=1,enc_pp=1,llm_dp=1,llm_pp=1,m={args.num_microbatches}",
        global_batch=args.global_batch,
        steps=args.steps,
        seed=args.seed,
        scheduler="compare",
        mix=json.loads(args.mix),
        scaler=scaler_of(args),
        trace=os.path.join(out, "timeline.json"),
        png=os.path.join(out, "timeline.png"),
        trace_steps=1,
        progress=False,
    )
    start = time.perf_counter()
    report = run_training(config)
    wall_s = time.perf_counter() - start
    print()
    print_summary(report, warmup=args.warmup)
    rows = summaries(report, warmup=args.warmup)
    d, b = rows["dflop"], rows["blind"]
    return {
        "dflop": d.to_dict(),
        "blind": b.to_dict(),
        "idle_reduction": 1 - d.idle_s / b.idle_s,
        "step_time_reduction": 1 - d.step_time_s / b.step_time_s,
        "throughput_ratio": d.samples_per_s / b.samples_per_s,
        "prediction_error_dflop": d.prediction_error,
        "prediction_error_blind": b.prediction_error,
        "wall_s": wall_s,
    }


def scaler_of(args: argparse.Namespace) -> dict:
    return {
        "max_units_per_sample": args.max_units,
        "unit_divisor": args.unit_divisor,
        "text_divisor": args.text_divisor,
        "max_text_tokens": args.max_text,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = []
    for k in range(args.repeats):
        out = args.out if args.repeats == 1 else os.path.join(args.out, f"run{k}")
        runs.append(run_once(args, out))
    summary = {
        key: float(statistics.median(r[key] for r in runs))
        for key in ("idle_reduction", "step_time_reduction", "prediction_error_dflop")
    }
    result = {"config": {**vars(args), "scaler": scaler_of(args)}, "runs": runs, "median": summary}
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1, default=str))
    if args.write_readme:
        write_readme(result, argv)
    return 0


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f}%"


def write_readme(result: dict, argv: list[str] | None) -> None:
    command = "python benchmarks/bench_train.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-readme"
    )
    cfg, runs, median = result["config"], result["runs"], result["median"]
    lines = [
        f"Command: `{command.strip()}` ({datetime.date.today().isoformat()}; "
        f"{baselines.machine_info()}; gloo; "
        f"{cfg['preset']}, global batch {cfg['global_batch']}, {cfg['num_microbatches']} "
        f"microbatches, {cfg['steps']} steps of which the first {cfg['warmup']} are excluded; "
        f"every step runs both ways on the same weights and batch; {len(runs)} run(s), each "
        "in fresh processes).",
        "",
        "| run | dflop step (s) | data-blind step (s) | dflop idle share | data-blind idle "
        "share | idle reduction | step time reduction | simulator (dflop) | simulator error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, r in enumerate(runs):
        d, b = r["dflop"], r["blind"]
        lines.append(
            f"| {k + 1} | {d['step_time_s']:.3f} | {b['step_time_s']:.3f} | "
            f"{_pct(d['idle_share'])} | {_pct(b['idle_share'])} | {_pct(r['idle_reduction'])} | "
            f"{_pct(r['step_time_reduction'])} | {d['predicted_step_time_s']:.3f} | "
            f"{_pct(r['prediction_error_dflop'])} |"
        )
    lines += [
        "",
        f"- Idle time reduction, median of the runs: **{_pct(median['idle_reduction'])}** "
        "(target >= 50%).",
        f"- Step time reduction, median of the runs: **{_pct(median['step_time_reduction'])}** "
        "(target >= 20%).",
        f"- Simulator vs measured step time (dflop), median: "
        f"**{_pct(median['prediction_error_dflop'])}** off (target within 15%).",
    ]
    baselines.write_section(str(README), "bench_train", "\n".join(lines), "## `bench_train.py`")
    print(f"updated {README}")


if __name__ == "__main__":
    sys.exit(main())
