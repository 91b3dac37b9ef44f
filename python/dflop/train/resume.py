"""What a resumed run may change: every setting is either honoured or refused by name.

A checkpoint saves the run's settings beside each step (``settings.json``). A run that
resumes from it compares its own, field by field, before any process starts:

- :data:`MUST_MATCH`: what the saved weights and the steps' batches mean (the model, the
  seed, the data and how it is read, a plan's inputs). A change is refused, naming the
  field and both values: resume with the saved value or use another checkpoint folder.
- :data:`LAYOUT_FIELDS`: the layout (plan file, manual layout, process count, batch,
  microbatches). Honoured when they give the checkpoint's layout, else refused.
- :data:`HONOURED`: everything else (learning rate, weight decay, clipping, total steps,
  scheduling, outputs, runtime limits). A change applies from the first resumed step and
  is said in one line per field.

A test keeps the three sets equal to :class:`~dflop.train.config.TrainConfig`'s fields,
so a new field cannot be dropped silently on resume.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from dflop.errors import bounded_repr

__all__ = [
    "HONOURED",
    "LAYOUT_FIELDS",
    "MUST_MATCH",
    "ResumePoint",
    "check_data",
    "check_layout",
    "check_settings",
    "resume_point",
    "run_settings",
]

MUST_MATCH: dict[str, str] = {
    "model": "the checkpoint holds this model's weights",
    "seed": "step k's batch and the initial weights come from (seed, k)",
    "data": "the steps draw their batches from it",
    "image_folder": "the dataset's images are read from it",
    "video_folder": "the dataset's videos are read from it",
    "family": "it decides every sample's shapes",
    "mix": "the synthetic steps draw their batches from it",
    "scaler": "it decides every sample's shapes",
    "max_seq_len": "it decides which samples are cut or skipped",
    "too_long": "it decides which samples are cut or skipped",
    "allow_outside_paths": "it decides which dataset records are read",
    "calibrate_steps": "calibration chooses the layout; a resumed run keeps the saved one",
    "memory_gb": "the layout was fitted into it; a resumed run keeps the saved layout",
    "trainable": "which weights train and which have optimizer state",
    "lora_rank": "the LoRA adapters' shapes",
    "lora_alpha": "the LoRA adapters' update scale",
    "lora_dropout": "the LoRA adapters' training",
    "lora_targets": "which layers have LoRA adapters",
}
"""Settings a resumed run must keep, with why."""

LAYOUT_FIELDS: tuple[str, ...] = (
    "plan",
    "layout",
    "nproc",
    "global_batch",
    "num_microbatches",
    "placement",
)
"""Settings honoured when they give the checkpoint's layout (else refused)."""

HONOURED: dict[str, str] = {
    "steps": "the run continues up to it",
    "lr": "the optimizer's learning rate",
    "weight_decay": "the optimizer's weight decay",
    "grad_clip_norm": "gradient clipping",
    "scheduler": "how every step's batch is split",
    "perf": "the cost model the schedules are made with",
    "adaptive": "the cost model's online correction",
    "pipeline_schedule": "the schedules' pipeline refinement",
    "pipeline_order": "the pipeline order (it reorders a step's work; gradients do not change)",
    "max_growth": "the schedules' memory bound",
    "lookahead": "how many schedules are made ahead",
    "schedule_deadline": "the schedules' deadline",
    "deterministic": "timing-free scheduling and deterministic kernels",
    "loss_chunk_tokens": "the loss's chunking (the loss and gradients do not change)",
    "check_images": "the images' check before the first step",
    "checkpoint_dir": "the checkpoint folder",
    "resume_on_changed_data": "whether a resume accepts a dataset that changed",
    "checkpoint_every": "how often checkpoints are written",
    "checkpoint_every_min": "how often checkpoints are written",
    "save_hf": "the Hugging Face model written at the end",
    "save_hf_replace": "whether that model may replace a folder's files",
    "metrics_jsonl": "where the per-step metrics go",
    "output_dir": "where the metrics and the loggers' files go",
    "log": "the loggers",
    "wandb_project": "the W&B project",
    "wandb_mode": "the W&B mode",
    "peak_tflops": "the peak MFU is reported against",
    "trace": "the timeline written",
    "png": "the timeline written",
    "profile_trace": "the profiler trace written",
    "trace_steps": "the steps the timeline shows",
    "memory_report": "the memory report",
    "log_every": "the log",
    "progress": "the progress bar",
    "debug": "the pipeline's shape headers",
    "device": "the device the ranks run on",
    "launch": "how the ranks are started",
    "oversubscribe": "the local process limit",
    "timeout_s": "the collectives' time limit",
    "run_timeout_s": "the run's time limit",
    "threads": "torch threads per process",
}
"""Settings a resumed run takes from its own command line, with what they change."""

