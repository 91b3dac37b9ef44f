"""Zero bubble measured: ``dflop train --pipeline-order zb-h1`` against ``1f1b`` on this
machine, same layout, seed, data and steps.

Each order trains the reference model (``--model``, default ``small``) on the embedded
synthetic mix for ``--steps`` steps over a manual layout, with dflop's scheduler (which
simulates the order it runs when it refines each step's schedule). The orders alternate
over ``--repeats`` runs so that the machine's drift hits both alike. Reported per order
and layout: the median measured step (the first ``--warmup`` steps of each run
excluded), the simulator's prediction for the same steps (the trainer's calibrated
model), the idle share, the ratio ZB-H1 / 1F1B measured in the same invocation, and the
largest difference of the per-step losses between the orders (the same batches and
weights: equal up to float32 rounding).

    python benchmarks/bench_zero_bubble.py
    python benchmarks/bench_zero_bubble.py --markdown benchmarks/README.md

On the 2-core development VM, a layout of more processes than cores runs its stages in
turns rather than at once, which is not what a pipeline is for; the table says how many
processes each layout has. Read the ratios, not the last digit.
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

ORDERS = ("1f1b", "zb-h1")
LAYOUTS = ("enc_dp=1,llm_pp=1,m=8", "enc_dp=1,llm_pp=2,m=8")


def run(layout: str, order: str, args: argparse.Namespace, out: Path, repeat: int) -> dict:
    report = out / f"{order}-{layout}-{repeat}.json".replace(",", "_").replace("=", "")
    command = [
        sys.executable, "-m", "dflop.cli", "train", "--model", args.model, "--layout", layout,
        "--pipeline-order", order, "--global-batch", str(args.global_batch),
        "--steps", str(args.steps), "--seed", str(args.seed), "--quiet", "--json", str(report),
        "--output-dir", str(out / "metrics"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{order} {layout}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        )
    steps = [s for s in json.loads(report.read_text())["steps"] if s["step"] > args.warmup]
    return {
        "step_time_s": [s["step_time_s"] for s in steps],
        "predicted_s": [s["predicted_step_time_s"] for s in steps],
        "idle": [s["idle_share"] for s in steps],
        "loss": {s["step"]: s["loss"] for s in steps},
    }


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            runs: dict[str, list[dict]] = {order: [] for order in ORDERS}
            for repeat in range(args.repeats):
                for order in ORDERS if repeat % 2 == 0 else reversed(ORDERS):
                    runs[order].append(run(layout, order, args, Path(tmp), repeat))
            merged = {
                order: {
                    key: [v for r in rs for v in r[key]]
                    for key in ("step_time_s", "predicted_s", "idle")
                }
                for order, rs in runs.items()
            }
            losses = [
                abs(a["loss"][k] - b["loss"][k])
                for a, b in zip(runs["1f1b"], runs["zb-h1"])
                for k in a["loss"]
            ]
            processes = 1 + int(layout.split("llm_pp=")[1].split(",")[0])
            for order in ORDERS:
                m = merged[order]
                rows.append(
                    {
                        "layout": layout,
                        "processes": processes,
                        "order": order,
                        "step_time_s": float(np.median(m["step_time_s"])),
                        "predicted_s": float(np.median(m["predicted_s"])),
                        "idle": float(np.median(m["idle"])),
                        "loss_diff": float(max(losses)),
                    }
                )
    return rows


def render(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "Command: `python benchmarks/bench_zero_bubble.py --markdown benchmarks/README.md`",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{baselines.machine_info()}",
        f"- `dflop train --model {args.model}` on the embedded synthetic mix, global batch "
        f"{args.global_batch}, {args.steps} steps per run (the first {args.warmup} excluded), "
        f"{args.repeats} runs per order alternating, seed {args.seed}; medians over all "
        "measured steps. Not tuned to show an effect.",
        "",
        "| layout | processes | order | measured step | simulated | idle | ZB-H1 / 1F1B "
        "| max loss difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {r["layout"]: r["step_time_s"] for r in rows if r["order"] == "1f1b"}
    for r in rows:
        ratio = f"{r['step_time_s'] / base[r['layout']]:.3f}" if r["order"] == "zb-h1" else ""
        lines.append(
            f"| `{r['layout']}` | {r['processes']} | {r['order']} | "
            f"{r['step_time_s'] * 1e3:.1f} ms | {r['predicted_s'] * 1e3:.1f} ms | "
            f"{r['idle']:.1%} | {ratio} | {r['loss_diff']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", default=None, help="rewrite this README section")
    args = parser.parse_args()
    text = render(measure(args), args)
    print(text)
    if args.markdown:
        heading = "## `bench_zero_bubble.py`"
        baselines.write_section(args.markdown, "bench_zero_bubble", text, heading)


if __name__ == "__main__":
    main()
