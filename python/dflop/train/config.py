"""``TrainConfig``: everything one ``dflop train`` run needs, validated up front.

Errors name the field (``TrainConfig.steps=0 must be >= 1``) so a bad command line or
config file fails at once, before any process starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dflop._deprecated import warn_renamed
from dflop.errors import InputTypeError, bounded_repr
from dflop.models.trainable import DEFAULT_LORA_TARGETS, LoraSettings, TrainableParts
from dflop.planner.model import PLACEMENTS
from dflop.safe_io import not_regular_reason

__all__ = [
    "RENAMED_FIELDS",
    "SCHEDULE_MODES",
    "SECTIONS",
    "TrainConfig",
    "check_local_processes",
    "check_output_path",
    "local_process_limit",
]

SCHEDULE_MODES: tuple[str, ...] = ("dflop", "blind", "compare")

LOGGERS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""``TrainConfig.log``'s loggers, each with the package it needs (the ``log`` extra)."""
WANDB_MODES: tuple[str, ...] = ("online", "offline", "disabled")
DEFAULT_OUTPUT_DIR = "dflop-train-out"
"""The output folder of a run given neither ``output_dir`` nor ``checkpoint_dir``."""
"""``dflop``: every step balanced by ``dflop.schedule()`` (computed one step ahead);
``blind``: equal-count microbatches in dataset order (what a data-blind framework does);
``compare``: every step runs twice on the same weights and batch, once each way (the
optimizer steps once), to measure both on the same steps in the same run."""


SECTIONS: dict[str, str] = {
    "model": "model and layout",
    "data": "data",
    "optim": "optimisation",
    "schedule": "scheduling",
    "output": "output",
    "runtime": "runtime",
}
"""The sections of :class:`TrainConfig` (the tables of a config file), with their titles."""


RENAMED_FIELDS: dict[str, str] = {"schedule": "scheduler"}
"""Old field name -> new one: still read from config files and saved settings (with a
deprecation warning in files) for one release."""

_MIN_TIMEOUT_S = 1.0
_MAX_TIMEOUT_S = 365 * 24 * 3600.0


