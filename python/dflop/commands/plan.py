"""``dflop plan`` and ``dflop simulate``: choose a parallel layout; simulate a planned step."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any

from dflop.commands.args import json_object, positive_int, virtual_stage_list
from dflop.planner.model import PLACEMENTS, placement_candidates


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="choose the encoder/LLM parallel layout from the data (simulated steps)",
        description="Search (tp, pp, dp) for the encoder and the LLM on disjoint GPUs, the "
        "layer split and the number of microbatches; score each layout by simulating steps "
        "on global batches sampled from the shapes; print the best layouts and the "
        "data-blind baseline, and write the plan JSON the trainer reads.",
    )
    p.add_argument(
        "--perf",
        default="analytic",
        help="performance model JSON (dflop.profiling) or 'analytic' (FLOP model, default)",
    )
    p.add_argument("--encoder", default="siglip-400m", help="encoder preset (default siglip-400m)")
    p.add_argument("--llm", default="llm-7b", help="LLM preset (default llm-7b)")
    p.add_argument(
        "--model",
        "--preset",
        dest="model",
        default=None,
        help="plan this model instead of --encoder/--llm: hf:PATH (a local Hugging Face "
        "model folder: its architecture from config.json) or a reference preset; with "
        "--local, the model trained (default tiny)",
    )
    p.add_argument(
        "--shapes", default="synthetic", help="ShapeDistribution JSON/Parquet or 'synthetic'"
    )
    p.add_argument("--gpus", type=positive_int, default=None, help="number of GPUs (or --local)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--gpu-memory-gb", type=float, default=80.0)
    p.add_argument("--intra-node-gbps", type=float, default=300.0, help="GB/s per GPU (NVLink)")
    p.add_argument("--inter-node-gbps", type=float, default=25.0, help="GB/s per GPU (network)")
    p.add_argument(
        "--global-batch", type=positive_int, default=None, help="samples (256; local 16)"
    )
    p.add_argument("--gpu-flops", type=float, default=312e12, help="analytic: peak FLOP/s")
    p.add_argument("--mfu", type=float, default=0.4, help="analytic: achieved fraction")
    p.add_argument("--batches", type=positive_int, default=4, help="sampled batches per candidate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=positive_int, default=5, help="layouts to keep (default 5)")
    p.add_argument(
        "--virtual-stages",
        type=virtual_stage_list,
        default=(1,),
        help="LLM model chunks per stage to try, e.g. 1,2 (interleaved 1F1B; default 1: off)",
    )
    p.add_argument(
        "--trainable",
        default="full",
        help="which parts train: full, projector, frozen-vision, or part=mode pairs such as "
        "'encoder=frozen,llm=frozen' (as dflop train --trainable); the plan prices what that "
        "regime runs and holds",
    )
    p.add_argument(
        "--lora-rank", type=int, default=16, help="LoRA's rank, for a --trainable with lora parts"
    )
    p.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default=None,
        help="--gpus: the training precision the plan prices (default bf16: bf16 weights, "
        "activations and gradients); dflop train runs fp32 only for now and refuses a bf16 "
        "plan (--local plans price what dflop train runs)",
    )
    p.add_argument(
        "--no-zero1",
        action="store_true",
        help="--gpus: price every optimizer state on every data-parallel replica instead of "
        "sharded over them (ZeRO-1, the default); dflop train runs unsharded only for now",
    )
    p.add_argument(
        "--zero-bubble",
        action="store_true",
        help="also score each kept layout under the zero-bubble order zb-h1 and keep it where "
        "it is faster and fits",
    )
    p.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="any",
        help="where the encoder may go: any (default), disaggregated (GPUs of its own) or "
        "colocated (inside the LLM's first stage, as the data-blind baseline)",
    )
    p.add_argument("--no-prune", action="store_true", help="simulate every candidate")
    p.add_argument("--reference", action="store_true", help="also run the mean-shape optimizer")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    local = p.add_argument_group(
        "local processes",
        "--local N plans dflop's reference model for N local CPU processes, as 'dflop train' "
        "trains it (same data, shape scaling and performance model: --perf FILE or a quick "
        "profile); 'dflop train --plan' then runs the plan and compares its prediction.",
    )
    local.add_argument(
        "--local", type=positive_int, default=None, metavar="N", help="local processes"
    )
    local.add_argument("--data", default="synthetic", help="synthetic, shapes file or dataset")
    local.add_argument("--image-folder", default=None, help="root of a dataset's image paths")
    local.add_argument("--video-folder", default=None, help="root of a dataset's video paths")
    local.add_argument(
        "--allow-outside-paths",
        action="store_true",
        help="accept dataset image/video paths that are absolute or leave the folders "
        "(as 'dflop train --allow-outside-paths')",
    )
    local.add_argument("--family", default="llava-ov", help="dataset shape rules (local)")
    local.add_argument("--layout", default=None, help="force a layout: enc_dp=2,llm_pp=1,m=8")
    local.add_argument(
        "--num-microbatches", type=positive_int, default=None, help="restrict m (local)"
    )
    local.add_argument("--mix", type=json_object, default=None, help="synthetic mix JSON (local)")
    local.add_argument(
        "--scaler", type=json_object, default={}, help="ShapeScaler arguments as JSON (local)"
    )
    local.add_argument(
        "--calibrate-steps",
        type=int,
        default=16,
        help="run N real steps of the chosen layout on this machine first and re-plan with "
        "what they measured (default 16; 0: the profile alone)",
    )
    p.set_defaults(handler=run_plan, local_defaults=_defaults(local))

    s = subparsers.add_parser(
        "simulate",
        help="re-simulate one sampled step of a plan and write its timeline",
        description="Re-simulate one of the plan's sampled batches under the chosen layout "
        "from the step the plan recorded (schedule, encoder split, every replica's stage "
        "times: what the planner scored), print the planned and re-simulated step time and "
        "write the timeline as Chrome-trace JSON and/or a PNG Gantt chart. Layouts without "
        "a record (the baseline, the runners-up) are rebuilt from the plan's inputs.",
    )
    s.add_argument("plan", help="plan JSON written by 'dflop plan'")
    s.add_argument("--layout", type=int, default=0, help="index of the layout (0 = best)")
    s.add_argument("--baseline", action="store_true", help="simulate the data-blind baseline")
    s.add_argument("--batch", type=int, default=0, help="which sampled batch (default 0)")
    s.add_argument("--trace", default=None, help="Chrome-trace JSON output (Perfetto)")
    s.add_argument("--png", default=None, help="PNG Gantt chart output (needs matplotlib)")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(handler=run_simulate)


def _defaults(group: argparse._ArgumentGroup) -> dict[str, tuple[str, Any]]:
    """A group's settings: destination -> (its flag, its default)."""
    return {
        action.dest: (action.option_strings[0], action.default)
        for action in group._group_actions
        if action.dest != "local"
    }


