"""``dflop train``: train the reference multimodal model with dflop's per-step scheduling."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflop.commands.args import json_object


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train the multimodal model: heterogeneous pipeline, per-step balancing",
        description="Train dflop's reference model or a Hugging Face model (encoder and LLM "
        "on disjoint ranks, 1F1B pipeline) with every step's batch balanced by "
        "dflop.schedule() (or data-blind). Spawns local processes (gloo on CPU), or runs as "
        "one rank under torchrun. Prints loss, step time, samples/s, tokens/s and each "
        "stage's busy share per step, and a summary; writes the measured timeline as "
        "Chrome-trace JSON and PNG. Every setting is a TrainConfig field: a --config file "
        "(TOML or YAML, one table per section below) and these flags (which override it) "
        "set them.",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="settings file (.toml or .yaml): tables [model], [data], [optim], [schedule], "
        "[output], [runtime] of the fields below",
    )
    p.add_argument("--quiet", action="store_true", help="no per-step lines (log_every = 0)")
    p.add_argument("--json", default=None, metavar="PATH", help="write metrics JSON here")
    add_config_arguments(p)
    p.set_defaults(handler=run)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field (``--field-name``, plus the field's own spellings),
    grouped by section, documented by the field; booleans get ``--x`` / ``--no-x``. A flag
    not given leaves the field to the config file or its default."""
    from dflop.train.config import _FIELDS, SECTIONS

    groups = {
        name: parser.add_argument_group(f"[{name}] {title}") for name, title in SECTIONS.items()
    }
    for name, f in _FIELDS.items():
        meta = f.metadata
        flags = meta.get("flags") or (f"--{name.replace('_', '-')}",)
        kwargs: dict[str, Any] = {
            "dest": name,
            "default": argparse.SUPPRESS,
            "help": meta["doc"].replace("%", "%%"),
        }
        kind = str(f.type).split("|")[0].strip()
        if kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind.startswith("dict"):
            kwargs.update(type=json_object, metavar="JSON")
        elif kind in ("int", "float"):
            kwargs["type"] = _number(int if kind == "int" else float, meta.get("zero_is_none"))
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        groups[meta["section"]].add_argument(*flags, **kwargs)


def _number(kind: type, zero_is_none: bool = False) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a{'n integer' if kind is int else ' number'}"
            ) from None
        return None if zero_is_none and value == 0 else value

    return parse


def config_from_args(args: argparse.Namespace) -> Any:
    """The TrainConfig of a parsed ``dflop train`` command line: the --config file's
    settings (if any), overridden by the flags given; with a plan, the settings it was
    made for (its model, data and regime) where neither gives them, said in one line."""
    from dflop.train import TrainConfig
    from dflop.train.config import _FIELDS, read_sections

    flags = {name: value for name, value in vars(args).items() if name in _FIELDS}
    if args.quiet:
        flags["log_every"] = 0
    sections = read_sections(args.config) if args.config is not None else {}
    given = set(flags) | {
        k for table in sections.values() if isinstance(table, dict) for k in table
    }
    model_table = sections.get("model")
    plan = flags.get("plan") or (model_table.get("plan") if isinstance(model_table, dict) else None)
    if plan:
        flags = {**_planned(plan, given), **flags}
    if args.config is not None:
        return TrainConfig.from_sections(sections, source=args.config, **flags)
    return TrainConfig(**flags)


def _planned(plan_path: str, given: set[str]) -> dict[str, Any]:
    """The settings ``plan_path`` was made for that the command line and config file do
    not give, said in one line."""
    import os

    from dflop.planner import Plan
    from dflop.train.config import _FIELDS
    from dflop.train.planning import planned_settings

    if not os.path.isfile(plan_path):
        return {}  # the run's own check says what is wrong with it
    taken = {
        key: value
        for key, value in planned_settings(Plan.load(plan_path), plan_path).items()
        if key not in given and value != _FIELDS[key].default and value not in (None, {})
    }
    if taken:
        shown = " ".join(
            f"{_FIELDS[key].metadata.get('flags', ('--' + key.replace('_', '-'),))[0]} "
            f"{json.dumps(value) if isinstance(value, dict) else value}"
            for key, value in taken.items()
        )
        print(f"training what {plan_path} was planned for: {shown} (a flag overrides)")
    return taken


def run(args: argparse.Namespace) -> int:
    from dflop.train.config import check_output_path

    check_output_path("--json", args.json)  # before training, not after it
    return train_main(config_from_args(args), args.json)


def start_early(argv: Sequence[str]) -> None:
    """Called by the CLI with this command's arguments before anything else is imported:
    for local processes, the fork server that will fork the ranks starts now, so that its
    imports (torch, the trainer, a Hugging Face model's code: seconds) overlap with this
    process's own imports, data reading and profiling instead of following them. Bad
    arguments are left to the parser (the server is stopped when this process exits)."""
    import os

    options = _options(argv)
    if "RANK" in os.environ or options.get("--launch") == "threads" or {"-h", "--help"} & {*argv}:
        return
    from dflop.runtime.launch import start_fork_server

    model = options.get("--model", options.get("--preset"))
    start_fork_server(["dflop.train.run", "dflop.train.trainer", *_hf_modules(model)])


def _options(argv: Sequence[str]) -> dict[str, str]:
    """``--flag value`` and ``--flag=value`` pairs of ``argv`` (a pre-scan; the parser
    checks them)."""
    out = {}
    for i, word in enumerate(argv):
        name, equals, value = word.partition("=")
        if equals:
            out[name] = value
        elif i + 1 < len(argv):
            out[word] = argv[i + 1]
    return out


def _hf_modules(model: str | None) -> list[str]:
    """transformers and the model code of ``hf:DIR`` (its config's model type)."""
    import os
    import re

    if not (isinstance(model, str) and model.startswith("hf:")):
        return []
    try:
        with open(os.path.join(model[3:], "config.json"), encoding="utf-8") as f:
            model_type = json.load(f)["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return ["transformers"]  # the run itself reports what is wrong with the folder
    if not (isinstance(model_type, str) and re.fullmatch(r"[a-z0-9_]+", model_type)):
        return ["transformers"]
    return ["transformers", f"transformers.models.{model_type}.modeling_{model_type}"]


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
        from dflop.output import write_text

        write_text(
            json_path,
            json.dumps(
                {
                    "layout": report.layout,
                    "steps": [m.to_dict() for m in report.metrics],
                    "summary": {k: v.to_dict() for k, v in rows.items()},
                    "planned_step_time_s": report.planned_step_time_s,
                    "bad_records": bad,
                    "samples_replaced": report.stats.get("samples_replaced", 0),
                    "transfer_overlap": report.stats.get("transfer_overlap", []),
                    "memory": report.stats.get("memory", []),
                    "performance_model": report.performance_model,
                },
                indent=1,
            ),
        )
    if stopped is not None:
        from dflop.runtime.launch import StopRequested
        from dflop.train.checkpoint import checkpoint_name

        reason = StopRequested.reason or "SIGTERM"
        saved = (
            f"; checkpoint {Path(config.checkpoint_dir) / checkpoint_name(stopped)} (rerun the "
            "same command to resume)"
            if config.checkpoint_dir
            else "; no --checkpoint-dir, nothing saved"
        )
        print(
            f"dflop train: stopped by {reason} after step {stopped + 1} of {config.steps}{saved}",
            file=sys.stderr,
        )
        # The shell's codes: 128 + SIGINT for Ctrl-C, 128 + SIGTERM for a scheduler's stop.
        return 130 if reason == "Ctrl-C" else 143
    return 0
