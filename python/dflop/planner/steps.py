"""One training step as the planner models it, auditable and shared with the trainer.

:class:`StepAudit` is what a :class:`~dflop.planner.Plan` records for each sampled batch
of its chosen layout: the schedule, the encoder's split of every microbatch by visual
unit (the runtime's own :func:`~dflop.runtime.routing.split_units`), and the forward and
backward seconds the planner predicted for every (replica, stage, microbatch), encoder
replicas and LLM replicas alike, with the links and all-reduces. :meth:`StepAudit.simulate`
re-simulates the step from those numbers alone (``dflop simulate plan.json``): every LLM
replica's encoder stages take the slowest encoder replica's time, as in the planner.

:class:`StepPredictor` computes the same record for any schedule the trainer runs, from
its cost model: the planner's ``step_from_assignment`` in the C++ core, so that a plan's
promise and the trainer's prediction come from one model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dflop import _core
from dflop.data.costs import EncoderConfig, LLMConfig
from dflop.data.shapes import SampleShapes
from dflop.planner.inputs import core_options, sample_record, single_batch_inputs
from dflop.planner.model import ClusterSpec, PlannerConfig
from dflop.scheduling.pipeline_schedule import PipelineModel

__all__ = ["StepAudit", "StepPredictor"]

_PIECE_FIELDS = ("microbatch", "sample", "first_unit", "num_units", "replica")


def _floats(value: Any, ndim: int) -> np.ndarray:
    array = np.asarray(value, dtype=np.float64)
    if array.ndim != ndim:
        array = array.reshape((0,) * ndim) if array.size == 0 else array
    return array


@dataclass(frozen=True, eq=False)
class StepAudit:
    """One sampled batch of a layout as the planner scored it.

    Microbatch indices are the execution order. Encoder arrays are empty for a colocated
    layout (its encoder runs inside the first LLM stage).
    """

    assignment: np.ndarray
    """(N,) bin of every sample: microbatch ``bin // llm dp`` on LLM replica ``bin % dp``."""
    microbatch_order: np.ndarray
    """(m,) the balanced schedule's microbatch at each position (the order chosen)."""
    encoder_forward_s: np.ndarray
    """(encoder dp, encoder pp, m): every encoder replica's forward seconds (0: idle)."""
    encoder_backward_s: np.ndarray
    llm_forward_s: np.ndarray
    """(LLM dp, LLM pp, m) (colocated: the first stage holds the encoder too)."""
    llm_backward_s: np.ndarray
    pieces: dict[str, np.ndarray]
    """The encoder split: per piece its ``microbatch``, ``sample`` (index in the batch),
    ``first_unit``, ``num_units`` and encoder ``replica``."""
    activation_bytes: np.ndarray
    """(LLM dp, S - 1, m) bytes over each link (S = encoder pp + LLM pp)."""
    link_latency_s: np.ndarray
    link_bandwidth_bytes_per_s: np.ndarray
    allreduce_s: np.ndarray
    """(S,) gradient all-reduce seconds per stage."""
    step_time_s: float
    """The planner's simulated step time of this batch."""
    samples: dict[str, np.ndarray] = field(default_factory=dict)
    """Per sample of the batch: ``encoder_units``, ``encoder_s``, ``llm_s`` (the inputs)."""
    llm_chunks: int = 1
    """Model chunks per LLM stage (> 1: the interleaved 1F1B schedule; the LLM arrays then
    run over its virtual stages)."""
    gradient_links: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Empty (every link carries gradients back), or per link 0 where none goes back: the
    stages before it are frozen and run no backward that waits (``simulate_pipeline``)."""
    order: str | None = None
    """The pipeline order the step ran (None, an older plan's: ``pipeline_order_for``)."""
    weight_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Empty, or (LLM dp, S, m) like :meth:`simulator_input`: the seconds of each backward a
    split-backward order's ``W`` runs (``simulate_pipeline``'s ``weight_s``)."""

    @property
    def num_encoder_stages(self) -> int:
        return int(self.encoder_forward_s.shape[1]) if self.encoder_forward_s.size else 0

    @property
    def num_microbatches(self) -> int:
        return int(self.llm_forward_s.shape[2])

    def simulator_input(self) -> tuple[np.ndarray, np.ndarray]:
        """(forward_s, backward_s) of shape (LLM dp, S, m): the encoder's stages take, per
        microbatch, the slowest encoder replica's time in every LLM replica."""
        replicas = self.llm_forward_s.shape[0]

        def combined(encoder: np.ndarray, llm: np.ndarray) -> np.ndarray:
            if encoder.size == 0:
                return llm
            slowest = encoder.max(axis=0)  # (E, m)
            tiled = np.broadcast_to(slowest, (replicas, *slowest.shape))
            return np.concatenate([tiled, llm], axis=1)

        return (
            combined(self.encoder_forward_s, self.llm_forward_s),
            combined(self.encoder_backward_s, self.llm_backward_s),
        )

    def simulate(self, *, link_latency_s: float | None = None, record_events: bool = True) -> Any:
        """Re-simulate the step from the recorded times: a
        :class:`dflop.simulator.SimulationResult` (its ``step_time_s`` equals
        :attr:`step_time_s`). ``link_latency_s``: every link's latency instead of the
        recorded ones; ``record_events=False`` skips the event list (faster)."""
        from dflop.scheduling.actions import pipeline_order_for
        from dflop.simulator import simulate_pipeline

        forward, backward = self.simulator_input()
        links = forward.shape[1] - 1
        latency = self.link_latency_s.reshape(links)
        if link_latency_s is not None:
            latency = np.full(links, float(link_latency_s))
        llm_stages = self.llm_forward_s.shape[1] // self.llm_chunks
        stages, chunks = [llm_stages], [self.llm_chunks]
        if self.num_encoder_stages:
            stages, chunks = [self.num_encoder_stages, llm_stages], [1, self.llm_chunks]
        return simulate_pipeline(
            forward,
            backward,
            order=self.order or pipeline_order_for((stages, chunks)),
            weight_s=self.weight_s if self.weight_s.size else None,
            stages=stages,
            chunks=chunks,
            link_latency_s=latency,
            record_events=record_events,
            activation_bytes=self.activation_bytes if links else None,
            link_bandwidth_bytes_per_s=self.link_bandwidth_bytes_per_s.reshape(links),
            allreduce_s=self.allreduce_s,
            gradient_links=self.gradient_links if self.gradient_links.size else None,
        )

    def split_of(self, microbatch: int) -> dict[str, np.ndarray]:
        """The pieces of one microbatch (sample, first_unit, num_units, replica)."""
        keep = self.pieces["microbatch"] == microbatch
        return {k: v[keep] for k, v in self.pieces.items() if k != "microbatch"}

    @classmethod
    def from_core(
        cls, raw: dict[str, Any], samples: dict[str, np.ndarray] | None = None
    ) -> StepAudit:
        """From the core's ``build_step`` / ``step_from_assignment`` result."""
        encoder_stages = int(raw["num_encoder_stages"])
        forward, backward = raw["forward_s"], raw["backward_s"]
        llm_forward = np.ascontiguousarray(forward[:, encoder_stages:, :])
        llm_backward = np.ascontiguousarray(backward[:, encoder_stages:, :])
        probe = cls(
            assignment=np.asarray(raw["assignment"], dtype=np.int64),
            microbatch_order=np.asarray(raw["microbatch_order"], dtype=np.int64),
            encoder_forward_s=np.asarray(raw["encoder_forward_s"], dtype=np.float64),
            encoder_backward_s=np.asarray(raw["encoder_backward_s"], dtype=np.float64),
            llm_forward_s=llm_forward,
            llm_backward_s=llm_backward,
            pieces={k: np.asarray(raw["pieces"][k], dtype=np.int64) for k in _PIECE_FIELDS},
            activation_bytes=np.asarray(raw["activation_bytes"], dtype=np.float64),
            link_latency_s=np.asarray(raw["link_latency_s"], dtype=np.float64),
            link_bandwidth_bytes_per_s=np.asarray(
                raw["link_bandwidth_bytes_per_s"], dtype=np.float64
            ),
            allreduce_s=np.asarray(raw["allreduce_s"], dtype=np.float64),
            step_time_s=0.0,
            samples=dict(samples or {}),
            llm_chunks=int(raw["chunks"][-1]),
            gradient_links=np.asarray(raw["gradient_links"], dtype=np.int64),
            order=str(raw["schedule"]),
            weight_s=np.asarray(raw.get("weight_s", np.zeros(0)), dtype=np.float64),
        )
        return replace(probe, step_time_s=float(probe.simulate(record_events=False).step_time_s))

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "assignment": self.assignment.tolist(),
            "microbatch_order": self.microbatch_order.tolist(),
            "encoder_forward_s": self.encoder_forward_s.tolist(),
            "encoder_backward_s": self.encoder_backward_s.tolist(),
            "llm_forward_s": self.llm_forward_s.tolist(),
            "llm_backward_s": self.llm_backward_s.tolist(),
            "pieces": {k: self.pieces[k].tolist() for k in _PIECE_FIELDS},
            "activation_bytes": self.activation_bytes.tolist(),
            "link_latency_s": self.link_latency_s.tolist(),
            "link_bandwidth_bytes_per_s": self.link_bandwidth_bytes_per_s.tolist(),
            "allreduce_s": self.allreduce_s.tolist(),
            "samples": {k: np.asarray(v).tolist() for k, v in self.samples.items()},
            "llm_chunks": self.llm_chunks,
            "gradient_links": self.gradient_links.tolist(),
            "order": self.order,
            "weight_s": self.weight_s.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepAudit:
        llm_forward = _floats(data["llm_forward_s"], 3)
        return cls(
            assignment=np.asarray(data["assignment"], dtype=np.int64),
            microbatch_order=np.asarray(data["microbatch_order"], dtype=np.int64),
            encoder_forward_s=_floats(data["encoder_forward_s"], 3),
            encoder_backward_s=_floats(data["encoder_backward_s"], 3),
            llm_forward_s=llm_forward,
            llm_backward_s=_floats(data["llm_backward_s"], 3),
            pieces={
                k: np.asarray(data["pieces"][k], dtype=np.int64).reshape(-1) for k in _PIECE_FIELDS
            },
            activation_bytes=_floats(data["activation_bytes"], 3),
            link_latency_s=np.asarray(data["link_latency_s"], dtype=np.float64).reshape(-1),
            link_bandwidth_bytes_per_s=np.asarray(
                data["link_bandwidth_bytes_per_s"], dtype=np.float64
            ).reshape(-1),
            allreduce_s=np.asarray(data["allreduce_s"], dtype=np.float64).reshape(-1),
            step_time_s=float(data["step_time_s"]),
            samples={k: np.asarray(v) for k, v in data.get("samples", {}).items()},
            llm_chunks=int(data.get("llm_chunks", 1)),
            gradient_links=np.asarray(data.get("gradient_links", []), dtype=np.int64).reshape(-1),
            order=data.get("order"),
            weight_s=np.asarray(data.get("weight_s", []), dtype=np.float64),
        )