def _performance_model(perf: str, encoder: Any, llm: Any, gpu_flops: float, mfu: float) -> Any:
    if perf == "analytic":
        from dflop.data.costs import AnalyticCostModel

        return AnalyticCostModel(encoder, llm, gpu_flops=gpu_flops, mfu=mfu)
    if not os.path.exists(perf):
        raise FileNotFoundError(f"--perf {perf}: no such file (or use --perf analytic)")
    try:
        from dflop.profiling import CostModel, PerformanceModel
    except ImportError as error:
        raise ImportError(
            f"--perf {perf}: loading a measured performance model needs dflop.profiling "
            f"({error}); use --perf analytic"
        ) from None
    loader = getattr(CostModel, "load", None)
    if callable(loader):
        return loader(perf)
    return CostModel(PerformanceModel.load(perf))


def _shapes(shapes: str) -> Any:
    if shapes == "synthetic":
        return None
    if not os.path.exists(shapes):
        raise FileNotFoundError(f"--shapes {shapes}: no such file (or use --shapes synthetic)")
    from dflop.data.distribution import ShapeDistribution

    return ShapeDistribution.load(shapes)


def _configs(encoder: Any, llm: Any) -> tuple[Any, Any]:
    from dflop.data.costs import ENCODER_PRESETS, LLM_PRESETS, EncoderConfig, LLMConfig

    def resolve(kind: str, value: Any, presets: dict, cls: type) -> Any:
        if isinstance(value, dict):
            return cls(**value)
        if value not in presets:
            raise ValueError(
                f"unknown {kind} preset {value!r}; known: {', '.join(sorted(presets))}"
            )
        return presets[value]

    return (
        resolve("encoder", encoder, ENCODER_PRESETS, EncoderConfig),
        resolve("llm", llm, LLM_PRESETS, LLMConfig),
    )


