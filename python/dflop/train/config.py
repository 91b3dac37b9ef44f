"""``TrainConfig``: everything one ``dflop train`` run needs, validated up front.

Errors name the field (``TrainConfig.steps=0 must be >= 1``) so a bad command line or
config file fails at once, before any process starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from dflop.errors import InputTypeError

__all__ = [
    "SCHEDULE_MODES",
    "TrainConfig",
    "check_local_processes",
    "check_output_path",
    "local_process_limit",
]

SCHEDULE_MODES: tuple[str, ...] = ("dflop", "blind", "compare")
"""``dflop``: every step balanced by ``dflop.schedule()`` (computed one step ahead);
``blind``: equal-count microbatches in dataset order (what a data-blind framework does);
``compare``: every step runs twice on the same weights and batch, once each way (the
optimizer steps once), to measure both on the same steps in the same run."""


@dataclass(frozen=True)
class TrainConfig:
    """Settings of a training run.

    Model and layout:
        model: dflop's reference model by preset (``dflop.models.model_config``:
            ``tiny``, ``small``, ``VISION+DECODER`` such as ``small+tiny``), or
            ``hf:PATH``: a Hugging Face model in a local folder (``config.json``; its
            safetensors weights, image processor and tokenizer when present; needs
            ``dflop[hf]``), trained on a LLaVA-style dataset by its own shape rules.
        plan: a plan JSON from ``dflop plan`` (its best layout is used), or None.
        layout: a manual layout ``"enc_dp=1,enc_pp=1,llm_dp=1,llm_pp=1[,m=4]"``, or None.
            With neither, the planner plans for ``nproc`` local processes.
        nproc: local processes to spawn (None: the layout's world size, else 2).
        num_microbatches: microbatches per step (None: the plan's / layout's).

    Data:
        data: ``"synthetic"`` (the embedded LLaVA-OneVision-like mix), a ShapeDistribution
            file (``.json``/``.parquet`` from ``dflop profile-data``), or a LLaVA-style
            dataset (``.json``/``.jsonl``/``.yaml``; its images, frames and text are loaded,
            each rank only its own samples: ``DatasetBatch``). For the embedded mix and
            shape files the tensors are synthesised from the shapes (``SyntheticBatch``).
        image_folder: a dataset's image paths are relative to it (default: the dataset
            file's folder), as LLaVA's ``--image_folder``.
        video_folder: a dataset's video paths are relative to it (default: image_folder).
        family: shape rules of a dataset (``llava-ov`` or ``internvl``).
        mix: synthetic mix override (``MixSpec`` fractions), e.g. ``{"text": 0.4, ...}``.
        scaler: ``ShapeScaler`` arguments mapping real shapes onto the small model.
        global_batch: samples per step (None: the plan's, else 16).
        check_images: decode every dataset record's image files once before its first
            step (spread over the ranks) and replace a record whose files do not decode
            by a seeded redraw, counted and reported (False: such a file fails the run at
            the step that decodes it, naming the file).

    Optimisation:
        steps: total steps (a resumed run continues up to it).
        lr, weight_decay: AdamW settings.
        grad_clip_norm: scale the gradients so that their global norm (all stages, TP
            shards and modules; each parameter once) is at most this (None: no clipping;
            the norm is still reported).
        seed: model init and data seed (step k's batch is drawn with ``seed``, ``k``).

    Scheduling:
        schedule: one of :data:`SCHEDULE_MODES`.
        perf: performance model JSON (``dflop profile-model``) or None: profile the model
            quickly at start.
        adaptive: correct the cost model from measured microbatch times.
        pipeline_schedule: refine every balanced schedule for the encoder -> LLM pipeline
            (:func:`dflop.pipeline_schedule`, in the scheduler's background thread): which
            samples share a microbatch and the microbatch order, chosen on the simulated
            1F1B step (False: the balanced schedule in index order).
        max_growth: no microbatch's encoder or LLM load may grow past this x the balanced
            schedule's largest (>= 1): the memory bound the balance gave.
        lookahead: schedules computed ahead of training (>= 1).
        schedule_deadline: give every schedule a deadline of one step time (True) or solve
            to the end (False).
        deterministic: no measured time reaches a schedule, so the same command gives the
            same schedules and losses in every run and resume. By default ``dflop`` mode
            depends on timing: the cost model comes from a quick timing profile and is
            corrected from measured microbatches (``adaptive``), the step model's link
            latency and forward shares are fitted to measured steps, and schedules have
            deadlines. Deterministic runs use ``perf`` (or the plan's model; with neither,
            the analytic FLOP model at a nominal rate), never correct or calibrate it, solve
            every schedule to the end, and set ``torch.use_deterministic_algorithms``.

    Output:
        checkpoint_dir, checkpoint_every: where and how often (steps; 0: only at the end)
            to checkpoint; a run resumes from the latest checkpoint there.
        save_hf: a Hugging Face model: write the trained model here at the end, in the
            Hugging Face layout (``from_pretrained`` loads it).
        trace, png: measured timeline files (in ``compare`` mode one per mode, with
            ``-dflop`` / ``-blind`` before the extension).
        trace_steps: how many final steps the timeline shows.
        log_every: print a line every this many steps (0: none).
        progress: show a progress bar (tqdm) when stdout is a terminal.
        debug: shape headers on every pipeline message.

    Runtime:
        device: ``auto`` (CUDA if available), ``cpu`` or ``cuda``.
        oversubscribe: allow more local processes than :func:`local_process_limit` (by
            default a run that would start more is refused before any process starts).
        timeout_s: limit of every collective: a rank waiting longer on a peer fails.
        run_timeout_s: limit of a whole local run (None: none beyond the collectives').
        threads: torch threads per process (None: cores // processes).
        calibrate_steps: local processes planned here (no plan file): first run this many
            steps of the chosen layout, then re-plan with the performance model corrected
            from the measured action times, the fitted per-transfer latency and the measured
            forward shares (0: plan with the profile alone).
    """

    model: str = "tiny"
    plan: str | None = None
    layout: str | None = None
    nproc: int | None = None
    num_microbatches: int | None = None
    data: str = "synthetic"
    image_folder: str | None = None
    video_folder: str | None = None
    family: str = "llava-ov"
    mix: dict[str, float] | None = None
    scaler: dict[str, Any] = field(default_factory=dict)
    global_batch: int | None = None
    check_images: bool = True
    steps: int = 20
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip_norm: float | None = 1.0
    seed: int = 0
    schedule: str = "dflop"
    perf: str | None = None
    adaptive: bool = True
    pipeline_schedule: bool = True
    max_growth: float = 1.05
    lookahead: int = 2
    schedule_deadline: bool = True
    deterministic: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    save_hf: str | None = None
    trace: str | None = None
    png: str | None = None
    trace_steps: int = 2
    log_every: int = 1
    progress: bool = True
    debug: bool = False
    device: str = "auto"
    oversubscribe: bool = False
    timeout_s: float = 300.0
    run_timeout_s: float | None = None
    threads: int | None = None
    calibrate_steps: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"TrainConfig.{name}={getattr(self, name)!r} must be {rule}")

        def integer(name: str, minimum: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise bad(name, f"an integer >= {minimum}")

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
        for name, positive in (("lr", True), ("weight_decay", False), ("timeout_s", True)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, "a number")
            if not math.isfinite(value) or (value <= 0 if positive else value < 0):
                raise bad(name, "finite and > 0" if positive else "finite and >= 0")
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
        if self.schedule not in SCHEDULE_MODES:
            raise bad("schedule", f"one of {SCHEDULE_MODES}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise bad("device", "'auto', 'cpu' or 'cuda'")
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
        if self.data != "synthetic" and not os.path.exists(self.data):
            raise FileNotFoundError(
                f"TrainConfig.data={self.data!r}: no such file (or use 'synthetic')"
            )
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
        for name, kind in (
            ("trace", "file"),
            ("png", "file"),
            ("checkpoint_dir", "folder"),
            ("save_hf", "folder"),
        ):
            check_output_path(f"TrainConfig.{name}", getattr(self, name), kind)
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
                    f"TrainConfig.scaler has unknown field {unknown[0]!r}; known: {sorted(known)}"
                )
            for name, value in self.scaler.items():
                wanted = bool if name == "visual_newline" else int
                if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
                    if value is None and name in ("max_units_per_sample", "max_text_tokens"):
                        continue
                    raise InputTypeError(
                        f"TrainConfig.scaler[{name!r}] must be {'a bool' if wanted is bool else 'an integer'}, "
                        f"got {type(value).__name__} {value!r}"
                    )

    @property
    def modes(self) -> tuple[str, ...]:
        """The schedules every step runs, in the order of step 0."""
        return ("dflop", "blind") if self.schedule == "compare" else (self.schedule,)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
