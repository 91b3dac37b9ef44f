"""``dflop demo``: the main job on the embedded synthetic workload (no data, no GPU)."""

from __future__ import annotations

import argparse

from dflop.commands.args import positive_int


def start_early(argv: list[str]) -> None:
    """The full demo trains on local processes: their fork server starts now, importing
    torch and the trainer while this process profiles (see ``dflop.commands.train``)."""
    if "--scheduler-only" in argv or "--help" in argv or "-h" in argv:
        return
    from dflop.runtime.launch import start_fork_server

    start_fork_server(["dflop.train.run", "dflop.train.trainer"])


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the main job: profile, plan, train dflop vs data-blind (no data, no GPU)",
        description="Profile the model on this CPU, profile the embedded synthetic data, plan "
        "for 2 local processes (an encoder stage and an LLM stage), train a few dozen steps "
        "with every step run both with dflop's scheduling and data-blind, and print the "
        "comparison (step time, idle share, throughput); the measured timelines go to "
        "--out. With --scheduler-only: balance synthetic global batches of a large model "
        "with dflop.schedule() and with a data-blind split (no training).",
    )
    p.add_argument(
        "--scheduler-only", action="store_true", help="only compare schedules (no training)"
    )
    p.add_argument(
        "--steps", type=positive_int, default=None, help="steps (default 24; 20 scheduler-only)"
    )
    p.add_argument("--global-batch", type=positive_int, default=None, help="samples (24; 256)")
    p.add_argument(
        "--num-microbatches", type=positive_int, default=8, help="microbatches per DP rank"
    )
    p.add_argument("--out", default="dflop-demo-out", help="output folder (full demo)")
    p.add_argument("--preset", default="small+tiny", help="model preset trained (full demo)")
    p.add_argument("--seed", type=int, default=0)
    only = p.add_argument_group("--scheduler-only options")
    only.add_argument("--dp-size", type=positive_int, default=4, help="data-parallel ranks")
    only.add_argument("--encoder", default="siglip-400m", help="encoder preset for the costs")
    only.add_argument("--llm", default="llm-7b", help="LLM preset for the costs")
    only.add_argument("--time-budget-ms", type=float, default=None, help="scheduler budget")
    only.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if not args.scheduler_only:
        from dflop.commands.demo_job import FullDemoConfig, run_full_demo
        from dflop.runtime.launch import SpawnError
        from dflop.train.config import check_output_path

        check_output_path("--out", args.out, kind="folder")

        config = FullDemoConfig(
            steps=args.steps or 24,
            global_batch=args.global_batch or 24,
            num_microbatches=args.num_microbatches,
            preset=args.preset,
            out_dir=args.out,
            seed=args.seed,
        )
        try:
            run_full_demo(config)
        except SpawnError as error:
            import sys

            print(f"dflop demo: error: {error}", file=sys.stderr)
            return 1
        return 0

    from dflop.commands.demo_job import DemoConfig, demo_json, print_demo, run_demo

    config = DemoConfig(
        num_steps=args.steps or 20,
        global_batch=args.global_batch or 256,
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
