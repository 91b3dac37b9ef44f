"""Plan and runtime on this machine: predicted vs measured step times, through the CLI.

Three measurements, each a real ``dflop`` command in fresh processes (gloo, CPU):

1. ``local-plan``: ``dflop plan --local 3 --layout enc_dp=2,llm_pp=1,m=8`` plans the
   reference model for 3 local processes with encoder dp = 2 (forced: on this machine the
   planner would choose another layout), calibrated by a short real run; ``dflop train
   --plan`` trains it. Reported: the plan's predicted step time (its mean over the run's
   first 16 steps) against the measured mean, the plan's uncorrected model on the
   measured steps themselves, and the per-step simulator's (corrected online) error.
2. ``real-data``: a held-out LLaVA-format dataset of real files
   (``benchmarks/make_llava_bench.py``: ~300 samples of images of every size,
   multi-image samples, video frame folders, text-only and a few bad samples; not tuned
   to anything dflop does), ``dflop train --nproc 2 --scheduler compare`` at global
   batch 16 and 32: both schedules' step times and their predictions, and the plan's
   uncorrected model (the quick profile, no calibration) on the same steps.
3. ``llava-mini``: the issue's command on the shipped ``tests/data/llava_mini`` (28
   records, some deliberately unreadable), with its image and video folders.

    python benchmarks/bench_agreement.py                      # all three, prints a table
    python benchmarks/bench_agreement.py --markdown benchmarks/README.md

Measure on an otherwise idle machine: the processes share 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import baselines  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MINI = ROOT / "tests" / "data" / "llava_mini"


def _run(argv: list[str], log: Path) -> None:
    """Run one command; its output goes to ``log``; a failure stops the benchmark."""
    print("$", " ".join(argv), flush=True)
    with open(log, "w", encoding="utf-8") as f:
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"command failed ({done.returncode}); see {log}")


def _dflop(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflop.cli", *args]


def _train(out: Path, name: str, *args: str) -> dict:
    path = out / f"{name}.json"
    _run(_dflop("train", *args, "--quiet", "--json", str(path)), out / f"{name}.log")
    return json.loads(path.read_text())


def _err(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured > 0 else math.nan


def local_plan(out: Path, steps: int, run: int) -> dict:
    plan_path = out / f"local_plan{run}.json"
    _run(
        _dflop(
            "plan",
            "--local",
            "3",
            "--layout",
            "enc_dp=2,llm_pp=1,m=8",
            "--global-batch",
            "16",
            "-o",
            str(plan_path),
        ),
        out / f"local_plan{run}.log",
    )
    planned = json.loads(plan_path.read_text())["layouts"][0]["prediction"]["step_time_s"]
    report = _train(out, f"local_train{run}", "--plan", str(plan_path), "--steps", str(steps))
    dflop = report["summary"]["dflop"]
    return {
        "planned_step_time_s": planned,
        "measured_step_time_s": dflop["step_time_s"],
        "plan_error": _err(planned, dflop["step_time_s"]),
        "plan_model_error": dflop["plan_prediction_error"],
        "per_step_predicted_s": dflop["predicted_step_time_s"],
        "per_step_error": dflop["prediction_error"],
        "layout": _layout(report["layout"]),
    }


def real_data(out: Path, steps: int, batches: list[int]) -> list[dict]:
    data = out / "llava_bench"
    if not (data / "llava_bench.json").exists():
        _run(
            [sys.executable, str(HERE / "make_llava_bench.py"), "--out", str(data)],
            out / "make.log",
        )
    rows = []
    for gb in batches:
        report = _train(
            out,
            f"real_gb{gb}",
            "--nproc",
            "2",
            "--data",
            str(data / "llava_bench.json"),
            "--image-folder",
            str(data / "images"),
            "--video-folder",
            str(data / "videos"),
            "--global-batch",
            str(gb),
            "--steps",
            str(steps),
            "--scheduler",
            "compare",
        )
        rows.append(
            {"dataset": "llava_bench (~300, held out)", "global_batch": gb, **_compare(report)}
        )
    return rows


def llava_mini(out: Path, steps: int) -> dict:
    report = _train(
        out,
        "mini",
        "--nproc",
        "2",
        "--data",
        str(MINI / "llava_mini.json"),
        "--image-folder",
        str(MINI / "images"),
        "--video-folder",
        str(MINI / "videos"),
        "--global-batch",
        "16",
        "--steps",
        str(steps),
        "--scheduler",
        "compare",
    )
    return {"dataset": "tests/data/llava_mini (28)", "global_batch": 16, **_compare(report)}


def _compare(report: dict) -> dict:
    d, b = report["summary"]["dflop"], report["summary"]["blind"]
    return {
        "layout": _layout(report["layout"]),
        "dflop_step_s": d["step_time_s"],
        "blind_step_s": b["step_time_s"],
        "dflop_error": d["prediction_error"],
        "blind_error": b["prediction_error"],
        "plan_model_error": d["plan_prediction_error"],
        "dflop_encoder_busy": d["busy_share"][0],
        "order_bias": _order_bias(report["steps"]),
    }


def _order_bias(steps: list[dict]) -> float:
    """Median over steps of (time of the schedule that ran first) / (time of the one that
    ran second): the two schedules alternate in order and run the same batch, so per-step
    input work charged to whichever runs first would show as a ratio well above 1."""
    by_step: dict[int, dict[str, float]] = {}
    for row in steps:
        if row["step"] > 0:  # the first step warms up
            by_step.setdefault(row["step"], {})[row["mode"]] = row["step_time_s"]
    ratios = []
    for step, times in sorted(by_step.items()):
        if len(times) == 2:
            first, second = ("dflop", "blind") if step % 2 == 0 else ("blind", "dflop")
            ratios.append(times[first] / times[second])
    return statistics.median(ratios) if ratios else math.nan


def _layout(layout: dict) -> str:
    def module(m: dict) -> str:
        return f"tp={m['tp']} pp={m['pp']} dp={m['dp']}"

    return (
        f"enc {module(layout['encoder'])} ; llm {module(layout['llm'])} ; "
        f"m={layout['num_microbatches']}"
    )


def _pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def markdown(result: dict, command: str) -> str:
    runs = result["local_plan"]
    lines = [
        f"Command: `{command}` ({datetime.date.today().isoformat()}; "
        f"{baselines.machine_info()}; gloo; total {result['wall_s'] / 60:.1f} min).",
        "",
        "Plan for 3 local processes, encoder dp = 2 (forced), calibrated, then trained with "
        "`dflop train --plan`, each run a fresh plan and a fresh training run (target: "
        "within 15%):",
        "",
        "| run | layout | plan's step (s) | measured (s) | plan error | plan's model on the "
        "run's steps | per-step simulator error |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for k, lp in enumerate(runs):
        lines.append(
            f"| {k + 1} | {lp['layout']} | {lp['planned_step_time_s']:.3f} | "
            f"{lp['measured_step_time_s']:.3f} | {_pct(lp['plan_error'])} | "
            f"{_pct(lp['plan_model_error'])} | {_pct(lp['per_step_error'])} |"
        )
    median = statistics.median(lp["plan_error"] for lp in runs)
    lines += [
        "",
        f"Plan vs measured, median of the runs: **{_pct(median)}**; worst "
        f"{_pct(max(lp['plan_error'] for lp in runs))}.",
        "",
        "Real-format data, `--scheduler compare` (both schedules every step; target: "
        "predictions within 25%):",
        "",
        "| dataset | global batch | layout | dflop step (s) | data-blind step (s) | dflop "
        "prediction error | data-blind prediction error | plan's model error (dflop, "
        "uncorrected) | encoder busy (dflop) | first / second schedule in a step |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in [*result["real_data"], result["llava_mini"]]:
        lines.append(
            f"| {r['dataset']} | {r['global_batch']} | {r['layout']} | {r['dflop_step_s']:.3f} | "
            f"{r['blind_step_s']:.3f} | {_pct(r['dflop_error'])} | {_pct(r['blind_error'])} | "
            f"{_pct(r['plan_model_error'])} | {_pct(r['dflop_encoder_busy'])} | "
            f"{r['order_bias']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench-agreement-out")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--global-batches", default="16,32")
    p.add_argument("--repeats", type=int, default=3, help="local plan + training runs")
    p.add_argument("--markdown", default=None, help="rewrite this README's section")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = {
        "local_plan": [local_plan(out, args.steps, k) for k in range(args.repeats)],
        "real_data": real_data(out, args.steps, [int(x) for x in args.global_batches.split(",")]),
        "llava_mini": llava_mini(out, 16),
    }
    result["wall_s"] = time.perf_counter() - start
    print(json.dumps(result, indent=1))
    text = markdown(
        result, "python benchmarks/bench_agreement.py " + " ".join(argv or sys.argv[1:])
    )
    print(text)
    if args.markdown:
        baselines.write_section(args.markdown, "bench_agreement", text, "## `bench_agreement.py`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
