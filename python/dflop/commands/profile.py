"""``dflop profile-data`` and ``dflop inspect``: dataset shapes and their summaries."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflop.commands.args import non_negative_int, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_profile_data(subparsers)
    register_profile_model(subparsers)
    _register_inspect(subparsers)


def _register_profile_data(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile-data",
        help="turn a LLaVA-style dataset (JSON, JSONL or YAML recipe) into sample shapes",
        description="Read every sample's conversations, image sizes (file headers only) and "
        "video frame counts, apply the model family's tiling rules and save the shape "
        "distribution. Unreadable samples are counted and reported, not fatal (unless "
        "--strict).",
    )
    p.add_argument("dataset", help="a .json, .jsonl or .yaml recipe file")
    p.add_argument("--family", default="llava-ov", help="shape rules: llava-ov or internvl")
    p.add_argument("-o", "--output", required=True, help="output .json or .parquet")
    p.add_argument("--image-folder", default=None, help="root of relative image paths")
    p.add_argument("--video-folder", default=None, help="root of relative video paths")
    p.add_argument(
        "--allow-outside-paths",
        action="store_true",
        help="accept image/video paths that are absolute or lead outside --image-folder / "
        "--video-folder ('..', symlinks); by default such a sample is skipped "
        "(outside_folder) without opening its files",
    )
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder (optional)")
    p.add_argument("--max-samples", type=positive_int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of random: sampling strategies")
    p.add_argument("--strict", action="store_true", help="stop at the first bad sample")
    p.add_argument("--plot", default=None, metavar="PNG", help="also write histograms")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=run_profile_data)


def _register_inspect(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="summarise a shapes, performance-model or plan file",
        description="Print a summary of a file written by dflop (shape distribution, "
        "performance model, plan); --plot writes histograms for shape files.",
    )
    p.add_argument("file")
    p.add_argument("--plot", default=None, metavar="PNG")
    p.set_defaults(handler=run_inspect)


def run_profile_data(args: argparse.Namespace) -> int:
    from dflop.data import profile_dataset
    from dflop.safe_io import check_regular_file
    from dflop.train.config import check_output_path

    if not Path(args.dataset).exists():
        raise FileNotFoundError(f"dataset file not found: {args.dataset}")
    if Path(args.dataset).is_dir():
        raise ValueError(f"{args.dataset} is a folder; give a .json, .jsonl or .yaml file")
    check_regular_file(args.dataset, "dataset")  # a named pipe would block open() forever
    check_output_path("-o/--output", args.output)
    check_output_path("--plot", args.plot)
    _check_not_an_input(args)
    distribution = profile_dataset(
        args.dataset,
        args.family,
        image_folder=args.image_folder,
        video_folder=args.video_folder,
        tokenizer=args.tokenizer,
        strict=args.strict,
        progress=not args.no_progress,
        seed=args.seed,
        max_samples=args.max_samples,
        allow_outside_paths=args.allow_outside_paths,
    )
    if len(distribution.samples) == 0:  # nothing to save: say why instead
        reasons = ", ".join(f"{r} x{n}" for r, n in sorted(distribution.skipped.items()))
        example = distribution.skipped_examples[0]["message"] if reasons else ""
        raise ValueError(
            f"{args.dataset}: no sample could be profiled (read {distribution.num_read}"
            + (f"; skipped {reasons}, e.g. {example}" if reasons else "")
            + "); nothing written"
        )
    distribution.save(args.output)
    print(distribution.summary())
    print(f"\nwrote {args.output}")
    if args.plot:
        distribution.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def _check_not_an_input(args: argparse.Namespace) -> None:
    """No output may be written over what the command reads: the dataset file, a recipe's
    dataset files (each compared by where it leads, not how it is written)."""
    import os

    from dflop.data.dataset import dataset_sources

    inputs = {os.path.realpath(args.dataset)}
    if Path(args.dataset).suffix in (".yaml", ".yml"):
        sources = dataset_sources(
            args.dataset, image_folder=args.image_folder, video_folder=args.video_folder
        )
        inputs |= {os.path.realpath(source.path) for source in sources}
    for flag, path in (("-o/--output", args.output), ("--plot", args.plot)):
        if path is not None and os.path.realpath(path) in inputs:
            raise ValueError(
                f"{flag} {path} is a file this command reads (the dataset); writing the "
                "shapes there would destroy it: give another output path"
            )


def _kind(path: Path) -> str:
    from dflop.safe_io import load_json, open_regular

    if path.suffix == ".parquet":
        return "dflop.shape_distribution"
    with open_regular(path, "r", "file") as f:  # a named pipe: refused, not opened
        try:
            header = load_json(f)
        except ValueError as error:  # invalid JSON, not UTF-8, nested too deeply
            raise ValueError(f"{path} is not a JSON file written by dflop: {error}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a file written by dflop (top level is not an object)")
    return str(header.get("format", header.get("kind", "unknown")))


def run_inspect(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.exists():
        raise FileNotFoundError(f"file not found: {path}")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a file written by dflop")
    kind = _kind(path)
    inspectors = _inspectors()
    if kind in inspectors:
        return inspectors[kind](path, args)
    raise ValueError(
        f"{path}: unknown file kind {kind!r}; dflop inspect reads {', '.join(inspectors)} files"
    )


def _inspect_shapes(path: Path, args: argparse.Namespace) -> int:
    from dflop.data import ShapeDistribution

    distribution = ShapeDistribution.load(path)
    print(distribution.summary())
    if args.plot:
        distribution.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def _inspectors() -> dict:
    """File inspectors by the ``format`` field dflop writes into each file."""
    return {
        "dflop.shape_distribution": _inspect_shapes,
        "dflop.performance_model": _inspect_performance_model,
        "dflop.plan": _inspect_plan,
    }


def _inspect_plan(path: Path, args: argparse.Namespace) -> int:
    from dflop.planner import Plan

    print(Plan.load(path).table())
    return 0


def _inspect_performance_model(path: Path, args: argparse.Namespace) -> int:
    from dflop.profiling import PerformanceModel

    print(PerformanceModel.load(path).summary())
    return 0


def register_profile_model(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile-model",
        help="time forward+backward of encoder and LLM, fit the performance model",
        description="Time forward+backward (no optimizer) of the encoder (+ projector) over "
        "numbers of visual units and of the LLM over packed sequence mixes, measure peak "
        "memory, fit encoder time = a*units + c and LLM time = a*tokens + b*sum(seq^2) + c, "
        "and save the model with the hardware it was measured on.",
    )
    p.add_argument(
        "--encoder",
        default="tiny",
        help="dflop.models vision preset (tiny, small, siglip-400m) or 'module:factory' "
        "returning a module that maps pixels [U,C,H,W] to features [U*tokens, hidden]",
    )
    p.add_argument(
        "--llm",
        default="tiny",
        help="dflop.models decoder preset (tiny, small, llm-0.5b, llm-7b) or 'module:factory'",
    )
    p.add_argument(
        "--model",
        default=None,
        help="profile this whole model instead of --encoder/--llm: hf:PATH (a local "
        "Hugging Face model folder; weights from it, else a seeded init) or a reference "
        "preset (tiny, small+tiny, ...)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="float32 (CPU default) or bfloat16 (GPU default)",
    )
    p.add_argument(
        "--max-units", type=positive_int, default=None, help="largest encoder microbatch"
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=None, help="largest packed LLM microbatch"
    )
    p.add_argument(
        "--frozen-shapes",
        type=non_negative_int,
        default=8,
        help="shapes per module on which the forward alone and the frozen pass-through step "
        "are timed too (what --trainable regimes run; 0: none)",
    )
    p.add_argument("--warmup", type=non_negative_int, default=1)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True, help="performance model JSON")
    p.set_defaults(handler=run_profile_model)


def _built(spec: str, flag: str, device, dtype):
    """The module a user's 'module:factory' spec builds, on ``device`` in ``dtype`` (None
    for a preset name)."""
    import importlib

    import torch

    if ":" not in spec:
        return None
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr, None)
    if not callable(factory):
        raise ValueError(f"{flag} {spec}: module {module_name} has no callable {attr!r}")
    module = factory()
    if not isinstance(module, torch.nn.Module):
        raise ValueError(
            f"{flag} {spec}: the factory returned {type(module).__name__}, not a torch.nn.Module"
        )
    return module.to(device=device, dtype=dtype)


def _build_modules(args: argparse.Namespace, device, dtype):
    """(vision, decoder, image shape, vocabulary, longest sequence): a model's spec
    (``--model``: its whole encoder and LLM as stages), dflop's reference presets
    (projector sized for the decoder), or modules from users' factories."""
    from dflop.models import build_model

    if args.model is not None:
        from dflop.models.registry import model_spec

        spec = model_spec(args.model)
        encoder, image_shape, unit_tokens = spec.profiled_encoder(
            seed=args.seed, device=device, dtype=dtype
        )
        llm = spec.whole_module("llm", seed=args.seed, device=device, dtype=dtype)
        vocab = spec.architecture()[1].vocab_size
        args.unit_tokens = unit_tokens
        return encoder, llm, image_shape, vocab, spec.max_seq_len

    reference = None
    if ":" not in args.encoder or ":" not in args.llm:
        encoder = args.encoder if ":" not in args.encoder else "tiny"
        llm = args.llm if ":" not in args.llm else "tiny"
        reference = build_model(f"{encoder}+{llm}", seed=args.seed, device=device, dtype=dtype)
    vision = _built(args.encoder, "--encoder", device, dtype) or reference.vision
    decoder = _built(args.llm, "--llm", device, dtype) or reference.decoder
    config = getattr(decoder, "config", None)
    max_seq_len = getattr(config, "max_seq_len", None)
    return vision, decoder, None, None, max_seq_len