def run_plan(args: argparse.Namespace) -> int:
    from dflop.planner import ClusterSpec, PlannerConfig, plan
    from dflop.train.config import check_output_path

    check_output_path("-o/--output", args.output)  # before planning, not after it
    if args.local is not None:
        for flag, given in (("--precision", args.precision), ("--no-zero1", args.no_zero1)):
            if given:
                raise ValueError(
                    f"{flag} is a setting of --gpus planning; --local plans price what dflop "
                    "train runs here (fp32, every optimizer state on every replica)"
                )
        if args.shapes != "synthetic":
            raise ValueError(
                "--shapes is the data of --gpus planning; with --local give the data as "
                "--data (a shapes file or a dataset)"
            )
        return _run_local_plan(args)
    if args.gpus is None:
        raise ValueError("pass --gpus N (a GPU cluster) or --local N (local CPU processes)")
    for dest, (flag, default) in args.local_defaults.items():
        if getattr(args, dest) != default:  # silently ignored otherwise
            where = (
                "; for --gpus give the data's shapes as --shapes (dflop profile-data "
                "DATASET -o shapes.json makes them)"
                if dest in ("data", "image_folder", "video_folder")
                else ""
            )
            raise ValueError(f"{flag} is a setting of --local N planning{where}")
    args.global_batch = args.global_batch or 256

    if args.model is not None:
        from dflop.models.registry import model_spec

        encoder, llm = model_spec(args.model).architecture()
    else:
        encoder, llm = _configs(args.encoder, args.llm)
    model = _performance_model(args.perf, encoder, llm, args.gpu_flops, args.mfu)
    cluster = ClusterSpec(
        num_gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_bytes=args.gpu_memory_gb * 1e9,
        intra_node_bandwidth_bytes_per_s=args.intra_node_gbps * 1e9,
        inter_node_bandwidth_bytes_per_s=args.inter_node_gbps * 1e9,
    )
    config = PlannerConfig(
        num_batches=args.batches,
        seed=args.seed,
        top_k=args.top,
        prune=not args.no_prune,
        reference=args.reference,
        virtual_stage_choices=args.virtual_stages,
        trainable=args.trainable,
        lora_rank=args.lora_rank,
        zero_bubble=args.zero_bubble,
        element_bytes=4 if args.precision == "fp32" else 2,
        zero1=not args.no_zero1,
        **placement_candidates(args.placement),
    )
    inputs = {
        "model": args.model,
        "perf": args.perf if args.perf == "analytic" else os.path.abspath(args.perf),
        "gpu_flops": args.gpu_flops,
        "mfu": args.mfu,
        "shapes": args.shapes if args.shapes == "synthetic" else os.path.abspath(args.shapes),
    }
    result = plan(
        model,
        encoder,
        llm,
        cluster,
        global_batch=args.global_batch,
        shapes=_shapes(args.shapes),
        config=config,
        inputs_description=inputs,
    )
    if args.output:
        result.save(args.output)
    if args.json:
        print(result.to_json())
    else:
        print(result.table())
        if args.output:
            print(f"plan written to {args.output}")
    return 0


