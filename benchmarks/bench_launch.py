"""Ranks as processes vs ranks as threads of one process (``TrainConfig.launch``): the
same ``dflop train`` run (reference model, deterministic plans, the same batches) under
both, alternating, on CPU (gloo vs the thread world) or on a GPU.

On a GPU with fewer GPUs than ranks only the thread world runs (NCCL refuses two ranks
on one GPU), with a profiler trace of its last steps: how much of the transfers between
the ranks overlapped compute, and how long two ranks' kernels ran at once.

    python benchmarks/bench_launch.py [--device cuda] [--markdown benchmarks/README.md]

Not tuned: the embedded synthetic mix, an encoder stage and an LLM stage (2 ranks).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import baselines  # noqa: E402
import torch  # noqa: E402
from dflop.train import TrainConfig  # noqa: E402
from dflop.train.gpu_trace import TransferOverlap  # noqa: E402
from dflop.train.run import run_training  # noqa: E402


def measure(
    launch: str, args: argparse.Namespace, profile: str | None
) -> tuple[float, list[float], list]:
    """Median step seconds after the warm-up, the per-step losses, and the profiled
    transfer overlaps (``profile``: a trace path, threads on CUDA)."""
    config = TrainConfig(
        model=args.model,
        layout=args.layout,
        global_batch=args.global_batch,
        steps=args.steps,
        scheduler="dflop",
        deterministic=True,
        device=args.device,
        launch=launch,
        log_every=0,
        progress=False,
        profile_trace=profile,
    )
    report = run_training(config, log=lambda *_: None)
    times = [m.step_time_s for m in report.metrics][args.warmup :]
    overlaps = report.stats.get("transfer_overlap") or []
    return statistics.median(times), [m.loss for m in report.metrics], overlaps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--layout", default="enc_dp=1,llm_pp=1,m=4")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="runs per launch, alternating")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--markdown", default=None, help="rewrite this README section")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    launches = ["processes", "threads"]
    if cuda and torch.cuda.device_count() < 2:
        launches = ["threads"]  # NCCL needs a GPU per rank
    medians: dict[str, list[float]] = {launch: [] for launch in launches}
    losses: dict[str, list] = {}
    overlaps: list = []
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for launch in launches if repeat % 2 == 0 else reversed(launches):
                profile = None
                if cuda and launch == "threads" and repeat == 0:
                    profile = os.path.join(folder, "trace.json")
                median_s, loss, found = measure(launch, args, profile)
                medians[launch].append(median_s)
                losses.setdefault(launch, loss)
                overlaps += found
    base = statistics.median(medians[launches[0]])
    where = torch.cuda.get_device_name() if cuda else f"CPU ({baselines.machine_info()})"
    rows = [
        f"| {launch} | {statistics.median(m) * 1e3:.1f} | {base / statistics.median(m):.2f}x |"
        for launch, m in medians.items()
    ]
    # Equal up to float summation order (torch's intra-op thread counts differ).
    reference = losses[launches[0]]
    worst = max(abs(a - b) / abs(b) for loss in losses.values() for a, b in zip(loss, reference))
    same = worst <= 1e-5
    lines = [
        "Command: `python benchmarks/bench_launch.py"
        + (" --device cuda" if cuda else "")
        + " --markdown benchmarks/README.md`",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {where}; "
        f"torch {torch.__version__}; model {args.model}, layout {args.layout}, global batch "
        f"{args.global_batch}, {args.steps} steps ({args.warmup} warm-up), median over "
        f"{args.repeats} alternating run(s) per launch; not tuned (embedded mix)",
        f"- Losses of every step equal under every launch: {'yes' if same else 'NO'} "
        f"(largest relative difference {worst:.1e})",
        "",
        f"| launch | median step ms | speed vs {launches[0]} |",
        "|---|---:|---:|",
        *rows,
    ]
    for _, numbers in overlaps:
        lines.append(
            f"\nProfiler trace (threads, last steps): {TransferOverlap(**numbers).describe()}"
        )
    body = "\n".join(lines)
    print(body)
    if args.markdown:
        title = "## `bench_launch.py`" + (" (GPU)" if cuda else "")
        baselines.write_section(
            args.markdown, "bench_launch" + ("_gpu" if cuda else ""), body, title
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
