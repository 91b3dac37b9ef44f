"""The planner's output: :class:`Plan`, saved as versioned JSON that the trainer reads.

File format (version 1)::

    {"format": "dflop.plan", "version": 1, "global_batch": 256,
     "cluster": {...ClusterSpec...}, "inputs": {...how to rebuild the sampled batches...},
     "layouts": [LayoutPlan, ...],          # best first
     "baseline": LayoutPlan | null,         # data-blind Megatron-LM-style
     "reference": LayoutPlan | null,        # the reference's mean-shape optimizer
     "stats": {...}, "planning_time_s": ...}

The chosen layout (``layouts[0]``) also holds ``steps``: one :class:`StepAudit` per sampled
batch (schedule, encoder split by visual unit, the predicted forward / backward seconds of
every replica, stage and microbatch, links), from which ``dflop simulate`` re-simulates.

A ``LayoutPlan`` holds per module (``encoder``, ``llm``): ``tp``, ``pp``, ``dp``,
``first_rank``, ``num_gpus``, ``layers_per_stage``, ``layer_ranges`` ([start, end) per
stage) and ``stage_ranks`` (per stage, per DP replica, the TP ranks); global rank =
``first_rank + stage * tp * dp + dp_rank * tp + tp_rank``. A colocated layout (baseline)
runs the encoder inside the LLM's first stage (``encoder.num_gpus == 0``). Plus
``num_microbatches`` (per LLM DP rank and step), ``global_batch`` and the prediction.
Readers reject files of a newer version, and check every field before using any
(:mod:`dflop.planner.plan_check`): a bad plan fails at load, in one line naming the file,
the field and the rule, before any process starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from dflop._deprecated import warn_renamed
from dflop.planner.model import ClusterSpec
from dflop.planner.plan_check import PlanError, check_plan
from dflop.planner.steps import StepAudit

__all__ = [
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "LayoutPlan",
    "ModulePlan",
    "Plan",
    "plan_element_bytes",
    "plan_zero1",
    "PlanError",
    "StepAudit",
    "StepPrediction",
]

PLAN_FORMAT = "dflop.plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class ModulePlan:
    """The parallel layout of one module."""

    tp: int
    pp: int
    dp: int
    first_rank: int
    layers_per_stage: tuple[int, ...]
    colocated: bool = False
    """True for the encoder of a colocated layout: it has no GPUs of its own."""
    recompute: bool = False
    """Full activation recomputation (forward runs twice; only layer inputs are kept)."""
    padded_heads: int = 0
    """A colocated encoder whose heads tp does not divide: its heads after padding to a
    multiple of tp with dummy heads (Megatron-LM / NVLM style); 0 when not padded."""
    virtual_stages: int = 1
    """Model chunks per stage (> 1: the LLM under interleaved 1F1B; ``layers_per_stage``
    then lists the ``pp * virtual_stages`` virtual stages, chunk c of stage p at
    ``c * pp + p``)."""

    @property
    def num_gpus(self) -> int:
        return 0 if self.colocated else self.tp * self.pp * self.dp

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        """[start, end) layer indices of each (virtual) stage."""
        out, start = [], 0
        for n in self.layers_per_stage:
            out.append((start, start + n))
            start += n
        return out

    def rank(self, stage: int, dp_rank: int, tp_rank: int) -> int:
        """Global rank of (stage, DP replica, TP rank): tp fastest, then dp, then pp."""
        return self.first_rank + stage * self.tp * self.dp + dp_rank * self.tp + tp_rank

    @property
    def stage_ranks(self) -> list[list[list[int]]]:
        """Per stage, per DP replica, the TP group's global ranks."""
        if self.colocated:
            return []
        return [
            [[self.rank(s, d, t) for t in range(self.tp)] for d in range(self.dp)]
            for s in range(self.pp)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "first_rank": self.first_rank,
            "num_gpus": self.num_gpus,
            "colocated": self.colocated,
            "recompute": self.recompute,
            "padded_heads": self.padded_heads,
            "virtual_stages": self.virtual_stages,
            "layers_per_stage": list(self.layers_per_stage),
            "layer_ranges": [list(r) for r in self.layer_ranges],
            "stage_ranks": self.stage_ranks,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModulePlan:
        return cls(
            tp=int(data["tp"]),
            pp=int(data["pp"]),
            dp=int(data["dp"]),
            first_rank=int(data["first_rank"]),
            layers_per_stage=tuple(int(n) for n in data["layers_per_stage"]),
            colocated=bool(data.get("colocated", False)),
            recompute=bool(data.get("recompute", False)),
            padded_heads=int(data.get("padded_heads", 0)),
            virtual_stages=int(data.get("virtual_stages", 1)),
        )

    def core_dict(self) -> dict[str, Any]:
        """The layout as the native core takes it."""
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "first_rank": self.first_rank,
            "layers_per_stage": list(self.layers_per_stage),
            "recompute": self.recompute,
            "virtual_stages": self.virtual_stages,
        }

    def describe(self) -> str:
        rc = " rc" if self.recompute else ""
        chunks = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"tp={self.tp} pp={self.pp}{chunks} dp={self.dp}{rc}"