def _run_local_plan(args: argparse.Namespace) -> int:
    """``dflop plan --local N``: the plan 'dflop train --nproc N' would make (or, with
    --layout, the given layout scored the same way), saved for 'dflop train --plan'."""
    from dflop.train import TrainConfig
    from dflop.train.run import prepare

    config = TrainConfig(
        model=args.model or "tiny",
        layout=args.layout,
        nproc=args.local,
        num_microbatches=args.num_microbatches,
        data=args.data,
        image_folder=args.image_folder,
        video_folder=args.video_folder,
        allow_outside_paths=args.allow_outside_paths,
        family=args.family,
        mix=args.mix,
        scaler=args.scaler,
        global_batch=args.global_batch or 16,
        seed=args.seed,
        perf=None if args.perf == "analytic" else args.perf,
        calibrate_steps=args.calibrate_steps,
        trainable=args.trainable,
        lora_rank=args.lora_rank,
        placement=args.placement,
    )
    prepared = prepare(
        config,
        log=lambda text: print(text, file=sys.stderr),
        launches=config.calibrate_steps > 0,
    )
    result = prepared.plan
    result.layouts = result.layouts[: args.top]  # the planner kept more to pick from
    if args.output:
        result.save(args.output)
    if args.json:
        print(result.to_json())
    else:
        print(f"{prepared.description}")
        print(result.table())
        if args.output:
            # The plan carries its model, data and regime: the command trains what was
            # planned (dflop train --plan takes them unless told otherwise).
            print(f"plan written to {args.output}; train it with: dflop train --plan {args.output}")
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    from dflop.planner import Plan
    from dflop.train.config import check_output_path

    for flag, path in (("--trace", args.trace), ("--png", args.png)):
        check_output_path(flag, path)
    if os.path.isdir(args.plan):
        raise ValueError(f"{args.plan} is a folder; give a plan JSON written by 'dflop plan'")
    plan = Plan.load(args.plan)
    if args.baseline:
        if plan.baseline is None:
            raise ValueError(f"{args.plan} has no data-blind baseline")
        layout = plan.baseline
    else:
        if not 0 <= args.layout < len(plan.layouts):
            raise ValueError(f"--layout {args.layout} is out of range [0, {len(plan.layouts)})")
        layout = plan.layouts[args.layout]
    num_batches = len(layout.prediction.step_times_s)
    if not 0 <= args.batch < num_batches:
        raise ValueError(f"--batch {args.batch} is out of range [0, {num_batches})")
    planned = layout.prediction.step_times_s[args.batch]
    if layout.steps:
        result = layout.steps[args.batch].simulate()
        source = "recorded"
    else:
        result = _rebuilt(plan, layout, args.batch)
        source = "rebuilt"
    if args.trace:
        result.write_chrome_trace(args.trace)
    if args.png:
        result.write_gantt_png(args.png, title=layout.describe())
    summary = {
        "layout": layout.describe(),
        "batch": args.batch,
        "source": source,
        "planned_step_time_s": planned,
        "step_time_s": result.step_time_s,
        "idle_fraction_of_pipeline_stages": result.idle_fraction,
        "num_events": int(result.events.shape[0]),
        "trace": args.trace,
        "png": args.png,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(
            f"{layout.describe()}: batch {args.batch} re-simulated from the {source} step: "
            f"{result.step_time_s:.3f} s (planned {planned:.3f} s)"
        )
        for path in (args.trace, args.png):
            if path:
                print(f"wrote {path}")
    return 0


def _rebuilt(plan: Any, layout: Any, batch: int) -> Any:
    """A layout without a recorded step: rebuild the sampled batch from the plan's inputs
    and simulate it."""
    from dflop.planner import PlannerConfig, prepare_inputs, simulate_layout
    from dflop.planner.result import plan_zero1

    info = plan.inputs
    encoder, llm = _configs(info.get("encoder", "siglip-400m"), info.get("llm", "llm-7b"))
    model = _performance_model(
        info.get("perf", "analytic"),
        encoder,
        llm,
        info.get("gpu_flops", 312e12),
        info.get("mfu", 0.4),
    )
    config = PlannerConfig(
        seed=int(info.get("seed", 0)),
        element_bytes=int(info.get("element_bytes", 2)),
        zero1=plan_zero1(info),
        loss_chunk_tokens=int(info.get("loss_chunk_tokens", PlannerConfig.loss_chunk_tokens)),
        trainable=str(info.get("trainable", "full")),
        lora_rank=int(info.get("lora_rank", 16)),
    )
    if "forward_fraction" in info:  # what the plan was scored with
        config = replace(config, forward_fraction=tuple(info["forward_fraction"]))
    inputs = prepare_inputs(
        model,
        encoder,
        llm,
        global_batch=plan.global_batch,
        shapes=_shapes(info.get("shapes", "synthetic")),
        num_batches=int(info.get("num_batches", 1)),
        seed=config.seed,
        forward_fraction=config.forward_fraction,
        element_bytes=config.element_bytes,
        loss_chunk_tokens=config.loss_chunk_tokens,
        trainable=config.trainable,
        lora_rank=config.lora_rank,
    )
    return simulate_layout(plan.cluster, inputs, layout, config, batch=batch)