def _field(section: str, default: Any, doc: str, **cli: Any) -> Any:
    """A TrainConfig field in ``section`` with its documentation; ``cli``: how the
    command line spells it (``flags``: names other than ``--field-name``; ``choices``;
    ``zero_is_none``: the flag's 0 means None)."""
    metadata = {"section": section, "doc": doc, **cli}
    if callable(default) and not isinstance(default, (str, bool, int, float)):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of a training run, in sections (:data:`SECTIONS`): every field documents
    itself (``TrainConfig.field_doc(name)``; ``dflop train --help`` lists them by section).
    Build one from keywords, from nested sections (:meth:`from_sections`) or from a TOML or
    YAML file (:meth:`load`); ``dflop train --config FILE`` reads one, and its flags
    override the file."""

    # [model]
    model: str = _field(
        "model",
        "tiny",
        "dflop's reference model by preset (tiny, small, VISION+DECODER such as small+tiny), "
        "or hf:PATH, a Hugging Face model in a local folder (config.json; its weights, image "
        "processor and tokenizer when present; needs dflop[hf]), trained on a LLaVA-style "
        "dataset by its own shape rules",
        flags=("--model", "--preset"),
    )
    plan: str | None = _field(
        "model", None, "a plan JSON from 'dflop plan' (its best layout is used)"
    )
    layout: str | None = _field(
        "model",
        None,
        "a manual layout, e.g. enc_dp=1,enc_pp=1,llm_dp=1,llm_pp=1,m=4, or "
        "colocated,llm_dp=2,m=4 for the encoder inside the LLM's first stage (with neither plan "
        "nor layout, the planner plans for nproc local processes)",
    )
    placement: str | None = _field(
        "model",
        None,
        "where the planner may put the encoder (planning here, without plan or layout): any "
        "(the default), disaggregated (ranks of its own) or colocated (inside the LLM's "
        "first stage)",
        choices=PLACEMENTS,
    )
    pipeline_order: str | None = _field(
        "model",
        None,
        "the pipeline order every replica runs: 1f1b, gpipe, interleaved-1f1b or zb-h1 (zero "
        "bubble: backwards split into input and weight gradients); default: the plan's, else "
        "1f1b (interleaved-1f1b with llm_v > 1)",
    )
    nproc: int | None = _field(
        "model", None, "local processes to spawn (default: the layout's world size, else 2)"
    )
    num_microbatches: int | None = _field(
        "model", None, "microbatches per step (default: the plan's / layout's)"
    )
    loss_chunk_tokens: int = _field(
        "model",
        1024,
        "the LM head and loss run on a microbatch's target tokens this many at a time, "
        "recomputing each chunk's logits in the backward: logits memory is one chunk x "
        "vocabulary whatever the sample (the profiler, the planner's memory model and the "
        "runtime all use it)",
    )
    trainable: str = _field(
        "model",
        "full",
        "which parts train: full, projector (LLaVA stage 1: only the projector), "
        "frozen-vision (the vision tower frozen), or part=mode pairs such as "
        "'encoder=frozen,llm=frozen' (parts: encoder, projector, llm; modes: full, frozen)",
    )
    lora_rank: int = _field("model", 16, "LoRA's rank r, for parts that train 'lora'")
    lora_alpha: float = _field(
        "model", 32.0, "LoRA's alpha (the adapters' update is scaled by alpha / rank)"
    )
    lora_dropout: float = _field("model", 0.0, "LoRA's dropout on the adapters' input")
    lora_targets: str = _field(
        "model",
        ",".join(DEFAULT_LORA_TARGETS),
        "the linear layers LoRA adapts inside a 'lora' part's layers, by name, comma-separated",
    )
    # [data]
    data: str = _field(
        "data",
        "synthetic",
        "synthetic (the embedded LLaVA-OneVision-like mix), a ShapeDistribution file "
        "(.json/.parquet from 'dflop profile-data'; tensors synthesised from the shapes), or "
        "a LLaVA-style dataset (.json/.jsonl/.yaml; its images, frames and text are loaded, "
        "each rank only its own samples)",
    )
    image_folder: str | None = _field(
        "data", None, "root of a dataset's image paths (default: the dataset file's folder)"
    )
    video_folder: str | None = _field(
        "data", None, "root of a dataset's video paths (default: image_folder)"
    )
    family: str = _field("data", "llava-ov", "shape rules of a dataset (llava-ov or internvl)")
    mix: dict[str, float] | None = _field(
        "data", None, 'synthetic mix override (MixSpec fractions), e.g. {"text": 0.4, ...}'
    )
    scaler: dict[str, Any] = _field(
        "data", dict, "ShapeScaler arguments mapping real shapes onto the small model"
    )
    global_batch: int | None = _field(
        "data", None, "samples per step (default: the plan's, else 16)"
    )
    max_seq_len: int | None = _field(
        "data",
        None,
        "a model with its own shape rules (hf:): the longest sample in LLM tokens (visual + "
        "text); longer ones are handled by too_long, by the data profiler and the runtime "
        "alike (default: the model's position limit, max_position_embeddings)",
    )
    too_long: str = _field(
        "data",
        "truncate",
        "a sample longer than max_seq_len: truncate (cut its text from the end; visual tokens "
        "are never cut, a sample whose visual tokens alone are too long is skipped), skip "
        "(left out, counted in the dataset report) or error (stop, naming it)",
        choices=("truncate", "skip", "error"),
    )
    check_images: bool = _field(
        "data",
        True,
        "decode every dataset record's image files once before its first step (spread over "
        "the ranks) and replace a record whose files do not decode by a seeded redraw, "
        "counted and reported (off: such a file fails the run at the step that decodes it)",
    )
    allow_outside_paths: bool = _field(
        "data",
        False,
        "accept dataset image/video paths that are absolute or lead outside image_folder / "
        "video_folder ('..', symlinks resolved); by default such a record is skipped "
        "(outside_folder) without opening its files",
    )
    # [optim]
    steps: int = _field("optim", 20, "total steps (a resumed run continues up to it)")
    lr: float = _field("optim", 1e-3, "AdamW learning rate")
    weight_decay: float = _field("optim", 0.0, "AdamW weight decay")
    grad_clip_norm: float | None = _field(
        "optim",
        1.0,
        "scale the gradients so that their global norm (all stages, TP shards and modules; "
        "each parameter once) is at most this (none/0: no clipping; the norm is reported)",
        flags=("--grad-clip-norm", "--grad-clip"),
        zero_is_none=True,
    )
    seed: int = _field(
        "optim", 0, "model init and data seed (step k's batch is drawn with (seed, k))"
    )
    # [schedule]
    scheduler: str = _field(
        "schedule",
        "dflop",
        "what makes every step's schedule: dflop (balanced), blind (equal-count), compare "
        "(both on every step)",
        choices=SCHEDULE_MODES,
        flags=("--scheduler", "--schedule"),
    )
    perf: str | None = _field(
        "schedule",
        None,
        "performance model JSON ('dflop profile-model'); default: profile the model quickly "
        "at start",
    )
    adaptive: bool = _field(
        "schedule", True, "correct the cost model from measured microbatch times"
    )
    pipeline_schedule: bool = _field(
        "schedule",
        True,
        "refine every balanced schedule for the encoder -> LLM pipeline "
        "(dflop.pipeline_schedule, in the scheduler's background thread): which samples "
        "share a microbatch and the microbatch order, chosen on the simulated step of the "
        "pipeline order it runs",
    )
    max_growth: float = _field(
        "schedule",
        1.05,
        "no microbatch's encoder or LLM load may grow past this x the balanced schedule's "
        "largest (>= 1): the memory bound the balance gave",
    )
    lookahead: int = _field("schedule", 2, "schedules computed ahead of training (>= 1)")
    schedule_deadline: bool = _field(
        "schedule",
        True,
        "give every schedule a deadline of one step time (off: solve to the end)",
    )
    deterministic: bool = _field(
        "schedule",
        False,
        "no measured time reaches a schedule, so the same command gives the same schedules "
        "and losses in every run and resume. By default dflop mode depends on timing (a "
        "quick timing profile, online correction, fitted link latency and forward shares, "
        "deadlines); deterministic runs use perf (or the plan's model; with neither, the "
        "analytic FLOP model at a nominal rate), never correct or calibrate it, solve every "
        "schedule to the end and set torch.use_deterministic_algorithms",
    )
    # [output]
    checkpoint_dir: str | None = _field(
        "output", None, "checkpoint here; a run resumes from the latest checkpoint here"
    )
    resume_on_changed_data: bool = _field(
        "output",
        False,
        "resume a checkpoint although its dataset's records changed since (edited, "
        "shuffled, cut, an image gone): the steps after it then draw their batches from the "
        "changed records, not the samples an uninterrupted run would have trained on; "
        "without it such a resume is refused",
    )
    checkpoint_every: int = _field(
        "output", 0, "also checkpoint every this many steps (0: by time and at the end only)"
    )
    checkpoint_every_min: float = _field(
        "output",
        10.0,
        "checkpoint when this many minutes passed since the last save (default 10; 0: off; a "
        "Ctrl-C or SIGTERM also saves, after the current step)",
    )
    output_dir: str | None = _field(
        "output",
        None,
        f"the run's output folder: metrics.jsonl and the loggers' files (default: "
        f"--checkpoint-dir, else ./{DEFAULT_OUTPUT_DIR})",
    )
    metrics_jsonl: str | None = _field(
        "output",
        None,
        "one JSON line per step here (run id, time, loss, step time, tokens/s, TFLOP/s, "
        "MFU ...; a resumed run continues it, cutting what followed the checkpoint; a new "
        "run keeps an earlier run's file as NAME.before-TIME.jsonl); default: metrics.jsonl "
        "in the output folder; '' turns it off",
    )
    log: str = _field(
        "output",
        "",
        "loggers besides metrics.jsonl, comma-separated: tensorboard (event files in "
        "OUTPUT_DIR/tensorboard), wandb (Weights & Biases, its files in OUTPUT_DIR/wandb); "
        "install them with the log extra (pip install '.[log]')",
    )
    wandb_project: str = _field("output", "dflop", "the W&B project runs log to")
    wandb_mode: str | None = _field(
        "output",
        None,
        "W&B's mode: online, offline (nothing leaves this machine; 'wandb sync' uploads "
        "it later) or disabled; default: the WANDB_MODE variable, else online",
    )
    peak_tflops: float | None = _field(
        "output",
        None,
        "one device's peak TFLOP/s for MFU (default: a known GPU's dense BF16 peak; on CPU "
        "no peak is known and MFU is not reported)",
        zero_is_none=True,
    )
    save_hf: str | None = _field(
        "output",
        None,
        "a Hugging Face model: write the trained model here at the end, in the Hugging Face "
        "layout (from_pretrained loads it)",
    )
    save_hf_replace: bool = _field(
        "output",
        False,
        "save_hf may name a folder that holds files: the trained model replaces it as a "
        "whole (written beside it, then swapped in); without it such a folder is refused. "
        "The input model's own folder is always refused",
    )
    trace: str | None = _field(
        "output",
        None,
        "Chrome-trace JSON of the measured timeline (compare mode: one per mode, -dflop / "
        "-blind before the extension)",
    )
    png: str | None = _field("output", None, "PNG Gantt chart of the measured timeline")
    profile_trace: str | None = _field(
        "output",
        None,
        "a torch.profiler trace (Chrome JSON, CPU and CUDA) of the last trace_steps steps, "
        "and how much of the GPU transfers overlapped compute in it (processes: one file "
        "per rank, .rankN before the extension; threads: one file, all GPU work, rank 0's "
        "CPU ops)",
    )
    trace_steps: int = _field("output", 2, "how many final steps the timeline shows")
    memory_report: bool = _field(
        "output",
        False,
        "measure every rank's peak memory over the last trace_steps steps and print it beside "
        "what the memory model predicts for its stage on those steps (CPU: torch's profiler "
        "records the allocations, which slows those steps; GPU: the allocator's peak)",
    )
    log_every: int = _field("output", 1, "print a line every this many steps (0: none)")
    progress: bool = _field("output", True, "a progress bar (tqdm) when stdout is a terminal")
    debug: bool = _field("output", False, "shape headers on every pipeline message")
    # [runtime]
    device: str = _field(
        "runtime", "auto", "auto (CUDA if available), cpu or cuda", choices=("auto", "cpu", "cuda")
    )
    launch: str = _field(
        "runtime",
        "auto",
        "how local ranks run: processes (gloo on CPU, NCCL on GPUs, one GPU per rank) or "
        "threads of one process (ranks share the first GPU or the CPU; transfers are "
        "in-process copies on their own CUDA stream); auto: threads where the ranks "
        "outnumber the GPUs, else processes",
        choices=("auto", "processes", "threads"),
    )
    oversubscribe: bool = _field(
        "runtime",
        False,
        "allow more local processes than this machine's limit (4 per core, 512 MiB each); "
        "by default a run that would start more is refused before any process starts",
    )
    timeout_s: float = _field(
        "runtime",
        300.0,
        "limit of every collective (s): a rank waiting longer on a peer fails",
        flags=("--timeout-s", "--timeout"),
    )
    run_timeout_s: float | None = _field(
        "runtime", None, "limit of a whole local run (s; none: only the collectives')"
    )
    memory_gb: float | None = _field(
        "runtime",
        None,
        "memory (GB) each local rank may use, what the planner fits layouts and samples "
        "into (default: on a CPU 80% of this host's RAM split between the processes; on "
        "GPUs the device's memory less an 8% reserve, at least 1 GB)",
    )
    threads: int | None = _field(
        "runtime", None, "torch threads per process (default: cores // processes)"
    )
    calibrate_steps: int = _field(
        "runtime",
        0,
        "planning here (no plan file): first run this many steps of the chosen layout, then "
        "re-plan with the performance model corrected from the measured action times, the "
        "fitted per-transfer latency and the measured forward shares (0: the profile alone)",
    )

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            value = bounded_repr(getattr(self, name))
            return ValueError(f"TrainConfig.{name}={value} must be {rule}")

        def integer(name: str, minimum: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise bad(name, f"an integer >= {minimum}")

        for name, f in _FIELDS.items():  # kinds first: the checks below use the values
            kind = str(f.type)
            value = getattr(self, name)
            if kind == "bool" and not isinstance(value, bool):  # "no" would be truthy
                raise InputTypeError(
                    f"TrainConfig.{name} must be true or false, got {type(value).__name__} "
                    f"{bounded_repr(value)}"
                )
            if kind.startswith("str") and not isinstance(value, str):
                if value is None and "None" in kind:
                    continue
                raise InputTypeError(
                    f"TrainConfig.{name} must be text, got {type(value).__name__} "
                    f"{bounded_repr(value)}"
                )
        integer("steps", 1)
        integer("global_batch", 1, optional=True)
        integer("seed", 0)
        integer("lookahead", 1)
        integer("checkpoint_every", 0)
        integer("trace_steps", 1)
        integer("log_every", 0)
        integer("nproc", 2, optional=True)
        integer("num_microbatches", 1, optional=True)
        integer("threads", 1, optional=True)
        integer("calibrate_steps", 0)
        integer("loss_chunk_tokens", 1)
        integer("max_seq_len", 2, optional=True)
        if self.too_long not in ("truncate", "skip", "error"):
            raise bad("too_long", "'truncate', 'skip' or 'error'")
        for name, positive in (
            ("lr", True),
            ("weight_decay", False),
            ("checkpoint_every_min", False),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, "a number")
            if not math.isfinite(value) or (value <= 0 if positive else value < 0):
                raise bad(name, "finite and > 0" if positive else "finite and >= 0")
        for name in ("timeout_s", "run_timeout_s"):
            value = getattr(self, name)
            if value is None and name == "run_timeout_s":
                continue
            # Below a second no rendezvous completes; past a year is a typo (and past
            # what a timedelta holds).
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not _MIN_TIMEOUT_S <= value <= _MAX_TIMEOUT_S
            ):
                raise bad(
                    name,
                    f"a number of seconds from {_MIN_TIMEOUT_S:g} to {_MAX_TIMEOUT_S:g} "
                    "(one year)" + (" or None" if name == "run_timeout_s" else ""),
                )
        if self.mix is not None and not isinstance(self.mix, Mapping):
            raise InputTypeError(
                f"TrainConfig.mix must be a table of fractions (e.g. {{text = 0.4}}), got "
                f"{type(self.mix).__name__} {bounded_repr(self.mix)}"
            )
        if self.peak_tflops is not None and (
            isinstance(self.peak_tflops, bool)
            or not isinstance(self.peak_tflops, (int, float))
            or not (math.isfinite(self.peak_tflops) and self.peak_tflops > 0)
        ):
            raise bad("peak_tflops", "None or a finite number of TFLOP/s > 0")
        if self.metrics_jsonl is not None and not isinstance(self.metrics_jsonl, str):
            raise bad("metrics_jsonl", "None or a file path")
        if not isinstance(self.log, str):
            raise bad("log", "a comma-separated list of loggers (tensorboard, wandb)")
        for name in self.loggers:
            if name not in LOGGERS:
                raise ValueError(
                    f"TrainConfig.log: unknown logger {bounded_repr(name)}"
                    f"{_did_you_mean(name, LOGGERS)}; known: {', '.join(LOGGERS)}"
                )
            if importlib.util.find_spec(LOGGERS[name]) is None:
                raise ImportError(
                    f"TrainConfig.log: {name} needs the {LOGGERS[name]} package; install the "
                    "log extra (pip install '.[log]' from a clone)"
                )
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise bad("wandb_mode", f"None or one of {', '.join(WANDB_MODES)}")
        if self.memory_gb is not None and (
            isinstance(self.memory_gb, bool)
            or not isinstance(self.memory_gb, (int, float))
            or not (math.isfinite(self.memory_gb) and self.memory_gb > 0)
        ):
            raise bad("memory_gb", "None or a finite number of GB > 0")
        if self.grad_clip_norm is not None and (
            isinstance(self.grad_clip_norm, bool)
            or not isinstance(self.grad_clip_norm, (int, float))
            or not (math.isfinite(self.grad_clip_norm) and self.grad_clip_norm > 0)
        ):
            raise bad("grad_clip_norm", "None or a finite number > 0")
        if (
            isinstance(self.max_growth, bool)
            or not isinstance(self.max_growth, (int, float))
            or not self.max_growth >= 1
        ):
            raise bad("max_growth", "a number >= 1 (inf allowed)")
        if self.scheduler not in SCHEDULE_MODES:
            raise bad("scheduler", f"one of {SCHEDULE_MODES}")
        if self.pipeline_order is not None:
            from dflop.scheduling.actions import PIPELINE_ORDERS

            if str(self.pipeline_order).lower() not in PIPELINE_ORDERS:
                raise bad("pipeline_order", f"one of {PIPELINE_ORDERS}")
        if not isinstance(self.trainable, str):
            raise bad("trainable", "a preset name or 'part=mode,...'")
        try:
            parts = TrainableParts.parse(self.trainable)
        except ValueError as error:
            raise ValueError(f"TrainConfig.trainable: {error}") from None
        object.__setattr__(self, "trainable", str(parts))  # one spelling per regime
        self.trainable_parts()  # the LoRA settings, checked
        if self.device not in ("auto", "cpu", "cuda"):
            raise bad("device", "'auto', 'cpu' or 'cuda'")
        if self.launch not in ("auto", "processes", "threads"):
            raise bad("launch", "'auto', 'processes' or 'threads'")
        if self.placement is not None and self.placement not in PLACEMENTS:
            raise bad("placement", "'any', 'disaggregated' or 'colocated'")
        if self.deterministic and self.calibrate_steps:
            raise ValueError(
                f"TrainConfig.calibrate_steps={self.calibrate_steps}: a deterministic run plans "
                "without timing; set it to 0"
            )
        if self.plan is not None and self.layout is not None:
            raise ValueError("TrainConfig.plan and TrainConfig.layout are exclusive: give one")
        for name in ("plan", "perf"):
            path = getattr(self, name)
            if path is not None and not os.path.exists(path):
                raise FileNotFoundError(f"TrainConfig.{name}={path!r}: no such file")
            if path is not None and (special := not_regular_reason(path)) is not None:
                raise ValueError(f"TrainConfig.{name}={path!r} {special}")
        if self.data != "synthetic" and not os.path.exists(self.data):
            raise FileNotFoundError(
                f"TrainConfig.data={self.data!r}: no such file (or use 'synthetic')"
            )
        if self.data != "synthetic" and (special := not_regular_reason(self.data)) is not None:
            raise ValueError(f"TrainConfig.data={self.data!r} {special}")  # e.g. a named pipe
        if not isinstance(self.scaler, dict):
            raise InputTypeError(
                f"TrainConfig.scaler must be a dict, got {type(self.scaler).__name__}"
            )
        if not isinstance(self.model, str):
            raise bad("model", "a preset name or 'hf:PATH'")
        if self.model.startswith("hf:"):
            folder = self.model[3:]
            if not os.path.isfile(os.path.join(folder, "config.json")):
                raise FileNotFoundError(
                    f"TrainConfig.model={self.model!r}: no config.json in {folder!r} (a local "
                    "Hugging Face model folder; nothing is downloaded)"
                )
        else:
            from dflop.models import model_config

            model_config(self.model)  # raises ValueError naming the preset
            if self.save_hf is not None:
                raise ValueError(
                    f"TrainConfig.save_hf={self.save_hf!r} needs a Hugging Face model "
                    "(model='hf:PATH')"
                )
            if self.max_seq_len is not None:
                raise ValueError(
                    f"TrainConfig.max_seq_len={self.max_seq_len} applies to a Hugging Face "
                    "model (model='hf:PATH'); dflop's reference model trains on shapes scaled "
                    "to fit it (TrainConfig.scaler: max_text_tokens, max_units_per_sample)"
                )
        for name, kind in (
            ("trace", "file"),
            ("png", "file"),
            ("checkpoint_dir", "folder"),
            ("output_dir", "folder"),
            ("save_hf", "folder"),
        ):
            check_output_path(f"TrainConfig.{name}", getattr(self, name), kind)
        if self.save_hf is not None:
            check_export_folder(self.save_hf, self.model[3:], self.save_hf_replace)
        if self.metrics_jsonl:  # its folder is made if need be
            what, path = "TrainConfig.metrics_jsonl", self.metrics_jsonl
            if os.path.isdir(path):
                raise ValueError(f"{what}={path!r} is a folder; give a file path")
            if os.path.exists(path) and not os.access(path, os.W_OK):
                raise PermissionError(f"{what}={path!r} is not writable")
            check_output_path(what, os.path.dirname(os.path.abspath(path)), "folder")
        if self.nproc is not None:
            check_local_processes(self.nproc, self.oversubscribe)
        if self.mix is not None:
            from dflop.data.synthetic import MixSpec

            MixSpec.from_mapping(self.mix)
        if self.scaler:
            from dflop.runtime.synthetic_batch import ShapeScaler

            known = {f.name for f in dataclasses.fields(ShapeScaler)} - {"tokens_per_unit"}
            unknown = sorted(set(self.scaler) - known)
            if unknown:
                raise ValueError(
                    f"TrainConfig.scaler has unknown field {bounded_repr(unknown[0])}; known: "
                    f"{sorted(known)}"
                )
            for name, value in self.scaler.items():
                wanted = bool if name == "visual_newline" else int
                if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
                    if value is None and name in ("max_units_per_sample", "max_text_tokens"):
                        continue
                    raise InputTypeError(
                        f"TrainConfig.scaler[{name!r}] must be {'a bool' if wanted is bool else 'an integer'}, "
                        f"got {type(value).__name__} {bounded_repr(value)}"
                    )

    def trainable_parts(self) -> TrainableParts:
        """The regime with its LoRA settings (``trainable`` and the ``lora_*`` fields)."""
        try:
            lora = LoraSettings(
                rank=self.lora_rank,
                alpha=float(self.lora_alpha),
                dropout=float(self.lora_dropout),
                targets=tuple(t for t in str(self.lora_targets).split(",") if t.strip()),
            )
        except (TypeError, ValueError) as error:
            field_name = str(error).split("=", 1)[0].replace("LoraSettings.", "lora_")
            raise ValueError(f"TrainConfig.{field_name}: {error}") from None
        return dataclasses.replace(TrainableParts.parse(self.trainable), lora=lora)

    @property
    def loggers(self) -> tuple[str, ...]:
        """``log`` as names, in order, each once."""
        names = (n.strip() for n in str(self.log).split(","))
        return tuple(dict.fromkeys(n for n in names if n))

    @property
    def output_folder(self) -> str:
        """Where metrics.jsonl and the loggers' files go: ``output_dir``, else the
        checkpoint folder, else ``./dflop-train-out``."""
        return self.output_dir or self.checkpoint_dir or DEFAULT_OUTPUT_DIR

    @property
    def modes(self) -> tuple[str, ...]:
        """The schedules every step runs, in the order of step 0."""
        return ("dflop", "blind") if self.scheduler == "compare" else (self.scheduler,)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ sections

    @staticmethod
    def field_doc(name: str) -> str:
        """The documentation of field ``name``."""
        return _FIELDS[name].metadata["doc"]

    def to_sections(self) -> dict[str, dict[str, Any]]:
        """The settings as nested sections (what :meth:`from_sections` reads). TOML has no
        null: a field that is None is left out (its default), or written as 0 where 0
        means none (``grad_clip_norm``)."""
        out: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for name, f in _FIELDS.items():
            value = getattr(self, name)
            if value is None and f.metadata.get("zero_is_none"):
                value = 0
            if value is not None:
                out[f.metadata["section"]][name] = value
        return {section: values for section, values in out.items() if values}

    @classmethod
    def from_sections(
        cls, sections: Any, *, source: str = "TrainConfig", **overrides: Any
    ) -> TrainConfig:
        """A config from nested sections (``{"optim": {"lr": 3e-4}, ...}``, the tables of a
        config file), with ``overrides`` (flat field names) on top. Unknown sections and
        fields, and fields in the wrong section, are errors that name them (``source``
        says where they came from)."""
        if not isinstance(sections, Mapping):
            raise InputTypeError(
                f"{source}: expected tables of settings ({', '.join(SECTIONS)}), got "
                f"{type(sections).__name__}"
            )
        values: dict[str, Any] = {}
        for section, table in sections.items():
            if section not in SECTIONS:
                hint = _did_you_mean(str(section), SECTIONS)
                if section in _FIELDS:
                    hint = f" ({section!r} is a field of [{_section_of(section)}])"
                raise ValueError(
                    f"{source}: unknown section [{str(section)[:80]}]{hint}; sections: "
                    + ", ".join(f"[{s}]" for s in SECTIONS)
                )
            if not isinstance(table, Mapping):
                raise InputTypeError(
                    f"{source}: [{section}] must be a table of settings, got {type(table).__name__}"
                )
            for name, value in table.items():
                if name in RENAMED_FIELDS:
                    warn_renamed(f"{source}: [{section}] {name}", RENAMED_FIELDS[name])
                    name = RENAMED_FIELDS[name]
                if name not in _FIELDS:
                    raise ValueError(
                        f"{source}: [{section}] has no field {bounded_repr(name)}"
                        f"{_did_you_mean(str(name), _FIELDS)}; its fields: "
                        + ", ".join(n for n in _FIELDS if _section_of(n) == section)
                    )
                if _section_of(name) != section:
                    raise ValueError(
                        f"{source}: {name!r} belongs in [{_section_of(name)}], not [{section}]"
                    )
                if value == 0 and _FIELDS[name].metadata.get("zero_is_none"):
                    value = None  # a file has no null: 0 means none
                values[name] = value
        return cls(**{**values, **overrides})

    @classmethod
    def load(cls, path: str | os.PathLike[str], **overrides: Any) -> TrainConfig:
        """A config from a TOML (``.toml``) or YAML (``.yaml``/``.yml``) file of sections,
        with ``overrides`` (flat field names) on top; e.g.

        .. code-block:: toml

            [data]
            data = "llava.json"
            global_batch = 32

            [optim]
            steps = 1000
            lr = 3e-4
        """
        return cls.from_sections(read_sections(path), source=os.fspath(path), **overrides)


def read_sections(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's tables (TOML or YAML), as :meth:`TrainConfig.load` reads them."""
    from dflop.safe_io import load_yaml, open_regular

    path = os.fspath(path)
    special = not_regular_reason(path)
    if special is not None:  # e.g. a named pipe: open() would block forever
        raise ValueError(f"config file {path!r} {special}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist (or is not a file)")
    if path.endswith(".toml"):
        try:
            import tomllib  # Python 3.11+
        except ImportError:  # pragma: no cover - older Pythons
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ImportError:
                raise ImportError(
                    f"reading {path} needs Python 3.11+ or 'pip install tomli' (or use "
                    "a .yaml config)"
                ) from None
        with open_regular(path, "rb", "config file") as f:
            try:
                sections = tomllib.load(f)
            except tomllib.TOMLDecodeError as error:
                raise ValueError(f"{path}: not valid TOML: {error}") from None
            except RecursionError:
                raise ValueError(f"{path}: not valid TOML: nested too deeply") from None
    elif path.endswith((".yaml", ".yml")):
        with open_regular(path, "r", "config file") as f:
            # bounded: invalid YAML, an alias bomb or deep nesting is a ValueError
            sections = load_yaml(f, path) or {}
    else:
        raise ValueError(f"config file {path!r}: give a .toml or .yaml file")
    return sections


_FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _section_of(name: str) -> str:
    return _FIELDS[name].metadata["section"]


def _did_you_mean(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_output_path(what: str, path: str | None, kind: str = "file") -> None:
    """Fail now, not after training, if ``path`` cannot be written: a file's folder must
    exist and be writable and the path must not be a folder; a folder must not be a file
    and its (nearest existing) parent must be writable."""
    if path is None:
        return
    if kind == "file":
        if os.path.isdir(path):
            raise ValueError(f"{what}={path!r} is a folder; give a file path")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"{what}={path!r}: the folder {parent!r} does not exist")
    else:
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{what}={path!r} is a file; give a folder")
        parent = os.path.abspath(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"{what}={path!r}: {parent!r} is not writable")


def check_export_folder(folder: str, model_folder: str, replace: bool) -> None:
    """Fail before training if the trained model cannot go to ``folder`` without mixing
    with, or destroying, what is there: the input model's folder (or one holding it, or
    inside it) is refused; a folder that holds files is refused unless ``replace``."""
    target, model = os.path.realpath(folder), os.path.realpath(model_folder)
    if target == model or model.startswith(target + os.sep) or target.startswith(model + os.sep):
        where = "is" if target == model else "holds" if model.startswith(target) else "is inside"
        raise ValueError(
            f"TrainConfig.save_hf={folder!r} {where} the input model's folder ({model_folder!r}): "
            "dflop never writes into the model it trains from; give another folder"
        )
    if os.path.isdir(folder) and not replace:
        entries = sorted(os.listdir(folder))
        if entries:
            shown = ", ".join(bounded_repr(e) for e in entries[:3])
            more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
            raise ValueError(
                f"TrainConfig.save_hf={folder!r} is not empty ({shown}{more}): a model "
                "written into it would mix with what is there; give a new or empty folder, or "
                "set save_hf_replace (--save-hf-replace) to replace the folder as a whole"
            )


def local_process_limit() -> int:
    """The most local processes a run starts without ``oversubscribe``: 4 per CPU core,
    and no more than the host's memory holds at 512 MiB each."""
    cores = os.cpu_count() or 1
    limit = 4 * cores
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        limit = min(limit, max(2, int(memory // (512 * 2**20))))
    except (ValueError, OSError, AttributeError):
        pass
    return max(2, limit)


def check_local_processes(count: int, oversubscribe: bool = False) -> None:
    """Refuse to start more local processes than :func:`local_process_limit` unless
    ``oversubscribe``."""
    limit = local_process_limit()
    if count > limit and not oversubscribe:
        raise ValueError(
            f"{count} local processes exceed this machine's limit of {limit} (4 per core, "
            "512 MiB each): use a smaller layout, or pass --oversubscribe to start them anyway"
        )