_SAID = frozenset(
    (
        "lr",
        "weight_decay",
        "grad_clip_norm",
        "scheduler",
        "perf",
        "adaptive",
        "pipeline_schedule",
        "max_growth",
        "lookahead",
        "schedule_deadline",
        "deterministic",
        "loss_chunk_tokens",
    )
)
"""Honoured changes that change the training, said when they differ (the others, such
as outputs and limits, are simply this run's)."""

_PATHS = ("data", "image_folder", "video_folder", "plan", "perf")


class ResumePoint:
    """The checkpoint a run will resume from and the settings saved beside it."""

    def __init__(self, folder: Path, settings: dict[str, Any]):
        self.folder = folder
        self.settings = settings

    @property
    def saved_config(self) -> dict[str, Any]:
        from dflop.train.config import RENAMED_FIELDS

        saved = dict(self.settings.get("config") or {})
        for old, new in RENAMED_FIELDS.items():  # saved by an older release
            if old in saved:
                saved.setdefault(new, saved.pop(old))
        return saved


def run_settings(
    config: Any, layout: Any = None, data: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What a checkpoint saves of its run: the settings (file paths made absolute, so a
    resume from another working folder compares the same files), the layout and the
    dataset's :meth:`~dflop.data.reader.RecordSet.fingerprint` (``data``)."""
    values = config.to_dict()
    for name in _PATHS:
        if isinstance(values.get(name), str) and values[name] != "synthetic":
            values[name] = os.path.realpath(values[name])
    return {
        "config": values,
        "layout": None if layout is None else layout.to_dict(),
        "data": data,
    }


def check_data(
    config: Any, records: Any, point: ResumePoint, log: Callable[[str], None] = print
) -> None:
    """Refuse to resume on records other than the checkpoint's (a batch is a list of
    positions in them: other records, other samples than the run it continues), in one
    line naming the dataset, unless ``config.resume_on_changed_data`` (then said)."""
    saved = point.settings.get("data")
    fingerprint = getattr(records, "fingerprint", None)
    if not saved or fingerprint is None:  # synthetic data, or saved before fingerprints
        return
    mine = fingerprint()
    if mine == saved:
        return
    counts = (
        f"{saved['records']} usable records then, {mine['records']} now"
        if saved.get("records") != mine["records"]
        else f"the same number of usable records ({mine['records']}), other contents or order"
    )
    if config.resume_on_changed_data:
        log(
            f"note: {config.data} changed since the checkpoint ({counts}); resuming on it as "
            "asked (--resume-on-changed-data): the next steps train other samples than an "
            "uninterrupted run would have"
        )
        return
    raise ValueError(
        f"cannot resume from {point.folder}: the dataset {config.data} changed since the "
        f"checkpoint was saved ({counts}), so the steps after it would train other samples "
        "than the run it continues. Resume on the data it was saved with, use another "
        "--checkpoint-dir, or give --resume-on-changed-data to continue on the changed data"
    )


def resume_point(checkpoint_dir: str | None) -> ResumePoint | None:
    """The intact checkpoint in ``checkpoint_dir`` a run would resume from, with its saved
    settings; None when there is none (or it was saved without settings)."""
    from dflop.runtime.topology import RuntimeLayout
    from dflop.train.checkpoint import checkpoint_settings, find_checkpoint

    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        return None
    root = Path(checkpoint_dir)
    steps = sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True)
    newest = next((s for s in map(checkpoint_settings, steps) if s and "layout" in s), None)
    if newest is None:
        return None
    world_size = RuntimeLayout.from_dict(newest["layout"]).world_size
    found = find_checkpoint(root, world_size, log=lambda message: None)
    settings = checkpoint_settings(found) if found is not None else None
    return None if settings is None else ResumePoint(found, settings)


