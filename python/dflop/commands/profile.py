"""``dflop profile-data`` and ``dflop inspect``: dataset shapes and their summaries."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
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
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder (optional)")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of random: sampling strategies")
    p.add_argument("--strict", action="store_true", help="stop at the first bad sample")
    p.add_argument("--plot", default=None, metavar="PNG", help="also write histograms")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=run_profile_data)

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

    if not Path(args.dataset).exists():
        raise FileNotFoundError(f"dataset file not found: {args.dataset}")
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
    )
    distribution.save(args.output)
    print(distribution.summary())
    print(f"\nwrote {args.output}")
    if args.plot:
        distribution.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def _kind(path: Path) -> str:
    if path.suffix == ".parquet":
        return "dflop.shape_distribution"
    with path.open() as f:
        try:
            header = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not a JSON file written by dflop: {error}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a file written by dflop (top level is not an object)")
    return str(header.get("format", header.get("kind", "unknown")))


def run_inspect(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.exists():
        raise FileNotFoundError(f"file not found: {path}")
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
    return {"dflop.shape_distribution": _inspect_shapes}
