"""Per-step balancing for data-parallel training (``dflop.dp.BalancedBatchSampler``) against
torch's DistributedSampler, in simulation at 64 to 1,024 ranks.

Each step every rank trains its share of one global batch (8 samples per rank, 2
microbatches each); a step waits for its slowest rank at the gradient all-reduce. Samples
are the embedded synthetic mix (LLaVA-OneVision shape rules) and a second, video-heavy mix
(40% videos, 20% text: **skewed on purpose**, to show what a long-tailed mix does), priced
by the analytic cost model of siglip-400m + llm-7b on one GPU (compute seconds per sample,
forward + backward). DistributedSampler: the same global batch (the same permutation)
split by position into equal counts. Reported per setting: rank imbalance (max / mean
compute per step, mean over steps) and the step's compute time (the slowest rank's), the
ratio of the two methods measured on the same batches.

    python benchmarks/bench_dp_balance.py [--steps 20] [--markdown benchmarks/README.md]

(The measured part, 2 to 4 CPU ranks under DDP / FSDP on a tiny model, is not in this
script yet.)
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np
from dflop.data import AnalyticCostModel, synthetic_shapes
from dflop.dp import BalancedBatchSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402

RANKS = (64, 256, 1024)
PER_RANK, MICROBATCHES = 8, 2
MIXES = {
    "embedded mix": None,
    "video-heavy mix (skewed on purpose)": {
        "single_image": 0.3,
        "multi_image": 0.1,
        "video": 0.4,
        "text": 0.2,
    },
}


def run(ranks: int, mix, steps: int) -> dict:
    global_batch = ranks * PER_RANK
    shapes = synthetic_shapes(global_batch * steps, seed=ranks, mix=mix)
    costs = AnalyticCostModel("siglip-400m", "llm-7b").costs(shapes).sum(axis=1)
    sampler = BalancedBatchSampler(
        costs, global_batch, MICROBATCHES, rank=0, world_size=ranks, seed=0
    )
    out = {"dflop": [], "distributed": [], "dflop_step": [], "distributed_step": [], "s": 0.0}
    for step in range(steps):
        start = time.perf_counter()
        info = sampler.plan_step(0, step)  # both methods split its global batch
        out["s"] += time.perf_counter() - start
        per_rank = info.rank_costs[:, 0]
        even = costs[info.indices].reshape(ranks, PER_RANK).sum(axis=1)
        for name, loads in (("dflop", per_rank), ("distributed", even)):
            out[name].append(loads.max() / loads.mean())
            out[f"{name}_step"].append(loads.max())
    return {k: (float(np.mean(v)) if isinstance(v, list) else v / steps) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--markdown", default=None, help="rewrite this README section")
    args = parser.parse_args(argv)
    lines = [
        "Command: `python benchmarks/bench_dp_balance.py --markdown benchmarks/README.md`",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{baselines.machine_info()}; {args.steps} steps per setting, {PER_RANK} samples and "
        f"{MICROBATCHES} microbatches per rank per step; simulated (analytic costs of "
        "siglip-400m + llm-7b); the video-heavy mix is skewed on purpose.",
        "",
        "| ranks | mix | imbalance, dflop | imbalance, DistributedSampler | step compute s, "
        "dflop | step compute s, DistributedSampler | DistributedSampler / dflop | "
        "dflop schedule ms per step |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for ranks in RANKS:
        for name, mix in MIXES.items():
            r = run(ranks, mix, args.steps)
            lines.append(
                f"| {ranks:,} | {name} | {r['dflop']:.3f} | {r['distributed']:.3f} | "
                f"{r['dflop_step']:.2f} | {r['distributed_step']:.2f} | "
                f"{r['distributed_step'] / r['dflop_step']:.2f}x | {1e3 * r['s']:.1f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    lines += [
        "",
        "Imbalance = the slowest rank's compute over the mean rank's in a step (1.00 = "
        "perfect; target <= 1.05). Step compute = the slowest rank's seconds (the all-reduce "
        "and what follows are the same for both). Every rank computes the schedule itself "
        "(the same result, no communication); its time is the last column.",
    ]
    body = "\n".join(lines)
    print(body)
    if args.markdown:
        baselines.write_section(args.markdown, "bench_dp_balance", body, "## `bench_dp_balance.py`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