def run_profile_model(args: argparse.Namespace) -> int:
    import torch

    from dflop.profiling import (
        default_seq_len_mixes,
        default_unit_counts,
        fit_performance_model,
        profile_model,
    )
    from dflop.train.config import check_output_path

    check_output_path("-o/--output", args.output)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: profile on cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (use --device cpu)")
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    vision, decoder, image_shape, vocab_size, max_seq_len = _build_modules(args, device, dtype)
    max_units = args.max_units or (64 if on_gpu else 8)
    max_tokens = args.max_tokens or (16384 if on_gpu else 1024)
    if max_seq_len is not None:
        max_tokens = min(max_tokens, max_seq_len)
    result = profile_model(
        vision,
        decoder,
        device=device,
        image_shape=image_shape,
        vocab_size=vocab_size,
        unit_counts=default_unit_counts(max_units),
        seq_len_mixes=default_seq_len_mixes(max_tokens),
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        num_threads=None if on_gpu else args.threads,
        frozen_shapes=args.frozen_shapes,
    )
    from dflop.train.planning import per_token

    perf = fit_performance_model(result, holdout_fraction=0.25, seed=args.seed)
    perf = per_token(perf, getattr(args, "unit_tokens", None))
    perf.save(args.output)
    print(perf.summary())
    print(f"\nwrote {args.output}")
    return 0
