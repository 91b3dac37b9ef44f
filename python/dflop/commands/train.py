"""``dflop train``: train the reference multimodal model with dflop's per-step scheduling."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dflop.commands.args import positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train the multimodal model: heterogeneous pipeline, per-step balancing",
        description="Train dflop's reference model (encoder and LLM on disjoint ranks, 1F1B "
        "pipeline) with every step's batch balanced by dflop.schedule() (or data-blind). "
        "Spawns local processes (gloo on CPU), or runs as one rank under torchrun. Prints "
        "loss, step time, samples/s, tokens/s and each stage's busy share per step, and a "
        "summary; writes the measured timeline as Chrome-trace JSON and PNG.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--plan", default=None, help="plan JSON from 'dflop plan' (best layout)")
    where.add_argument(
        "--layout",
        default=None,
        help="manual layout, e.g. 'enc_dp=1,enc_pp=1,llm_dp=1,llm_pp=1,m=4' "
        "(default: plan for --nproc local processes)",
    )
    p.add_argument("--data", default="synthetic", help="synthetic, shapes file or LLaVA dataset")
    p.add_argument("--image-folder", default=None, help="root of a dataset's image paths")
    p.add_argument("--video-folder", default=None, help="root of a dataset's video paths")
    p.add_argument("--family", default="llava-ov", help="dataset shape rules")
    p.add_argument(
        "--no-check-images",
        action="store_true",
        help="do not decode each record's images before its first step (a file that does "
        "not decode then fails the run instead of being replaced by a redraw)",
    )
    p.add_argument(
        "--model",
        "--preset",
        dest="model",
        default="tiny",
        help="reference model preset (tiny, small, small+tiny, ...) or hf:PATH, a local "
        "Hugging Face model folder (needs --data: a LLaVA-style dataset)",
    )
    p.add_argument(
        "--nproc", type=positive_int, default=None, help="local processes (default: layout's)"
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=positive_int, default=None, help="samples per step")
    p.add_argument("--num-microbatches", type=positive_int, default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--grad-clip", type=float, default=1.0, help="global gradient norm limit (0: none)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--schedule",
        choices=("dflop", "blind", "compare"),
        default="dflop",
        help="dflop (balanced), blind (equal-count), compare (both on every step)",
    )
    p.add_argument("--perf", default=None, help="performance model JSON (default: quick profile)")
    p.add_argument("--no-adaptive", action="store_true", help="no online cost-model correction")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="no measured time reaches a schedule (fixed cost model: --perf, the plan's or "
        "the analytic one; no correction, calibration or deadlines): the same command gives "
        "the same schedules and losses in every run and resume",
    )
    p.add_argument(
        "--no-pipeline-schedule",
        action="store_true",
        help="balanced schedule only, not refined for the encoder -> LLM pipeline",
    )
    p.add_argument(
        "--max-growth",
        type=float,
        default=1.05,
        help="pipeline refinement: microbatch load bound, x the balanced makespan",
    )
    p.add_argument("--mix", default=None, help="synthetic mix JSON, e.g. '{\"text\": 0.4, ...}'")
    p.add_argument("--scaler", default=None, help="ShapeScaler arguments as JSON")
    p.add_argument("--checkpoint-dir", default=None, help="save here; resume from here")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps (0: at the end)")
    p.add_argument(
        "--save-hf",
        default=None,
        metavar="DIR",
        help="hf:PATH models: save the trained model here at the end, in the Hugging Face layout",
    )
    p.add_argument("--trace", default=None, help="Chrome-trace JSON of the measured timeline")
    p.add_argument("--png", default=None, help="PNG Gantt chart of the measured timeline")
    p.add_argument("--trace-steps", type=int, default=2, help="last steps in the timeline")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--oversubscribe",
        action="store_true",
        help="start more local processes than this machine's limit (4 per core, 512 MiB each)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout (s)")
    p.add_argument("--debug", action="store_true", help="shape headers on every message")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument("--json", default=None, metavar="PATH", help="write metrics JSON here")
    p.add_argument(
        "--calibrate-steps",
        type=int,
        default=0,
        help="planning here: first run N steps of the chosen layout and re-plan with what "
        "they measured (corrected cost model, link latency, forward shares)",
    )
    p.set_defaults(handler=run)


def _json_arg(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object")
    return value


def data_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields of the data options that 'dflop train' and 'dflop plan
    --local' share."""
    return {
        "data": args.data,
        "image_folder": args.image_folder,
        "video_folder": args.video_folder,
        "family": args.family,
        "mix": _json_arg(args.mix, "--mix"),
        "scaler": _json_arg(args.scaler, "--scaler") or {},
    }


def run(args: argparse.Namespace) -> int:
    from dflop.train import TrainConfig
    from dflop.train.config import check_output_path

    check_output_path("--json", args.json)  # before training, not after it
    config = TrainConfig(
        model=args.model,
        plan=args.plan,
        layout=args.layout,
        nproc=args.nproc,
        num_microbatches=args.num_microbatches,
        **data_settings(args),
        global_batch=args.global_batch,
        check_images=not args.no_check_images,
        steps=args.steps,
        lr=args.lr,
        grad_clip_norm=args.grad_clip or None,
        seed=args.seed,
        schedule=args.schedule,
        perf=args.perf,
        adaptive=not args.no_adaptive,
        deterministic=args.deterministic,
        pipeline_schedule=not args.no_pipeline_schedule,
        max_growth=args.max_growth,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        save_hf=args.save_hf,
        trace=args.trace,
        png=args.png,
        trace_steps=args.trace_steps,
        log_every=0 if args.quiet else 1,
        debug=args.debug,
        device=args.device,
        oversubscribe=args.oversubscribe,
        timeout_s=args.timeout,
        calibrate_steps=args.calibrate_steps,
    )
    return train_main(config, args.json)


def train_main(config, json_path: str | None = None) -> int:
    """Run, print the summary; a failed rank is one clear error and exit code 1."""
    from dflop.runtime.launch import SpawnError
    from dflop.train.run import print_summary, run_training

    try:
        report = run_training(config)
    except SpawnError as error:
        print(f"dflop train: error: {error}", file=sys.stderr)
        return 1
    if report is None:  # a torchrun rank other than 0
        return 0
    print()
    rows = print_summary(report)
    stopped = report.stats.get("stopped_after_step")
    bad = report.stats.get("bad_records") or []
    if bad:
        print(
            f"skipped {len(bad)} record(s) whose images do not decode "
            f"({report.stats['samples_replaced']} batch sample(s) redrawn), e.g. {bad[0]}"
        )
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "layout": report.layout,
                    "steps": [m.to_dict() for m in report.metrics],
                    "summary": {k: v.to_dict() for k, v in rows.items()},
                    "bad_records": bad,
                    "samples_replaced": report.stats.get("samples_replaced", 0),
                },
                f,
                indent=1,
            )
    if stopped is not None:
        saved = f"; checkpoint in {config.checkpoint_dir}" if config.checkpoint_dir else ""
        print(f"dflop train: stopped by SIGTERM after step {stopped}{saved}", file=sys.stderr)
        return 143  # 128 + SIGTERM, what schedulers expect of a terminated job
    return 0