def check_settings(config: Any, point: ResumePoint, log: Callable[[str], None] = print) -> None:
    """Refuse a change to a :data:`MUST_MATCH` setting (naming every changed one); say
    each :data:`HONOURED` change."""
    mine = run_settings(config)["config"]
    saved = point.saved_config
    changed = [n for n in mine if n in saved and mine[n] != saved[n]]
    refused = [n for n in changed if n in MUST_MATCH]
    if refused:
        details = "; ".join(
            f"{n}={bounded_repr(mine[n])}, the checkpoint's {bounded_repr(saved[n])} "
            f"({MUST_MATCH[n]})"
            for n in refused
        )
        raise ValueError(
            f"cannot resume from {point.folder} with other settings: {details}. Resume with "
            "the checkpoint's values, or use another --checkpoint-dir"
        )
    for name in changed:
        if name in HONOURED and name in _SAID:
            log(
                f"resuming with {name}={bounded_repr(mine[name])} instead of the checkpoint's "
                f"{bounded_repr(saved[name])}: {HONOURED[name]} follows this run's setting"
            )
    layout = point.settings.get("layout")
    if layout is not None:
        _check_layout_numbers(config, point, layout)


def _check_layout_numbers(config: Any, point: ResumePoint, layout: dict[str, Any]) -> None:
    """A layout reused from the checkpoint ignores these settings: each must agree with it
    or be left out (checked before any profiling or planning)."""
    from dflop.runtime.topology import RuntimeLayout

    saved = RuntimeLayout.from_dict(layout)
    for name, value in (
        ("nproc", saved.world_size),
        ("global_batch", saved.global_batch),
        ("num_microbatches", saved.num_microbatches),
    ):
        if getattr(config, name) not in (None, value):
            raise ValueError(
                f"cannot resume from {point.folder} with {name}={getattr(config, name)}: its "
                f"layout has {name}={value}. Leave it out (or give {value}), or use another "
                "--checkpoint-dir"
            )


def check_layout(config: Any, layout: Any, point: ResumePoint) -> None:
    """Refuse a layout other than the checkpoint's, naming the settings that chose it."""
    from dflop.runtime.topology import RuntimeLayout
    from dflop.train.checkpoint import layout_identity

    saved = RuntimeLayout.from_dict(point.settings["layout"])
    mine, theirs = layout_identity(layout.to_dict()), layout_identity(saved.to_dict())
    if mine == theirs:
        return
    given = [
        f"{n}={bounded_repr(getattr(config, n))}"
        for n in LAYOUT_FIELDS
        if getattr(config, n) is not None
    ]
    differences = [
        f"{key} {bounded_repr(a)} vs the checkpoint's {bounded_repr(b)}"
        for key, a, b in _layout_differences(mine, theirs)
    ]
    raise ValueError(
        f"cannot resume from {point.folder}: this run's layout differs from the checkpoint's "
        f"({'; '.join(differences[:4])})"
        + (f", chosen by {', '.join(given)}" if given else "")
        + ". Resume with the checkpoint's layout (leave out --plan/--layout to reuse it), "
        "or use another --checkpoint-dir"
    )


def _layout_differences(
    mine: dict[str, Any], saved: dict[str, Any], prefix: str = ""
) -> list[tuple[str, Any, Any]]:
    out: list[tuple[str, Any, Any]] = []
    for key in sorted(set(mine) | set(saved)):
        a, b = mine.get(key), saved.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _layout_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append((prefix + key, a, b))
    return out
