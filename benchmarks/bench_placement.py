"""Placement measured: the encoder on a process of its own against inside the LLM's first
stage (colocated), on this machine, same model, seed, data and steps; each layout trained
with dflop's schedule and data-blind on the same weights and batches.

For each layout of ``--layouts`` (all on the same number of processes), ``dflop train
--scheduler compare`` trains the reference model (``--model``, default ``small``) on the
embedded synthetic mix; the layouts alternate over ``--repeats`` runs so that the
machine's drift hits them alike. Reported per layout: the median measured step under
dflop's schedule and data-blind (the first ``--warmup`` steps of each run excluded), their
ratio, the plan's prediction for the same steps (the model a plan is scored with, before
any step) and the trainer's calibrated simulator, and each layout's measured step over
the first layout's. Then the local planner's own choice (``dflop plan --local``, the same
settings, default placement ``any``): whether it is the layout measured fastest.

    python benchmarks/bench_placement.py
    python benchmarks/bench_placement.py --markdown benchmarks/README.md

On the 2-core development VM two processes run at once; read the ratios, not the last
digit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402

LAYOUTS = ("enc_dp=1,llm_pp=1,m=4", "colocated,llm_dp=2,m=2", "colocated,llm_pp=2,m=4")


def _common(args: argparse.Namespace) -> list[str]:
    return [
        "--model", args.model, "--global-batch", str(args.global_batch),
        "--seed", str(args.seed), "--perf", str(args.perf),
    ]  # fmt: skip


def _cli(command: list[str], what: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "dflop.cli", *command],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{what}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def run(layout: str, args: argparse.Namespace, out: Path, repeat: int) -> dict:
    report = out / f"{layout}-{repeat}.json".replace(",", "_").replace("=", "")
    _cli(
        [
            "train",
            *_common(args),
            "--layout",
            layout,
            "--scheduler",
            "compare",
            "--steps",
            str(args.steps),
            "--quiet",
            "--json",
            str(report),
            "--output-dir",
            str(out / "metrics"),
        ],  # fmt: skip
        layout,
    )
    steps = [s for s in json.loads(report.read_text())["steps"] if s["step"] >= args.warmup]
    return {
        mode: {
            key: [s[key] for s in steps if s["mode"] == mode]
            for key in ("step_time_s", "predicted_step_time_s", "plan_model_step_time_s")
        }
        for mode in ("dflop", "blind")
    }


def planner_choice(args: argparse.Namespace, out: Path) -> str:
    """The layout ``dflop plan --local`` picks for these settings (its description)."""
    from dflop.planner import Plan

    path = out / "plan.json"
    _cli(
        [
            "plan",
            "--local",
            str(args.processes),
            *_common(args),
            "--calibrate-steps",
            "0",
            "-o",
            str(path),
        ],  # fmt: skip
        "dflop plan --local",
    )
    return Plan.load(path).best.describe("processes")


def measure(args: argparse.Namespace) -> tuple[list[dict], str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if args.perf is None:
            args.perf = out / "perf.json"
            _cli(["profile-model", "--model", args.model, "-o", str(args.perf)], "profile")
        runs: dict[str, list[dict]] = {layout: [] for layout in args.layouts}
        for repeat in range(args.repeats):
            order = args.layouts if repeat % 2 == 0 else list(reversed(args.layouts))
            for layout in order:
                runs[layout].append(run(layout, args, out, repeat))
        choice = planner_choice(args, out)
    rows = []
    for layout, measured in runs.items():
        merged = {
            mode: {key: [v for r in measured for v in r[mode][key]] for key in measured[0][mode]}
            for mode in ("dflop", "blind")
        }
        dflop, blind = merged["dflop"], merged["blind"]
        rows.append(
            {
                "layout": layout,
                "dflop_s": float(np.median(dflop["step_time_s"])),
                "blind_s": float(np.median(blind["step_time_s"])),
                "ratio": float(
                    np.median(np.array(dflop["step_time_s"]) / np.array(blind["step_time_s"]))
                ),
                "plan_s": float(np.median(dflop["plan_model_step_time_s"])),
                "simulated_s": float(np.median(dflop["predicted_step_time_s"])),
            }
        )
    return rows, choice


def render(rows: list[dict], choice: str, args: argparse.Namespace) -> str:
    base = rows[0]["dflop_s"]
    fastest = min(rows, key=lambda r: r["dflop_s"])
    planned = min(rows, key=lambda r: r["plan_s"])
    lines = [
        "Command: `python benchmarks/bench_placement.py --markdown benchmarks/README.md`",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{baselines.machine_info()}",
        f"- `dflop train --model {args.model} --scheduler compare` on the embedded synthetic "
        f"mix, {args.processes} processes, global batch {args.global_batch}, {args.steps} "
        f"steps per run (the first {args.warmup} excluded), {args.repeats} runs per layout "
        f"alternating, seed {args.seed}, one profile for all runs; medians over all measured "
        "steps. Not tuned to show an effect.",
        "",
        "| layout | dflop step | data-blind step | dflop / blind (per step) | plan's model "
        "| calibrated simulator | dflop step / first layout's |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['layout']}` | {r['dflop_s'] * 1e3:.1f} ms | {r['blind_s'] * 1e3:.1f} ms | "
            f"{r['ratio']:.3f} | {r['plan_s'] * 1e3:.1f} ms | {r['simulated_s'] * 1e3:.1f} ms "
            f"| {r['dflop_s'] / base:.3f} |"
        )
    agree = "the same layout" if fastest is planned else "a different layout"
    lines += [
        "",
        f"Measured fastest under dflop's schedule: `{fastest['layout']}`; the plan's model "
        f"ranks `{planned['layout']}` first ({agree}). `dflop plan --local {args.processes}` "
        f"(placement any) picks: {choice}.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--processes", type=int, default=2, help="every layout's world size")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--perf", default=None, help="a profile to reuse (default: one run)")
    parser.add_argument("--markdown", default=None, help="rewrite this README section")
    args = parser.parse_args()
    rows, choice = measure(args)
    text = render(rows, choice, args)
    print(text)
    if args.markdown:
        heading = "## `bench_placement.py`"
        baselines.write_section(args.markdown, "bench_placement", text, heading)


if __name__ == "__main__":
    main()
