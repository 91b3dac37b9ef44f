"""Measured training regimes: ``dflop train --model hf:DIR --trainable ...`` on this machine.

A tiny LLaVA-OneVision folder (``save_tiny_llava_onevision``: 2 + 2 layers, hidden 64,
a 320-token vocabulary) trains on the shipped real-format records
(``tests/data/llava_mini``: images, multi-image, video, text-only) over three processes:
the encoder on two pipeline stages (the first all tower, the second holding the
projector) and the LLM on one. Each regime is one run of ``--steps`` steps with the same
seed, data and layout: ``full``, ``frozen-vision`` (the tower frozen: its first stage
runs forward only), ``projector`` (LLaVA's stage 1: only the projector trains; the LLM
passes gradients without computing its weight gradients) and ``lora`` (rank-16 PEFT
adapters on the LLM's linear layers, the tower frozen, the projector trained). Reported per regime: the mean
measured step (after ``--warmup`` steps) and its ratio to ``full`` measured in the same
invocation, the plan's predicted step (the planner's model of the same layout and regime,
priced by the performance model the run profiles first, with the frozen pass-through
shares it measures, before any step), and every rank's measured peak memory beside the
memory model's.

    python benchmarks/bench_trainable.py                    # prints the table
    python benchmarks/bench_trainable.py --markdown benchmarks/README.md

The workload is the shipped records as they are (not tuned); on the 2-core development VM
step times move by 10-15% between runs, so read the ratios, not the last digit.
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

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "llava_mini"
LAYOUT = "enc_dp=1,enc_pp=2,llm_dp=1,llm_pp=1,m=4"
REGIMES = ("full", "frozen-vision", "projector", "lora")


def run_regime(model_dir: Path, trainable: str, args: argparse.Namespace, out: Path) -> dict:
    report = out / f"{trainable}.json"
    command = [
        sys.executable, "-m", "dflop.cli", "train", "--model", f"hf:{model_dir}",
        "--data", str(DATA / "llava_mini.json"), "--image-folder", str(DATA / "images"),
        "--video-folder", str(DATA / "videos"), "--layout", LAYOUT,
        "--global-batch", str(args.global_batch), "--steps", str(args.steps),
        "--trainable", trainable, "--memory-report", "--quiet", "--seed", str(args.seed),
        "--json", str(report),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{trainable}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    data = json.loads(report.read_text())
    steps = [s["step_time_s"] for s in data["steps"] if s["step"] >= args.warmup]
    return {
        "trainable": trainable,
        "step_time_s": float(np.mean(steps)),
        "planned_step_time_s": float(data["planned_step_time_s"]),
        "memory": data["memory"],
        "final_loss": data["steps"][-1]["loss"],
    }


def render(rows: list[dict], args: argparse.Namespace) -> str:
    full = rows[0]["step_time_s"]
    lines = [
        "Command: `python benchmarks/bench_trainable.py --markdown benchmarks/README.md`",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{baselines.machine_info()}",
        f"- Tiny LLaVA-OneVision (`hf:`), the shipped records, layout `{LAYOUT}` (3 "
        f"processes), global batch {args.global_batch}, {args.steps} steps (the first "
        f"{args.warmup} excluded), seed {args.seed}; memory: each rank's measured peak over "
        "the last steps | the memory model's",
        "",
        "| trains | step s (measured) | vs full | plan's step s | memory per rank, MB "
        "(measured / model) |",
        "|---|---:|---:|---:|---|",
    ]
    for row in rows:
        memory = ", ".join(
            f"r{m['rank']} {m['measured_bytes'] / 1e6:.2f} / {m['predicted_bytes'] / 1e6:.2f}"
            for m in row["memory"]
        )
        lines.append(
            f"| {row['trainable']} | {row['step_time_s']:.4f} | "
            f"{row['step_time_s'] / full:.2f}x | {row['planned_step_time_s']:.4f} | {memory} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", default=None, help="rewrite this README section")
    args = parser.parse_args(argv)
    from dflop.models.hf.tiny import save_tiny_llava_onevision

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-ov"
        save_tiny_llava_onevision(str(model_dir))
        rows = []
        for trainable in REGIMES:
            rows.append(run_regime(model_dir, trainable, args, Path(tmp)))
            print(f"{trainable}: done", file=sys.stderr)
    body = render(rows, args)
    print(body)
    if args.markdown:
        heading = "## `bench_trainable.py`"
        baselines.write_section(args.markdown, "bench_trainable", body, heading)
    return 0


if __name__ == "__main__":
    sys.exit(main())