@dataclass(frozen=True)
class StepPrediction:
    """Simulated step of a layout, averaged over the sampled batches.

    ``stage_*`` lists cover the combined pipeline: encoder stages first, then LLM stages
    (only LLM stages for a colocated layout); times are means over batches and replicas.
    """

    step_time_s: float
    throughput_samples_per_s: float
    idle_fraction: float
    """Idle GPU-seconds over all GPUs / (step time x GPUs)."""
    lower_bound_s: float
    step_time_as_scheduled_s: float
    """Without microbatch reordering (equal to step_time_s when it is off)."""
    stage_compute_s: tuple[float, ...]
    stage_allreduce_s: tuple[float, ...]
    stage_bubble_s: tuple[float, ...]
    """step time - compute - all-reduce: waiting (pipeline fill/drain, imbalance, barrier)."""
    transfer_s: float
    """Encoder -> LLM feature transfer time per step (overlapped with compute when it can)."""
    peak_memory_bytes: float
    step_times_s: tuple[float, ...]
    """Per sampled batch."""
    microbatch_orders: tuple[str, ...] = ()
    estimate_s: float = 0.0
    """The reference optimizer's mean-shape estimate (reference layouts only)."""
    stage_memory_bytes: tuple[float, ...] = ()
    """Per stage (encoder stages, then LLM stages): the memory model's peak on one GPU
    of it over the sampled batches, without the cluster's reserve (``peak_memory_bytes``
    is the largest, with it)."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepPrediction:
        kwargs = dict(data)
        for key, value in kwargs.items():
            if isinstance(value, list):
                kwargs[key] = tuple(value)
        return cls(**kwargs)


@dataclass(frozen=True)
class LayoutPlan:
    """One layout with its prediction."""

    encoder: ModulePlan
    llm: ModulePlan
    num_microbatches: int
    global_batch: int
    prediction: StepPrediction
    colocated: bool = False
    scheduler: str = "balanced"
    """What makes each step's schedule: "balanced" (dflop.schedule per step) or
    "data_blind" (equal-count microbatches in dataset order: the baseline). Plan files
    before this release called it ``schedule`` (still read)."""
    steps: tuple[StepAudit, ...] = ()
    """The chosen layout: per sampled batch, the step the planner scored (for audits and
    ``dflop simulate``); empty for the other layouts."""
    order: str | None = None
    """The pipeline order (e.g. ``"zb-h1"``); None: :func:`dflop.scheduling.pipeline_order_for`'s
    choice for the stages and chunks."""

    @property
    def pipeline_order(self) -> str:
        """The pipeline order its replicas run."""
        from dflop.scheduling.actions import pipeline_order_for

        if self.order is not None:
            return self.order
        if self.colocated:
            return pipeline_order_for(([self.llm.pp], [self.llm.virtual_stages]))
        return pipeline_order_for(([self.encoder.pp, self.llm.pp], [1, self.llm.virtual_stages]))

    @property
    def schedule(self) -> str:
        """Deprecated name of :attr:`scheduler`."""
        warn_renamed("LayoutPlan.schedule", "LayoutPlan.scheduler")
        return self.scheduler

    @property
    def num_encoder_gpus(self) -> int:
        return self.encoder.num_gpus

    def describe(self, unit: str = "GPUs") -> str:
        """One line: each module's ``unit`` (GPUs, or local processes) and parallelism."""
        if self.colocated:
            blind = ", data-blind" if self.scheduler == "data_blind" else ""
            pad = (
                f", enc heads padded to {self.encoder.padded_heads}"
                if self.encoder.padded_heads
                else ""
            )
            return f"colocated ({self.llm.describe()}{pad}{blind}) | m={self.num_microbatches}"
        e, g = self.encoder, self.llm
        return (
            f"enc {e.num_gpus} {unit} ({e.describe()}) | llm {g.num_gpus} {unit} ({g.describe()}) "
            f"| m={self.num_microbatches}" + (f" {self.order}" if self.order else "")
        )

    def core_dict(self) -> dict[str, Any]:
        return {
            "colocated": self.colocated,
            "encoder": self.encoder.core_dict(),
            "llm": self.llm.core_dict(),
            "num_microbatches": self.num_microbatches,
            "order": self.order,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "colocated": self.colocated,
            "encoder": self.encoder.to_dict(),
            "llm": self.llm.to_dict(),
            "num_microbatches": self.num_microbatches,
            "global_batch": self.global_batch,
            "scheduler": self.scheduler,
            "order": self.order,
            "prediction": self.prediction.to_dict(),
            "steps": [step.to_dict() for step in self.steps],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayoutPlan:
        return cls(
            encoder=ModulePlan.from_dict(data["encoder"]),
            llm=ModulePlan.from_dict(data["llm"]),
            num_microbatches=int(data["num_microbatches"]),
            global_batch=int(data["global_batch"]),
            prediction=StepPrediction.from_dict(data["prediction"]),
            colocated=bool(data.get("colocated", False)),
            scheduler=str(data.get("scheduler", data.get("schedule", "balanced"))),
            steps=tuple(StepAudit.from_dict(d) for d in data.get("steps", [])),
            order=data.get("order"),
        )


def _bytes(value: float) -> str:
    """Memory per GPU, in units that show it (a tiny model's is megabytes)."""
    if value <= 0:
        return "not modelled"
    return f"{value / 1e9:.1f} GB" if value >= 1e9 else f"{value / 1e6:.0f} MB"


def _legend(rows: list[tuple[str, ...]], unit: str) -> list[str]:
    """What the table's tags mean (those it shows); ``unit``: GPUs or processes."""
    shown = " ".join(r[0] + " " + r[1] for r in rows[1:])
    tags = [
        (" rc", "rc: activation recomputation"),
        (" v=", "v=N: N model chunks per stage (interleaved 1F1B)"),
        (" zb-h1", "zb-h1: the zero-bubble pipeline order (backwards split into I and W)"),
        ("colocated", "colocated: the encoder inside the LLM's first stage (Megatron-style)"),
        ("blind ", "blind: the data-blind baseline (equal-count microbatches in dataset order)"),
        ("ref ", "ref: the mean-shape optimizer (the published reference's)"),
    ]
    said = [text for tag, text in tags if tag in shown]
    one = {"GPUs": "GPU", "processes": "process"}[unit]
    said.append(f"memory: the model's peak per {one}, without the reserve")
    return ["  " + "; ".join(said)]


@dataclass
class Plan:
    """The planner's result: the best layouts (best first) and the baselines."""

    cluster: ClusterSpec
    global_batch: int
    layouts: list[LayoutPlan]
    baseline: LayoutPlan | None = None
    reference: LayoutPlan | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    """How the sampled batches were built (perf model, shapes, configs, seed, batches)."""
    stats: dict[str, Any] = field(default_factory=dict)
    planning_time_s: float = 0.0
    version: int = PLAN_VERSION

    @property
    def best(self) -> LayoutPlan:
        return self.layouts[0]

    @property
    def speedup_over_baseline(self) -> float | None:
        if self.baseline is None:
            return None
        return self.baseline.prediction.step_time_s / self.best.prediction.step_time_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": self.version,
            "global_batch": self.global_batch,
            "cluster": self.cluster.to_dict(),
            "inputs": self.inputs,
            "layouts": [layout.to_dict() for layout in self.layouts],
            "baseline": None if self.baseline is None else self.baseline.to_dict(),
            "reference": None if self.reference is None else self.reference.to_dict(),
            "stats": self.stats,
            "planning_time_s": self.planning_time_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan of parsed JSON ``data``, every field checked first
        (:func:`dflop.planner.plan_check.check_plan`).

        Raises:
            dflop.planner.plan_check.PlanError: (a ValueError) naming the first field
                that breaks a rule, its value and the rule.
        """
        check_plan(data, plan_format=PLAN_FORMAT, max_version=PLAN_VERSION)
        version = data["version"]
        return cls(
            cluster=ClusterSpec.from_dict(data["cluster"]),
            global_batch=int(data["global_batch"]),
            layouts=[LayoutPlan.from_dict(d) for d in data["layouts"]],
            baseline=None
            if data.get("baseline") is None
            else LayoutPlan.from_dict(data["baseline"]),
            reference=(
                None if data.get("reference") is None else LayoutPlan.from_dict(data["reference"])
            ),
            inputs=dict(data.get("inputs", {})),
            stats=dict(data.get("stats", {})),
            planning_time_s=float(data.get("planning_time_s", 0.0)),
            version=version,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        from dflop.planner.plan_check import MAX_PLAN_FILE_BYTES
        from dflop.safe_io import JSONTooDeepError, load_json, open_regular

        with open_regular(path, "r", "plan file") as f:  # a named pipe: refused, not opened
            size = os.fstat(f.fileno()).st_size
            if size > MAX_PLAN_FILE_BYTES:
                raise ValueError(
                    f"{os.fspath(path)} is {size:,} bytes, more than a plan file may be "
                    f"({MAX_PLAN_FILE_BYTES >> 20} MiB): not read"
                )
            try:
                data = load_json(f)
            except (json.JSONDecodeError, JSONTooDeepError) as error:
                raise ValueError(f"{os.fspath(path)} is not valid JSON: {error}") from None
            except ValueError as error:  # bad UTF-8, an integer too long to parse
                what = " ".join(str(error).split())[:200]
                raise ValueError(f"{os.fspath(path)} is not valid JSON: {what}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{os.fspath(path)} is not a dflop plan")
        try:
            return cls.from_dict(data)
        except PlanError as error:  # "FILE: field.path=value rule"
            raise ValueError(f"{os.fspath(path)}: {error}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            what = f"missing field {error}" if isinstance(error, KeyError) else str(error)
            raise ValueError(f"{os.fspath(path)}: not a valid dflop plan: {what}") from None

    def _slower_than_baseline(self, unit: str) -> str:
        """Why dflop's best layout is predicted slower than the data-blind baseline."""
        assert self.baseline is not None and self.speedup_over_baseline is not None
        slower = 1.0 / self.speedup_over_baseline - 1.0
        best, base = self.best, self.baseline
        why = "the data-blind schedule happens to suit these batches"
        if base.colocated and not best.colocated:
            why = (
                "the baseline runs the encoder inside the LLM's first stage on all "
                f"{base.llm.num_gpus} {unit} (colocated, Megatron-style); dflop's best gives "
                f"the encoder {best.encoder.num_gpus} of "
                f"{best.encoder.num_gpus + best.llm.num_gpus} {unit} of its own, and on this "
                "cluster and data that split costs more than balancing the batch wins (idle "
                f"{100 * best.prediction.idle_fraction:.0f}% against the baseline's "
                f"{100 * base.prediction.idle_fraction:.0f}%)"
            )
            if base.encoder.padded_heads:
                why += (
                    f"; the baseline pads the encoder's heads to {base.encoder.padded_heads} "
                    f"for tp={base.llm.tp}, which dflop's runtime does not (its colocated "
                    "layouts use a tp that divides them)"
                )
            elif not any(lp.colocated for lp in self.layouts):
                why += (
                    "; this plan left colocated layouts out (--placement disaggregated): with "
                    "them, the baseline's placement under dflop's schedule is a candidate"
                )
        return (
            f"note: dflop's best layout is predicted {100 * slower:.1f}% slower than the "
            f"data-blind baseline: {why}. Plan with more {unit}, a larger batch or the "
            "real data's shapes."
        )

    def table(self) -> str:
        """A human-readable summary."""
        unit = "processes" if (self.inputs or {}).get("local") else "GPUs"
        rows = [("#", "layout", "step s", "samples/s", "idle", "memory")]

        def row(name: str, lp: LayoutPlan) -> tuple[str, ...]:
            p = lp.prediction
            return (
                name,
                lp.describe(unit),
                f"{p.step_time_s:.3f}",
                f"{p.throughput_samples_per_s:.1f}",
                f"{100 * p.idle_fraction:.1f}%",
                _bytes(p.peak_memory_bytes),
            )

        for i, lp in enumerate(self.layouts):
            rows.append(row(str(i + 1), lp))
        if self.baseline is not None:
            rows.append(row("blind", self.baseline))
        if self.reference is not None:
            rows.append(row("ref", self.reference))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        best = self.best.prediction
        lines.append("")
        lines.extend(_legend(rows, unit))
        lines.append(
            f"best: {self.best.describe(unit)}; layers per stage enc {list(self.best.encoder.layers_per_stage)} "
            f"llm {list(self.best.llm.layers_per_stage)}"
        )
        lines.append(
            "  per stage compute s: "
            + ", ".join(f"{v:.3f}" for v in best.stage_compute_s)
            + "; all-reduce s: "
            + ", ".join(f"{v:.3f}" for v in best.stage_allreduce_s)
            + "; bubble s: "
            + ", ".join(f"{v:.3f}" for v in best.stage_bubble_s)
            + f"; encoder->LLM transfer {best.transfer_s:.3f} s"
        )
        trainable = (self.inputs or {}).get("trainable", "full")
        if trainable != "full":
            lines.append(
                f"priced for training {trainable} (frozen parts: no backward where none is "
                "needed, no gradients or optimizer state)"
                + ("; the baseline trains the same" if self.baseline is not None else "")
            )
        if self.speedup_over_baseline is not None:
            lines.append(
                f"speed-up over the data-blind baseline: {self.speedup_over_baseline:.2f}x"
            )
            if self.speedup_over_baseline < 1.0:
                lines.append(self._slower_than_baseline(unit))
        if self.stats:
            lines.append(
                f"planned in {self.planning_time_s:.2f} s; candidates "
                f"{self.stats.get('num_candidates')}, simulated {self.stats.get('num_simulated')}, "
                f"pruned {self.stats.get('num_pruned')}, over memory "
                f"{self.stats.get('num_memory_rejected')}"
            )
        else:
            lines.append("a given layout, scored (no search)")
        return "\n".join(lines)


def plan_element_bytes(inputs: dict[str, Any]) -> int:
    """Bytes per weight, activation and gradient element a plan was priced with (2: bf16,
    4: fp32): its ``inputs.element_bytes``; a plan without it, its planner's default (a
    local plan fp32, a cluster plan bf16)."""
    return int(inputs.get("element_bytes", 4 if inputs.get("local") else 2))


def plan_zero1(inputs: dict[str, Any]) -> bool:
    """Whether a plan was priced with the optimizer states sharded over each module's
    data-parallel replicas (ZeRO-1): its ``inputs.zero1``; a plan without it, its
    planner's default (a local plan no, a cluster plan yes)."""
    return bool(inputs.get("zero1", not inputs.get("local")))