class StepPredictor:
    """The planner's model of a step for schedules the trainer picks.

    Given the cluster, the model configs, a layout (``LayoutPlan.core_dict()`` form) and the
    planner settings, :meth:`audit` returns the :class:`StepAudit` of one global batch
    under one schedule, priced by a cost model: exactly the numbers the planner would score
    that schedule with (the core's ``step_from_assignment``). The trainer passes its
    calibrated forward shares and link latency.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        encoder: EncoderConfig,
        llm: LLMConfig,
        layout: dict[str, Any],
        config: PlannerConfig | None = None,
    ) -> None:
        self.cluster = cluster
        self.encoder = encoder
        self.llm = llm
        self.layout = dict(layout)
        self.config = config or PlannerConfig(num_batches=1)

    def _inputs(self, cost_model: Any, shapes: SampleShapes, fractions: Any = None) -> Any:
        """The planner's inputs of one batch under this predictor's settings."""
        return single_batch_inputs(
            cost_model,
            self.encoder,
            self.llm,
            shapes,
            self.config.forward_fraction if fractions is None else fractions,
            self.config.element_bytes,
            self.config.loss_chunk_tokens,
            self.config.trainable,
            self.config.lora_rank,
        )

    def audit(
        self,
        cost_model: Any,
        shapes: SampleShapes,
        assignment: Any,
        *,
        forward_fraction: tuple[float, float] | None = None,
        link_latency_s: float | None = None,
    ) -> StepAudit:
        """The step of ``shapes`` under ``assignment`` (microbatch indices = execution
        order), priced by ``cost_model`` (``.costs(shapes)`` and ``.microbatch_constant_s``)."""
        return self._step(
            _core.step_from_assignment,
            cost_model,
            shapes,
            self.config,
            forward_fraction,
            link_latency_s,
            np.ascontiguousarray(np.asarray(assignment, dtype=np.int64)),
        )

    def planned_step(
        self,
        cost_model: Any,
        shapes: SampleShapes,
        *,
        seed: int,
        forward_fraction: tuple[float, float] | None = None,
        link_latency_s: float | None = None,
    ) -> StepAudit:
        """The step of ``shapes`` under the planner's own schedule for it (the core's
        ``build_step``: its balance, seeded with ``seed``, and the microbatch order it
        scores), priced by ``cost_model``: how dflop's trainer schedules a colocated
        layout's steps (step k with the run's seed + k, as a plan's batch k), exactly as a
        plan scores them."""
        config = replace(self.config, seed=int(seed))
        return self._step(
            _core.build_step, cost_model, shapes, config, forward_fraction, link_latency_s
        )

    def _step(
        self,
        core_step: Any,
        cost_model: Any,
        shapes: SampleShapes,
        config: PlannerConfig,
        forward_fraction: tuple[float, float] | None,
        link_latency_s: float | None,
        *extra: Any,
    ) -> StepAudit:
        """One core step model (``build_step`` or ``step_from_assignment``, with its
        ``extra`` arguments) of ``shapes`` on this layout, priced by ``cost_model``."""
        fractions = self.config.forward_fraction if forward_fraction is None else forward_fraction
        inputs = self._inputs(cost_model, shapes, fractions)
        cluster = self.cluster
        if link_latency_s is not None:
            cluster = replace(cluster, link_latency_s=float(link_latency_s))
        raw = core_step(
            cluster.to_dict(),
            inputs.encoder.to_dict(),
            inputs.llm.to_dict(),
            inputs.samples,
            core_options(config, "data_aware", len(shapes), 1),
            self.layout,
            0,
            *extra,
        )
        return StepAudit.from_core(raw, sample_record(inputs.samples, 0, len(shapes)))

    def stage_memory_bytes(
        self,
        cost_model: Any,
        shapes: SampleShapes,
        assignment: Any,
        llm_replica: int | None = None,
    ) -> tuple[float, ...]:
        """The memory model's peak per stage (encoder stages, then the LLM's; without the
        reserve) of the step of ``shapes`` under ``assignment``: what each rank of a
        stage should hold at most while it trains that step. ``llm_replica``: the LLM's
        stages (a colocated encoder's with them) on that DP replica's microbatches alone,
        what its ranks hold; None: the largest replica's."""
        inputs = self._inputs(cost_model, shapes)
        # Any capacity: the prediction, not whether it fits.
        roomy = replace(self.cluster, gpu_memory_bytes=1e30, memory_reserve_bytes=0.0)
        options = core_options(self.config, "data_aware", inputs.global_batch, 1)
        options["memory_replica"] = -1 if llm_replica is None else int(llm_replica)
        raw = _core.evaluate_layout(  # as dflop.planner.evaluate_layout scores a layout dict
            roomy.to_dict(),
            inputs.encoder.to_dict(),
            inputs.llm.to_dict(),
            inputs.samples,
            options,
            dict(self.layout),
            assignments=[np.ascontiguousarray(assignment, dtype=np.int64)],
        )
        return tuple(float(v) for v in raw.get("stage_memory_bytes", ()))

    def stage_costs(
        self, cost_model: Any, shapes: SampleShapes
    ) -> tuple[np.ndarray, tuple[float, float]]:
        """What the trainer's scheduler sees of ``shapes`` under this layout, by the
        planner's model (tp, recompute and layers per stage included): ``(costs, constants)``,
        the ``(N, 2)`` per-sample seconds of an average encoder stage (one replica) and
        LLM stage, and each module's per-microbatch constant of an average stage."""
        _, raw = self._stage_costs(cost_model, shapes)
        return np.asarray(raw["costs"]), tuple(float(c) for c in raw["constants"])

    def _stage_costs(
        self, cost_model: Any, shapes: SampleShapes, fractions: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        inputs = self._inputs(cost_model, shapes, fractions)
        raw = _core.stage_costs(
            self.cluster.to_dict(),
            inputs.encoder.to_dict(),
            inputs.llm.to_dict(),
            inputs.samples,
            core_options(self.config, "data_aware", len(shapes), 1),
            self.layout,
            0,
        )
        return inputs, raw

    def scheduler_view(
        self,
        cost_model: Any,
        shapes: SampleShapes,
        forward_fraction: tuple[float, float],
        link_latency_s: float,
        full_training_fraction: tuple[float, float] | None = None,
    ) -> tuple[np.ndarray, PipelineModel | None]:
        """What the trainer's scheduler sees of ``shapes``: :meth:`stage_costs` and the
        pipeline of this layout (``forward_fraction``: the modules' shares under the
        training regime; the regime's backward stages as the runtime runs them).
        ``full_training_fraction``: the same shares under full training, which price the
        stage costs as a plan's do (default: this predictor's config's)."""
        inputs, raw = self._stage_costs(cost_model, shapes, full_training_fraction)
        if self.layout.get("colocated"):
            # The first stage's per-sample seconds (encoder + its LLM layers) and an average
            # LLM stage's, both per bin: balanced as the planner scores a colocated layout.
            return np.asarray(raw["costs"]), None
        encoder, llm = self.layout["encoder"], self.layout["llm"]
        model = PipelineModel.encoder_llm(
            encoder_pp=encoder["pp"],
            encoder_dp=encoder["dp"],
            llm_pp=llm["pp"],
            stage_constant_s=raw["constants"],
            forward_fraction=forward_fraction,
            link_latency_s=link_latency_s,
            llm_chunks=llm.get("virtual_stages", 1),
            backward=(inputs.encoder.backward_stages, inputs.llm.backward_stages),
            llm_backward_needs_visual=inputs.llm.backward_needs_visual,
            order=self.layout.get("order"),
            weight_fraction=(inputs.encoder.weight_share, inputs.llm.weight_share),
            last_stage_weight_extra=raw["last_stage_weight_extra"],
        )
        return np.asarray(raw["costs"]), model
