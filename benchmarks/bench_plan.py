"""Planner benchmark: the paper's setting in simulation (issue 4).

64 A100-80GB GPUs (8 per node, 312 TFLOP/s bf16 at 40% MFU, NVLink 300 GB/s, IB 25 GB/s
per GPU), LLaVA-OneVision/InternVL-like models (InternViT-6B-like encoder with 7B, 8B, 32B
and 72B LLMs), the embedded synthetic data mix, global batch 256. Per setting, three
methods choose a layout on the same sampled batches:

- data-blind: Megatron-LM style, the encoder inside the first pipeline stage, uniform
  layers, equal-count microbatches in dataset order; the best such layout found by the
  same simulation-based search (strategy "data_blind"). Where the LLM's tp does not divide
  the ViT's 25 heads, they are padded to a multiple of tp as NVLM does in Megatron-LM
  (25 -> 32 at tp=8), the dummy heads costing compute, parameters and activations.
- reference: the reference's optimizer: disjoint encoder/LLM GPUs chosen by its closed
  form (m + S - 1) x slowest stage on MEAN sample shapes; every step balanced per bin
  (here with dflop's scheduler, stronger than its CP-SAT under a time limit), no
  microbatch ordering (strategy "mean_shape"). Its layout is the one its estimate ranks
  first (not the best simulated of several), scored by the same simulation as the others.
- dflop: simulation over sampled batches, full cost breakdown, microbatch ordering.

Each chosen layout is then scored on held-out batches (other seeds) with its own schedule,
so that no method is judged on the batches it was chosen on. Also reported: the gain of
microbatch ordering (the same layout with and without it) and the planning time for 1,024
GPUs. ``--markdown benchmarks/README.md`` rewrites the section between the
``bench_plan`` markers and keeps the rest of the file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import dflop
import numpy as np
from dflop.data.costs import AnalyticCostModel
from dflop.planner import (
    ClusterSpec,
    PlannerConfig,
    evaluate_layout,
    prepare_inputs,
    search_layouts,
)

SETTINGS = (
    ("vit-6b", "llm-7b"),
    ("vit-6b", "llm-8b"),
    ("vit-6b", "llm-32b"),
    ("vit-6b", "llm-72b"),
)
CLUSTER = ClusterSpec(
    num_gpus=64,
    gpus_per_node=8,
    gpu_memory_bytes=80e9,
    intra_node_bandwidth_bytes_per_s=300e9,
    inter_node_bandwidth_bytes_per_s=25e9,
)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402

IDLE_TARGET = 0.15
TOP_K = 10  # layouts kept per method, for the held-out memory fallback


def run_setting(encoder: str, llm: str, args: argparse.Namespace) -> dict:
    model = AnalyticCostModel(encoder, llm)
    config = PlannerConfig(num_batches=args.batches, seed=0, top_k=1)
    inputs = prepare_inputs(
        model,
        model.encoder,
        model.llm,
        global_batch=args.global_batch,
        num_batches=args.batches,
        seed=0,
    )
    held_out = prepare_inputs(
        model,
        model.encoder,
        model.llm,
        global_batch=args.global_batch,
        num_batches=args.held_out,
        seed=10_000,
    )
    row: dict = {"setting": f"{encoder} + {llm}"}
    # The reference does not reorder microbatches: it is scored without it.
    no_order = PlannerConfig(num_batches=args.batches, seed=0, top_k=1, order_microbatches=False)
    for name, strategy, cfg in (
        ("blind", "data_blind", config),
        ("reference", "mean_shape", no_order),
        ("dflop", "data_aware", config),
        ("dflop_no_order", "data_aware", no_order),
    ):
        start = time.perf_counter()
        layouts, raw = search_layouts(CLUSTER, inputs, cfg, strategy=strategy)
        elapsed = time.perf_counter() - start
        if not layouts:
            row[name] = None
            continue
        # A held-out batch may need more memory than the search's batches did (a larger
        # largest bin); then every method falls back, in its own ranking, to the next layout
        # that fits (as it would have chosen with those batches in its sample).
        ranked, _ = search_layouts(CLUSTER, inputs, cfg, strategy=strategy, top_k=TOP_K)
        fits = []
        for chosen in ranked:
            try:
                fits.append(evaluate_layout(CLUSTER, held_out, chosen, cfg))
            except dflop.InfeasibleError:
                fits.append(None)
                continue
            break
        if fits[-1] is None:
            row[name] = None
            continue
        rank, scored = len(fits) - 1, fits[-1]
        row[name] = {
            "layout": scored,
            "plan_s": elapsed,
            "stats": raw["stats"],
            "rank": rank,
            "estimate_s": chosen.prediction.estimate_s,
            "search_step_s": chosen.prediction.step_time_s,
        }
    return row


def plan_time_1024(args: argparse.Namespace) -> tuple[float, str, dict]:
    model = AnalyticCostModel("vit-6b", "llm-72b")
    inputs = prepare_inputs(
        model,
        model.encoder,
        model.llm,
        global_batch=args.big_batch,
        num_batches=args.big_batches,
        seed=0,
    )
    cluster = ClusterSpec(num_gpus=1024)
    start = time.perf_counter()
    layouts, raw = search_layouts(
        cluster, inputs, PlannerConfig(num_batches=args.big_batches, top_k=1)
    )
    return time.perf_counter() - start, layouts[0].describe(), raw["stats"]


def fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def render(
    rows: list[dict], big: tuple[float, str, dict], args: argparse.Namespace, total_s: float
) -> str:
    lines = [
        "Command: `python benchmarks/bench_plan.py --markdown benchmarks/README.md`",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; total run "
        f"time {total_s:.0f} s",
        f"- Machine: {baselines.machine_info()} (planning times only; everything else is simulated)",
        f"- Python {platform.python_version()}, numpy {np.__version__}, dflop {dflop.__version__}",
        f"- Simulated cluster: {CLUSTER.num_gpus} A100-80GB, {CLUSTER.gpus_per_node} per node, "
        "312 TFLOP/s bf16 at 40% MFU (`AnalyticCostModel`), NVLink 300 GB/s, IB 25 GB/s per "
        f"GPU; global batch {args.global_batch}; embedded synthetic mix (InternVL shape rules "
        f"for the 6B ViT); layouts chosen on {args.batches} sampled batches (seeds 0..), "
        f"scored on {args.held_out} held-out batches (seeds 10000..)",
        "- Throughput = global batch / mean simulated step time; idle = GPU-seconds not "
        "computing over all GPUs (pipeline bubbles, imbalance, all-reduce, waiting)",
        "",
        "| setting | method | layout | samples/s | step s | GPU idle | dflop speed-up |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        dflop_step = row["dflop"]["layout"].prediction.step_time_s
        for key, label in (
            ("blind", "data-blind (Megatron-LM style)"),
            ("reference", "reference (mean-shape optimizer)"),
            ("dflop_no_order", "dflop without microbatch ordering"),
            ("dflop", "**dflop**"),
        ):
            entry = row[key]
            if entry is None:
                lines.append(f"| {row['setting']} | {label} | no layout fits |  |  |  |  |")
                continue
            p = entry["layout"].prediction
            speed = p.step_time_s / dflop_step
            note = (
                f" (its #{entry['rank'] + 1}: #1 over memory on held-out)" if entry["rank"] else ""
            )
            lines.append(
                f"| {row['setting']} | {label} | {entry['layout'].describe().replace('|', ';')}{note} | "
                f"{p.throughput_samples_per_s:.2f} | {p.step_time_s:.2f} | "
                f"{fmt_pct(p.idle_fraction)} | {speed:.2f}x |"
            )
    lines += [
        "",
        "Data-blind baseline: Megatron-LM's LLaVA model runs a colocated encoder at the LLM's "
        "tp (its own encoder TP needs an encoder pipeline stage on other GPUs), so for the "
        "25-head ViT at tp > 1 it pads the heads with dummy zero heads as NVLM does (25 -> 28 "
        "at tp=4, 32 at tp=8); the dummy heads cost their compute (x1.10 for the ViT's layers "
        "at 32 heads), parameters and activations. Without padding only tp=1 is possible and "
        "no colocated 32B/72B layout fits in 80 GB. Each method's layout is its #1 unless that "
        "one is over memory on a held-out batch (larger largest bin), then its next that fits.",
    ]
    lines += ["", "Microbatch ordering (dflop's chosen layout, held-out batches):", ""]
    lines += [
        "| setting | step as scheduled s | step with ordering s | gain |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        p = row["dflop"]["layout"].prediction
        gain = p.step_time_as_scheduled_s / p.step_time_s - 1
        lines.append(
            f"| {row['setting']} | {p.step_time_as_scheduled_s:.3f} | {p.step_time_s:.3f} | "
            f"{100 * gain:.2f}% |"
        )
    idle_ok = all(r["dflop"]["layout"].prediction.idle_fraction < IDLE_TARGET for r in rows)
    never_slower = all(
        r["dflop"]["layout"].prediction.step_time_s
        <= min(r[k]["layout"].prediction.step_time_s for k in ("blind", "reference") if r[k])
        * (1 + 1e-9)
        for r in rows
    )
    lines += [
        "",
        "Reference (mean-shape optimizer): its estimate of its chosen layout vs the simulation "
        "(same scheduler, same memory model, same layout space as dflop's disaggregated "
        "search):",
        "",
        "| setting | samples per bin | estimate s | simulated s (search batches) | "
        "simulated s (held-out) | busiest stage's compute s (held-out) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ref = row["reference"]
        if ref is None:
            continue
        lp = ref["layout"]
        per_bin = lp.global_batch / (lp.num_microbatches * lp.llm.dp)
        lines.append(
            f"| {row['setting']} | {per_bin:.1f} | {ref['estimate_s']:.2f} | "
            f"{ref['search_step_s']:.2f} | {lp.prediction.step_time_s:.2f} | "
            f"{max(lp.prediction.stage_compute_s):.2f} |"
        )
    lines += [
        "",
        "The weakness is the method's own, not the reproduction's: on mean shapes every bin "
        "holds the mean sample, so the estimate sees perfectly balanced stages and picks the "
        "most microbatches (the smallest fill/drain bubble), about one sample per bin. Its "
        "estimate of the busiest stage's work is right (compare the last two columns), but "
        "with one heavy-tailed sample per bin (the largest LLM sample of a batch is ~4x the "
        "mean) the encoder and the LLM take turns being the slow stage from one microbatch to "
        "the next, so each microbatch costs the max of the two and the step comes out "
        "1.4-2.7x the estimate; only a simulation over sampled batches sees that. Its "
        "layout is the one its estimate ranks first (the argmin over the same layout space, "
        "memory check and microbatch counts as dflop's disaggregated search; ties broken the "
        "same way, which is at least as good as any order-dependent acceptance), balanced "
        "every step by dflop's own scheduler (stronger than the reference's time-limited "
        "CP-SAT) and scored by the same simulation, without microbatch ordering (which it "
        "does not do).",
    ]
    plan_times = ", ".join(f"{r['setting']} {r['dflop']['plan_s']:.2f} s" for r in rows)
    big_s, big_layout, big_stats = big
    lines += [
        "",
        f"- Targets: dflop idle < {100 * IDLE_TARGET:.0f}% in every setting: "
        f"**{'met' if idle_ok else 'NOT met'}**; dflop never slower than either baseline: "
        f"**{'met' if never_slower else 'NOT met'}**",
        f"- dflop planning time at 64 GPUs: {plan_times}",
        f"- Planning time for 1,024 GPUs (vit-6b + llm-72b, global batch {args.big_batch}, "
        f"{args.big_batches} batches, {os.cpu_count()} threads): **{big_s:.2f} s** "
        f"({big_stats['num_candidates']:,} candidates, "
        f"{big_stats['num_memory_rejected']:,} over memory, "
        f"{big_stats['num_pruned']:,} pruned by bound, of which "
        f"{big_stats['num_pruned_after_schedule']:,} only after balancing "
        f"({big_stats['num_balanced']:,} balance calls for {big_stats['num_scheduled']:,} "
        f"layouts), {big_stats['num_simulated']} simulated in full); "
        f"best: {big_layout.replace('|', ';')}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=8, help="sampled batches for the search")
    parser.add_argument("--held-out", type=int, default=8, help="held-out batches for scoring")
    parser.add_argument("--big-batch", type=int, default=2048, help="global batch at 1,024 GPUs")
    parser.add_argument("--big-batches", type=int, default=2, help="sampled batches at 1,024 GPUs")
    parser.add_argument("--markdown", default=None, help="rewrite this README section")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = []
    for encoder, llm in SETTINGS:
        row = run_setting(encoder, llm, args)
        rows.append(row)
        print(f"{row['setting']}: done", file=sys.stderr)
    big = plan_time_1024(args)
    body = render(rows, big, args, time.perf_counter() - start)
    print(body)
    if args.markdown:
        baselines.write_section(args.markdown, "bench_plan", body, "## `bench_plan.py`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
