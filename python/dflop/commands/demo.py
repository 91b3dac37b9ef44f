"""``dflop demo``: the main job on the embedded synthetic workload."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="dflop vs a data-blind split on the embedded synthetic workload (no data, no GPU)",
        description="Balance synthetic global batches with dflop.schedule() and with a "
        "data-blind equal-count split; print the largest bin load, the lower bound, "
        "their ratio and the time taken, per step and in total.",
    )
    p.add_argument("--steps", type=int, default=20, help="number of steps (default 20)")
    p.add_argument("--global-batch", type=int, default=256, help="samples per step")
    p.add_argument("--num-microbatches", type=int, default=8, help="microbatches per DP rank")
    p.add_argument("--dp-size", type=int, default=4, help="data-parallel ranks")
    p.add_argument("--encoder", default="siglip-400m", help="encoder preset for the costs")
    p.add_argument("--llm", default="llm-7b", help="LLM preset for the costs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-ms", type=float, default=None, help="scheduler budget")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from dflop.demo import DemoConfig, demo_json, print_demo, run_demo

    config = DemoConfig(
        num_steps=args.steps,
        global_batch=args.global_batch,
        num_microbatches=args.num_microbatches,
        dp_size=args.dp_size,
        encoder=args.encoder,
        llm=args.llm,
        seed=args.seed,
        time_budget_ms=args.time_budget_ms,
    )
    steps = run_demo(config)
    if args.json:
        print(demo_json(config, steps))
    else:
        print_demo(config, steps)
    return 0
