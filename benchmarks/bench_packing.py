"""Token-capped packing: ``dflop.schedule(costs, None, resources=tokens, limits=[cap])``
(the fewest microbatches that meet a token cap, balanced by cost) against the packers
frameworks ship, re-implemented from their descriptions in ``peers.py``: verl's dynamic
batch size (Karmarkar-Karp into ceil(total / cap) microbatches), NeMo's first-fit
decreasing, LLaMA-Factory's greedy knapsack.

Samples: global batches of the embedded synthetic mix (LLaVA-OneVision shape rules; LLM
sequences of 10 to 15,545 tokens) and a text-heavy mix (80% text, 20% single images:
**chosen** to have many short sequences next to long ones), priced by the analytic cost
model's LLM column (siglip-400m + llm-7b: linear plus attention's quadratic term, in
seconds). Reported per setting, over 10 batches: microbatches used, the slowest
microbatch over the mean (1.00 = balanced; what a step waits for), the slowest over its
bound at that count (the larger of the mean microbatch and the largest sample: no packing
into that many microbatches has a faster slowest one), microbatches over the cap, and the
median time per call. dflop's calls also at one microbatch fewer than FFD
needs (where it fails, the failure's time: a failing call ends within its budget).

    python benchmarks/bench_packing.py [--batches 10] [--markdown benchmarks/README.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import dflop
import numpy as np
from dflop.data import AnalyticCostModel, synthetic_shapes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402
import peers  # noqa: E402

SAMPLES = (256, 1024)
CAPS = (16384, 32768, 65536)
MIXES = {
    "embedded mix": None,
    "text-heavy mix": {"single_image": 0.2, "multi_image": 0.0, "video": 0.0, "text": 0.8},
}
PACKERS = {
    "verl dynamic bsz (KK)": peers.verl_dynamic_batch,
    "NeMo FFD": peers.first_fit_decreasing,
    "LLaMA-Factory knapsack": peers.greedy_knapsack,
}


def _dflop(costs: np.ndarray, tokens: np.ndarray, cap: float) -> list[list[int]]:
    s = dflop.schedule(costs, None, resources=tokens, limits=[cap])
    return [list(np.flatnonzero(s.assignment == b)) for b in range(s.num_bins)]


def _timed(fn, *args, repeats: int = 3):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - start)
    return out, float(np.median(times))


def run(num_samples: int, cap: float, mix, batches: int) -> dict:
    model = AnalyticCostModel("siglip-400m", "llm-7b")
    rows: dict[str, dict[str, list]] = {}
    below = {"feasible": 0, "failed_s": []}
    for batch in range(batches):
        shapes = synthetic_shapes(num_samples, seed=1000 * batch + num_samples, mix=mix)
        tokens = shapes.seq_len.astype(np.float64)
        costs = model.costs(shapes)[:, 1]
        methods = {"dflop (fewest, balanced)": lambda t, c, p=costs: _dflop(p, t, c), **PACKERS}
        for name, fn in methods.items():
            bins, seconds = _timed(fn, tokens, cap)
            loads = np.array([costs[b].sum() for b in bins])
            r = rows.setdefault(
                name, {"count": [], "balance": [], "excess": [], "over": [], "s": []}
            )
            r["count"].append(len(bins))
            r["balance"].append(loads.max() / loads.mean())
            r["excess"].append(loads.max() / max(loads.mean(), costs.max()))
            r["over"].append(sum(tokens[b].sum() > cap for b in bins))
            r["s"].append(seconds)
        ffd = len(peers.first_fit_decreasing(tokens, cap))
        if ffd > 1:
            start = time.perf_counter()
            try:
                dflop.schedule(costs, ffd - 1, resources=tokens, limits=[cap])
                below["feasible"] += 1
            except dflop.InfeasibleError:
                below["failed_s"].append(time.perf_counter() - start)
    out = {name: {k: v for k, v in r.items()} for name, r in rows.items()}
    out["below"] = below
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--markdown", default=None, help="rewrite this README section")
    args = parser.parse_args(argv)
    lines = [
        "Command: `python benchmarks/bench_packing.py --markdown benchmarks/README.md`",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{baselines.machine_info()}; {args.batches} batches per setting; costs: the "
        "analytic LLM cost (siglip-400m + llm-7b); the text-heavy mix is chosen to mix "
        "many short sequences with long ones. Peers re-implemented from their descriptions "
        "(`benchmarks/peers.py`).",
        "",
        "| samples | token cap | mix | method | microbatches (mean) | vs FFD | slowest / mean "
        "microbatch (mean, worst) | slowest / its bound (mean, worst) | microbatches over "
        "the cap | ms per call (median) |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    failing = []
    for num_samples in SAMPLES:
        for cap in CAPS:
            for mix_name, mix in MIXES.items():
                r = run(num_samples, cap, mix, args.batches)
                ffd_counts = np.array(r["NeMo FFD"]["count"])
                for name, m in r.items():
                    if name == "below":
                        continue
                    counts = np.array(m["count"])
                    lines.append(
                        f"| {num_samples:,} | {cap:,} | {mix_name} | {name} | "
                        f"{counts.mean():.1f} | {np.mean(counts - ffd_counts):+.1f} | "
                        f"{np.mean(m['balance']):.3f}, {np.max(m['balance']):.3f} | "
                        f"{np.mean(m['excess']):.3f}, {np.max(m['excess']):.3f} | "
                        f"{int(np.sum(m['over']))} | {1e3 * np.median(m['s']):.2f} |"
                    )
                    print(lines[-1], file=sys.stderr, flush=True)
                b = r["below"]
                failing.append(
                    f"| {num_samples:,} | {cap:,} | {mix_name} | {b['feasible']} of "
                    f"{args.batches} | "
                    + (
                        f"{1e3 * np.median(b['failed_s']):.2f} / {1e3 * np.max(b['failed_s']):.2f}"
                        if b["failed_s"]
                        else "-"
                    )
                    + " |"
                )
    lines += [
        "",
        "dflop at one microbatch fewer than first-fit decreasing needs: how often it still "
        "meets the cap, and how long a failing call takes (median / worst ms; it raises "
        "`InfeasibleError` saying no schedule was found within the budget).",
        "",
        "| samples | token cap | mix | met below FFD's count | failing call ms |",
        "|---:|---:|---|---:|---:|",
        *failing,
    ]
    body = "\n".join(lines)
    print(body)
    if args.markdown:
        baselines.write_section(args.markdown, "bench_packing", body, "## `bench_packing.py`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
