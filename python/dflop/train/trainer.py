"""``Trainer``: one rank's training loop (any rank of the layout, encoder or LLM).

Per step k, on every rank:

1. draw step k's global batch (shapes seeded by (seed, k): the same on every rank) and
   its synthetic tensors (each rank renders only the samples it computes);
2. take step k's Schedule. **Rank 0 computes every schedule and broadcasts its
   assignment** (one int64 tensor per step): the cost model it prices samples with is
   corrected from measured times, and schedules may be cut short by a deadline, so
   recomputing them on every rank could disagree. On rank 0 an
   :class:`~dflop.scheduling.async_scheduler.AsyncScheduler` solves step k + lookahead while step k
   trains, and its deadline keeps training from ever waiting on it;
3. build the StepPlan (deterministic from schedule, shapes and layout) and run the
   pipelined forward/backward (:class:`~dflop.runtime.engine.PipelineEngine`), then the
   AdamW step on this rank's stage;
4. gather every rank's measured actions to rank 0, which prints the step's metrics, feeds
   the measured microbatch times to the cost model's adaptive correction
   (:func:`~dflop.train.metrics.measured_microbatch_times` documents the mapping), and
   submits the next schedule.

In ``compare`` mode a step runs twice on the same weights and batch (dflop's schedule and
the data-blind one, alternating which goes first), and the optimizer steps once.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop.models.registry import model_spec
from dflop.models.trainable import (
    adapter_tensors,
    freeze_stage,
    merge_lora,
    write_adapter_config,
)
from dflop.runtime.colocated import stage_parts
from dflop.runtime.topology import RuntimeLayout
from dflop.scheduling.balance import Schedule, data_blind_schedule, schedule_from_assignment
from dflop.scheduling.pipeline_schedule import PipelineModel
from dflop.train.calibration import OnlineCalibration, fit_link_latency
from dflop.train.checkpointer import Checkpointer
from dflop.train.config import TrainConfig
from dflop.train.data import StepShapes, _step_seed, length_policy
from dflop.train.metrics import RankRecord, StepLog, TrainReport, step_metrics
from dflop.train.optim import FrozenStageOptimizer
from dflop.train.step_profiler import StepProfiler

__all__ = ["FAULT_ENV", "NonFiniteError", "TrainReport", "Trainer", "fit_link_latency"]

FAULT_ENV = "DFLOP_FAULT_INJECT"
"""``"RANK:STEP"``: that rank raises at the start of that step (to test failure handling)."""


@dataclass
class _StepRun:
    """One step as it ran on this rank: its batch's shapes, every mode's schedule, step
    plan and result, and (rank 0) the step model's predictions made before it ran."""

    shapes: Any
    schedules: dict[str, Schedule]
    audits: dict[str, Any]
    plans: dict[str, Any]
    results: dict[str, Any]


class Trainer:
    """One rank of a training run. Create it on every rank after the default process group
    is initialised; :meth:`train` returns a :class:`TrainReport` on rank 0, None elsewhere.

    Args:
        config: the run's settings.
        layout: the runtime layout (the same on every rank).
        performance_model: rank 0's prior cost model (a PerformanceModel or its dict);
            ignored on other ranks, and unused in ``blind`` mode.
        device: this rank's torch device.
    """

    def __init__(
        self,
        config: TrainConfig,
        layout: RuntimeLayout,
        performance_model: Any = None,
        *,
        device: Any = "cpu",
        distribution: Any = None,
        cluster: dict[str, Any] | None = None,
        forward_fraction: tuple[float, float] | None = None,
    ) -> None:
        import torch

        from dflop.runtime import dist
        from dflop.runtime.engine import PipelineEngine, build_stage
        from dflop.runtime.tensor_parallel import optimizer_param_groups
        from dflop.runtime.topology import Topology

        self.config = config
        self.layout = layout
        self.device = torch.device(device)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.is_leader = self.rank == 0
        self.spec = model_spec(config.model)
        self.topology = Topology.create(layout, self.rank, timeout_s=config.timeout_s)
        self.info = self.topology.info
        # Tensor-parallel layouts shard the stage over its TP group (each rank keeps its
        # slice of the same full weights).
        self.stage = build_stage(
            self.spec,
            self.info,
            seed=config.seed,
            device=self.device,
            tp_group=self.topology.tp_group,
            tp_size=layout.module(self.info.module).tp,
            layout=layout,
        )
        # Frozen parts: no gradient, no optimizer state, no all-reduce; a stage with
        # nothing trainable at or before it runs forward only.
        # LoRA parts: frozen weights and trainable adapters.
        self.trainable = config.trainable_parts()
        for module, part in stage_parts(self.stage, self.info.module):  # colocated: both
            freeze_stage(part, self.spec, module, self.trainable, config.seed)
        self.engine = PipelineEngine(
            self.topology,
            self.stage,
            debug=config.debug,
            loss_chunk_tokens=config.loss_chunk_tokens,
            trainable=self.trainable,
        )
        # Sharded (DTensor) and replicated parameters in separate groups: torch's
        # multi-tensor kernels refuse a mixed list.
        groups = optimizer_param_groups(self.stage)
        self.optimizer = (
            torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
            if groups
            else FrozenStageOptimizer()
        )
        self.step_shapes = StepShapes(
            self.spec,
            layout.global_batch,
            seed=config.seed,
            distribution=distribution,
            family=config.family,
            mix=config.mix,
            scaler=config.scaler,
            length=length_policy(self.spec, config.max_seq_len, config.too_long),
        )
        fingerprint = getattr(distribution, "fingerprint", None)  # a dataset's records
        self.checkpointer = Checkpointer(
            config,
            layout,
            self._comm_device(),
            fingerprint() if fingerprint is not None and config.checkpoint_dir else None,
        )
        self.start_step = self.checkpointer.resume(self.stage, self.optimizer)
        self.cost_model = None
        self.scheduler = None
        # The forward shares a plan was scored with, refined by what the steps measure.
        self.calibration = OnlineCalibration(
            forward_fraction, str(self.trainable), _passthrough_factors(performance_model)
        )
        self._last_step_wall_s: float | None = None
        self._plan_cost_model: Any = None
        # Rank 0: the planner's model of this run's steps (times, memory).
        self.predictor = self._step_predictor(cluster) if self.is_leader else None
        self._submitted: dict[int, Any] = {}  # rank 0: the shapes each schedule was asked for
        self.samples_replaced = 0
        """Batch samples replaced because their record's images did not decode."""
        self.profiler = StepProfiler(
            config,
            self.device,
            self.info.global_stage,
            self.start_step,
            self._stage_memory if self.is_leader else None,
            llm_replica=self.info.dp_rank if self.info.module == "llm" else None,
        )
        self._flop_model: Any = None  # rank 0's FLOP count of a step (built on first use)
        self._peak_flops: float | None = None
        self.stopped_after_step: int | None = None
        """The step after which a SIGTERM stopped the run (None: it ran to the end)."""
        if self.is_leader and "dflop" in config.modes:
            self._start_scheduler(performance_model)

    # ------------------------------------------------------------------ setup

    def _step_predictor(self, cluster: dict[str, Any] | None) -> Any:
        """The planner's model of this run's steps on its cluster (the plan's, else the
        local processes'), as dflop's runtime executes them."""
        from dflop.planner import ClusterSpec, StepPredictor
        from dflop.train.planning import (
            core_layout,
            cost_configs,
            local_cluster,
            runtime_planner_config,
        )

        encoder, llm = cost_configs(self.spec)
        return StepPredictor(
            ClusterSpec.from_dict(cluster) if cluster else local_cluster(self.world_size),
            encoder,
            llm,
            core_layout(self.layout),
            runtime_planner_config(
                self.config.loss_chunk_tokens,
                num_batches=1,
                trainable=self.config.trainable,
                lora_rank=self.config.lora_rank,
            ),
        )

    def _start_scheduler(self, performance_model: Any) -> None:
        from dflop.profiling import CostModel, PerformanceModel
        from dflop.scheduling.async_scheduler import AsyncScheduler

        if performance_model is None:
            raise ValueError("the dflop schedule needs a performance model on rank 0")
        if isinstance(performance_model, dict):
            performance_model = PerformanceModel.from_dict(performance_model)
        self.cost_model = CostModel(performance_model)
        # The model the plan was scored with, never corrected: what the plan predicts
        # for the steps the run trains (reported beside the corrected simulator's).
        self._plan_cost_model = CostModel(performance_model)
        self._plan_forward_fraction = self.calibration.full_training_shares
        # Until the steps calibrate it, the latency the plan was scored with.
        self.calibration.link_latency_s = self.predictor.cluster.link_latency_s
        if self.layout.colocated:  # scheduled per step as the plan scores it (_colocated)
            return
        self.scheduler = AsyncScheduler(
            self.layout.num_microbatches,
            self.layout.llm.dp,
            microbatch_dims=self._microbatch_dims,
            seed=self.config.seed,
            lookahead=self.config.lookahead,
            max_growth=self.config.max_growth,
        )
        for step in range(
            self.start_step, min(self.config.steps, self.start_step + self.config.lookahead)
        ):
            self._submit(step)

    # ------------------------------------------------------------------ scheduling (rank 0)

    @property
    def _microbatch_dims(self) -> tuple[int, ...]:
        """The cost columns a microbatch shares over replicas: the encoder's (its replicas
        split each microbatch by unit), none in a colocated layout (each LLM replica
        encodes its own samples)."""
        return () if self.layout.colocated else (0,)

    def _scheduler_view(self, shapes: Any) -> tuple[np.ndarray, PipelineModel | None]:
        """What the scheduler sees of ``shapes``: per-sample seconds of an average stage of
        each module (the encoder's on one replica: its replicas share each microbatch by
        unit) and the pipeline, by the planner's model of this layout (the same numbers a
        plan was scored with) priced by the current cost model and calibration. A colocated
        layout: the first stage's seconds (encoder and its LLM layers) and an average LLM
        stage's, balanced per bin as the planner scores it, no pipeline model (None)."""
        return self.predictor.scheduler_view(
            self.cost_model,
            shapes,
            forward_fraction=self.calibration.shares,
            link_latency_s=self.calibration.link_latency_s,
            full_training_fraction=self.calibration.full_training_shares,
        )

    def _submit(self, step: int, shapes: Any = None, deadline: float | None = None) -> None:
        timed = self.config.schedule_deadline and not self.config.deterministic
        if deadline is None and timed and self._last_step_wall_s:
            deadline = max(0.01, (self.config.lookahead - 1) * self._last_step_wall_s)
        if shapes is None:
            shapes = self.step_shapes.shapes(step)
        self._submitted[step] = shapes
        costs, model = self._scheduler_view(shapes)
        if self.config.pipeline_schedule:
            self.scheduler.submit(
                step, costs, deadline_s=deadline, pipeline=model, units=shapes.encoder_units
            )
        else:  # balance alone: the encoder's cost per replica
            self.scheduler.submit(step, _balance_costs(costs, model), deadline_s=deadline)

    def _leader_schedules(self, step: int, shapes: Any) -> dict[str, Schedule]:
        m, dp = self.layout.num_microbatches, self.layout.llm.dp
        out: dict[str, Schedule] = {}
        for mode in self.config.modes:
            if mode == "dflop" and self.layout.colocated:
                out[mode] = self._colocated_schedule(step, shapes)
            elif mode == "dflop":
                out[mode] = self.scheduler.get(step)
                if not _same_shapes(self._submitted.pop(step), shapes):
                    # A record was replaced since the step was submitted (its images did
                    # not decode): solve for the batch as it is now, with no search.
                    # (A deterministic run solves it to the end, as every step.)
                    self._submit(step, shapes, deadline=None if self.config.deterministic else 0.0)
                    out[mode] = self.scheduler.get(step)
                nxt = step + self.config.lookahead
                if nxt < self.config.steps:
                    self._submit(nxt)
            else:
                costs = np.stack([shapes.encoder_tokens, shapes.seq_len], axis=1).astype(float)
                if self.cost_model is not None:
                    costs = _balance_costs(*self._scheduler_view(shapes))
                out[mode] = data_blind_schedule(costs, m, dp, microbatch_dims=self._microbatch_dims)
        return out

    def _colocated_schedule(self, step: int, shapes: Any) -> Schedule:
        """A colocated layout's schedule of ``shapes``: the planner's own (its balance of
        the first stage's and an average stage's per-bin costs, and the microbatch order it
        scores; ``StepPredictor.planned_step``), priced by the current cost model and
        calibration, so that the runtime executes what a plan predicts. A few
        milliseconds: computed when the step comes, without the background scheduler."""
        planned = self.predictor.planned_step(
            self.cost_model,
            shapes,
            seed=self.config.seed + step,
            forward_fraction=self.calibration.full_training_shares,
            link_latency_s=self.calibration.link_latency_s,
        )
        costs = _balance_costs(*self._scheduler_view(shapes))
        return schedule_from_assignment(
            costs,
            planned.assignment,
            self.layout.num_microbatches,
            self.layout.llm.dp,
            microbatch_dims=(),
        )

    def _audit(self, s: Schedule, shapes: Any) -> Any:
        """The planner's model of this step under schedule ``s`` (the same function a plan
        is scored with: the encoder split, the slowest replica per encoder stage, links,
        all-reduce), priced by the current cost model with the calibrated forward shares
        and link latency."""
        return self.predictor.audit(
            self.cost_model,
            shapes,
            s.assignment,
            forward_fraction=self.calibration.full_training_shares,
            link_latency_s=self.calibration.link_latency_s if self.calibration.calibrated else None,
        )

    def _plan_audit(self, s: Schedule, shapes: Any) -> Any:
        """:meth:`_audit` by the plan's own model: the cost model, forward shares and
        link latency the plan was scored with, as they were before any step."""
        return self.predictor.audit(
            self._plan_cost_model,
            shapes,
            s.assignment,
            forward_fraction=self._plan_forward_fraction,
        )

    # ------------------------------------------------------------------ communication

    def _comm_device(self) -> Any:
        """Where collectives' tensors live: the GPU under NCCL, else the CPU."""
        from dflop.runtime.p2p import collective_device

        return collective_device()

    def _step_batch(self, step: int) -> Any:
        """``step``'s batch source; with ``check_images``, its records' image files are
        decoded first (once per record per run, spread over the ranks) and a record whose
        files do not decode is replaced by a seeded redraw, the same on every rank."""
        from dflop.train.image_check import check_step_records

        source = self.step_shapes
        data_seed = _step_seed(self.config.seed + 1, step)
        batch = source.batch(step, data_seed)
        if not self.config.check_images or source.records is None:
            return batch
        replaced = False
        while found := check_step_records(
            source, step, batch, self.rank, self.world_size, self._comm_device()
        ):
            replaced = True
            if self.is_leader:
                for why in found.values():
                    print(
                        f"step {step + 1}: skipped a record, replaced by a redraw: {why}",
                        flush=True,
                    )  # counted from 1, as the progress line counts steps
            batch = source.batch(step, data_seed)
        if replaced:
            drawn = source.records.indices(source.global_batch, seed=_step_seed(source.seed, step))
            self.samples_replaced += int((source.record_indices(step) != drawn).sum())
        return batch

    def _encoder_costs(self, shapes: Any) -> np.ndarray:
        """(N,) what the encoder split balances: the cost model's encoder seconds per
        sample (as the planner splits), or encoder tokens without a cost model."""
        if self.cost_model is None:
            return shapes.encoder_tokens.astype(np.float64)
        return np.array(self.cost_model.costs(shapes)[:, 0], dtype=np.float64)

    def _broadcast_schedules(
        self, step: int, shapes: Any
    ) -> tuple[dict[str, Schedule], np.ndarray]:
        """Every mode's Schedule and the encoder costs the split uses, from rank 0 (its
        cost model is corrected online, so other ranks could not recompute them)."""
        import torch

        from dflop.runtime import dist

        modes = self.config.modes
        n = len(shapes)
        comm_device = self._comm_device()
        if self.is_leader:
            schedules = self._leader_schedules(step, shapes)
            encoder_costs = self._encoder_costs(shapes)
            stacked = np.stack([np.asarray(schedules[mode].assignment) for mode in modes])
            buffer = torch.from_numpy(stacked.astype(np.int64)).to(comm_device)
            costs = torch.from_numpy(encoder_costs).to(comm_device)
        else:
            buffer = torch.empty((len(modes), n), dtype=torch.int64, device=comm_device)
            costs = torch.empty(n, dtype=torch.float64, device=comm_device)
        dist.broadcast(buffer, src=0)
        dist.broadcast(costs, src=0)
        if self.is_leader:
            return schedules, encoder_costs
        assignments = buffer.cpu().numpy()
        zeros = np.zeros((n, 2))
        m, dp = self.layout.num_microbatches, self.layout.llm.dp
        return {
            mode: schedule_from_assignment(
                zeros, assignments[i], m, dp, microbatch_dims=self._microbatch_dims
            )
            for i, mode in enumerate(modes)
        }, costs.cpu().numpy()

    def _record(self, mode_results: dict[str, Any]) -> dict[str, RankRecord]:
        info = self.info
        return {
            mode: RankRecord(
                rank=self.rank,
                module=info.module,
                dp_rank=info.dp_rank,
                global_stage=info.global_stage,
                step_time_s=result.step_time_s,
                busy_s=result.busy_s,
                actions=tuple((t.kind, t.microbatch, t.start_s, t.end_s) for t in result.timings),
                encoder_forward_s=tuple(
                    (t.microbatch, t.encoder_s) for t in result.timings if t.encoder_s > 0
                ),
            )
            for mode, result in mode_results.items()
        }

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainReport | None:
        """Run steps ``start_step .. config.steps - 1``; see the module docstring."""
        config = self.config
        fault = _fault_step(self.rank)
        log = StepLog(config, self.start_step) if self.is_leader else None
        try:
            for step in range(self.start_step, config.steps):
                self.profiler.before_step(step)
                if fault is not None and step == fault[0]:
                    if fault[1] == "hang":  # a rank that stops responding, as a hung one
                        while True:
                            time.sleep(3600)
                    raise RuntimeError(
                        f"injected failure on rank {self.rank} at step {step} ({FAULT_ENV})"
                    )
                wall_start = time.perf_counter()
                run = self._run_step(step, self._step_batch(step))
                grad_norm = self._clip_gradients()
                _check_finite(step, {m: r.loss for m, r in run.results.items()}, grad_norm)
                self.optimizer.step()
                gathered = self._gather_records(run.results)
                self._last_step_wall_s = time.perf_counter() - wall_start
                if log is not None:
                    self._account(log, step, run, gathered, grad_norm)
                if self.checkpointer.end_of_step(step, self.stage, self.optimizer):
                    self.stopped_after_step = step
                    break
            self.profiler.finish()
            if config.save_hf:
                self.save_hf_checkpoint(config.save_hf)
        finally:
            self.profiler.close()  # a step failed while profiling: stop it
            if log is not None:
                log.close()
            if self.scheduler is not None:
                self.scheduler.close()
        return self._report(log) if log is not None else None

    def _audits(self, schedules: dict[str, Schedule], shapes: Any) -> dict[str, Any]:
        """Rank 0, with a cost model: every mode's step as the (corrected) step model
        predicts it before it runs, and the dflop step by the plan's own model."""
        if not self.is_leader or self.cost_model is None:
            return {}
        audits = {mode: self._audit(s, shapes) for mode, s in schedules.items()}
        audits["plan"] = self._plan_audit(schedules["dflop"], shapes)
        return audits

    def _run_step(self, step: int, batch: Any) -> _StepRun:
        """The step's schedules (from rank 0), then each mode's StepPlan and pipelined
        forward/backward on the same weights (in compare mode alternating which goes
        first); the gradients add up."""
        from dflop.runtime.step_data import StepPlan

        shapes = batch.shapes
        schedules, encoder_costs = self._broadcast_schedules(step, shapes)
        self.profiler.record_schedules(step, shapes, schedules)
        audits = self._audits(schedules, shapes)
        modes = self.config.modes
        order = list(modes) if step % 2 == 0 else list(reversed(modes))
        plans, results = {}, {}
        for mode in order:
            plans[mode] = StepPlan.build(
                schedules[mode],
                shapes,
                self.layout,
                batch.target_tokens(),
                tokens_per_unit=self.spec.tokens_per_unit,
                visual_newline=self.spec.visual_newline,
                encoder_costs=encoder_costs,
                unit_tokens=batch.unit_tokens() if self.spec.tokens_per_unit is None else None,
                token_merge=self.spec.token_merge,
            )
            results[mode] = self.engine.run_step(plans[mode], batch)
        return _StepRun(shapes, schedules, audits, plans, results)

    def _gather_records(self, results: dict[str, Any]) -> list[Any] | None:
        """Every rank's measured actions of this step, on rank 0 (None elsewhere)."""
        from dflop.runtime import dist

        gathered: list[Any] | None = [None] * self.world_size if self.is_leader else None
        dist.gather_object(self._record(results), gathered, dst=0)
        return gathered

    def _step_flops(self, shapes: Any) -> float:
        """The step's model training FLOPs (3x the forward of every module, whatever the
        regime trains: as MFU is conventionally counted)."""
        if self._flop_model is None:
            from dflop.data.costs import AnalyticCostModel
            from dflop.train.metrics import peak_flops
            from dflop.train.planning import cost_configs

            self._flop_model = AnalyticCostModel(*cost_configs(self.spec))
            one = peak_flops(self.device, self.config.peak_tflops)
            self._peak_flops = None if one is None else one * self.world_size
        return float(self._flop_model.flops(shapes).sum())

    def _account(
        self, log: StepLog, step: int, run: _StepRun, gathered: list[Any], grad_norm: float
    ) -> None:
        """Rank 0 after a step: each mode's metrics (logged), and dflop's measured times
        folded into the step model (:class:`~dflop.train.calibration.OnlineCalibration`)."""
        shapes, schedules, audits = run.shapes, run.schedules, run.audits
        planned = audits["plan"].step_time_s if "plan" in audits else math.nan
        for mode in self.config.modes:
            records = [g[mode] for g in gathered]
            row = step_metrics(
                step,
                mode,
                run.results[mode].loss,
                records,
                len(shapes),
                int(shapes.seq_len.sum()),
                predicted_step_time_s=audits[mode].step_time_s if mode in audits else math.nan,
                schedule_ratio=schedules[mode].ratio,
                grad_norm=grad_norm,
                plan_model_step_time_s=planned if mode == "dflop" else math.nan,
                step_flops=self._step_flops(shapes),
                peak_flops=self._peak_flops,
            )
            # A run's first step pays one-time costs; a deterministic run keeps its model.
            if mode == "dflop" and step > self.start_step and not self.config.deterministic:
                self.calibration.learn(
                    records,
                    schedules[mode],
                    run.plans[mode],
                    shapes,
                    audits[mode],
                    self.layout,
                    cost_model=self.cost_model if self.config.adaptive else None,
                )
            log.add(row, records)
        log.step_done()

    def _report(self, log: StepLog) -> TrainReport:
        config = self.config
        return TrainReport(
            config=config.to_dict(),
            layout=self.layout.to_dict(),
            metrics=log.metrics,
            timelines=log.timelines(),
            start_step=self.start_step,
            performance_model=(
                self.cost_model.performance_model.to_dict() if self.cost_model else None
            ),
            stats={
                "stopped_after_step": self.stopped_after_step,
                "schedule_fallbacks": self.scheduler.num_fallbacks if self.scheduler else 0,
                # Records whose images did not decode, and the batch samples redrawn.
                "bad_records": sorted(self.step_shapes.bad_records.values()),
                "samples_replaced": self.samples_replaced,
                # The calibration of the step model (dflop plan --local uses it).
                "link_latency_s": self.calibration.final_link_latency_s(self._audit),
                # (full-training shares, as plans take them)
                "forward_fraction": dict(
                    zip(("encoder", "llm"), self.calibration.full_training_shares)
                ),
                # With profile_trace: (trace file, TransferOverlap fields) per profiled rank.
                "transfer_overlap": self.profiler.transfer_overlaps,
                # With memory_report: per rank, its stage's measured and predicted peak.
                "memory": self.profiler.memory_report,
            },
        )

    def _stage_memory(
        self, shapes: Any, assignment: np.ndarray, llm_replica: int | None = None
    ) -> list[float]:
        """Rank 0: bytes per global stage by the memory model for ``shapes`` under
        ``assignment`` (the plan's cost model; a blind run's analytic one), the LLM's on
        ``llm_replica``'s microbatches (None: the largest replica's)."""
        cost_model = self._plan_cost_model or self._memory_cost_model()
        return list(self.predictor.stage_memory_bytes(cost_model, shapes, assignment, llm_replica))

    def _memory_cost_model(self) -> Any:
        """A cost model for the memory prediction of a run with none (blind mode): memory
        does not depend on time."""
        from dflop.profiling import CostModel
        from dflop.train.planning import analytic_performance_model

        return CostModel(analytic_performance_model(self.spec))

    def _clip_gradients(self) -> float:
        """The global gradient norm of this step (every rank gets it), after which the
        gradients are scaled down to ``grad_clip_norm`` if it is exceeded. Each parameter
        counts once: sharded (TP) gradients by their local shards, replicated ones on TP
        rank 0 only, and only DP replica 0 of each module (replicas hold equal gradients
        after the DP all-reduce; a head tied to the embedding counts on the first LLM
        stage only)."""
        import torch

        from dflop.runtime import dist
        from dflop.runtime.tensor_parallel import grad_sq_sum

        share = grad_sq_sum(self.stage, include_replicated=self.info.tp_rank == 0)
        tied = getattr(self.stage, "tied_parameter", None)
        tied = tied() if callable(tied) else None
        if tied is not None and tied.grad is not None and self.info.is_last_stage:
            share = share - tied.grad.detach().double().pow(2).sum().to(share.device)
        share = share.to(self._comm_device())
        if self.info.dp_rank != 0:
            share.zero_()
        dist.all_reduce(share)
        norm = float(share.sqrt())
        limit = self.config.grad_clip_norm
        if limit is not None and norm > limit:
            scale = limit / (norm + 1e-6)
            with torch.no_grad():
                for p in self.stage.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
        return norm

    def save_hf_checkpoint(self, folder: str) -> None:
        """Write the model as a Hugging Face checkpoint folder (call on every rank): each
        stage's first replica writes its own safetensors file (its TP ranks gather the
        shards first), rank 0 the rest (untrained tensors, the index, ``config.json``),
        all into a staging folder that rank 0 then publishes whole
        (:mod:`dflop.train.export`: never two models in one folder)."""
        from dflop.runtime import dist
        from dflop.runtime.engine import StageChunks
        from dflop.runtime.tensor_parallel import full_tensor
        from dflop.train.export import begin_export, publish_export, staging_folder

        target, folder = folder, staging_folder(folder)  # published whole, at the end
        if self.is_leader:
            begin_export(target)
        dist.barrier()
        info = self.info
        parts = self.trainable
        weight_map: dict[str, str] = {}
        adapter: tuple[list[str], list[str]] = ([], [])
        # Every TP rank gathers the shards (a collective), one writes; a colocated first
        # stage writes its encoder and its LLM layers as two files.
        for module, stage in stage_parts(self.stage, info.module) if info.dp_rank == 0 else ():
            own = stage.model_state_dict() if isinstance(stage, StageChunks) else stage.state_dict()
            state = {k: full_tensor(v) for k, v in own.items()}
            if info.tp_rank == 0:
                name = f"{module}-stage{info.global_stage:03d}"
                if parts.uses_lora:
                    layers, modules = self._save_adapter_part(folder, state, module, name)
                    adapter[0].extend(layers)
                    adapter[1].extend(modules)
                    state = merge_lora(state, parts.lora)
                weight_map.update(self.spec.save_shard(folder, f"model-{name}.safetensors", state))
        gathered: list[Any] | None = [None] * self.world_size if self.is_leader else None
        dist.gather_object((weight_map, adapter), gathered, dst=0)
        if self.is_leader:
            merged = {key: name for part, _ in gathered for key, name in part.items()}
            self.spec.finish_checkpoint(folder, merged, seed=self.config.seed)
            if parts.uses_lora:
                self._finish_adapter(folder, [a for _, a in gathered])
            publish_export(target, self.config.save_hf_replace)
            what = "with its LoRA adapters merged " if parts.uses_lora else ""
            print(f"saved the model {what}in the Hugging Face layout to {target}", flush=True)
        dist.barrier()

    def _save_adapter_part(
        self, folder: str, state: dict[str, Any], module: str, name: str
    ) -> tuple[list, list]:
        """A stage part's share of the PEFT adapter folder (``folder/lora-adapter``): the
        tensors of ``state`` (a ``module`` part) in a part file ``name`` that rank 0 joins;
        returns (adapted layers, full modules)."""
        from safetensors.torch import save_file

        tensors, layers, modules = adapter_tensors(
            state, self.trainable, lambda key: self.spec.parameter_part(module, key)
        )
        parts_dir = os.path.join(folder, "lora-adapter", "parts")
        os.makedirs(parts_dir, exist_ok=True)
        path = os.path.join(parts_dir, f"{name}.safetensors")
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)
        return layers, modules

    def _finish_adapter(self, folder: str, stages: list[tuple[list, list]]) -> None:
        """Rank 0: join the stages' adapter parts into ``adapter_model.safetensors`` and
        write ``adapter_config.json``: ``PeftModel.from_pretrained(base, folder)``, the
        base being the model this run started from."""
        from safetensors.torch import load_file, save_file

        adapter_dir = os.path.join(folder, "lora-adapter")
        parts_dir = os.path.join(adapter_dir, "parts")
        tensors: dict[str, Any] = {}
        for name in sorted(os.listdir(parts_dir)):
            tensors.update(load_file(os.path.join(parts_dir, name)))
        save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"))
        shutil.rmtree(parts_dir)
        layers = sorted({layer for stage_layers, _ in stages for layer in stage_layers})
        modules = sorted({m for _, stage_modules in stages for m in stage_modules})
        base = getattr(self.spec, "checkpoint_dir", None)
        write_adapter_config(adapter_dir, self.trainable, layers, modules, base)
        start = base or f"the initial weights of seed {self.config.seed}"
        print(f"saved the LoRA adapters (PEFT) to {adapter_dir}; they apply to {start}", flush=True)


def _balance_costs(costs: np.ndarray, model: PipelineModel | None) -> np.ndarray:
    """What the balance alone minimises: :meth:`PipelineModel.balance_costs`, or a
    colocated layout's per-bin costs as they are (no pipeline model)."""
    return costs if model is None else model.balance_costs(costs)


def _passthrough_factors(performance_model: Any) -> dict[str, Any] | None:
    """What the model profiler measured of a frozen layer's backward (None: nothing)."""
    if performance_model is None:
        return None
    from dflop.profiling import CostModel, PerformanceModel

    if isinstance(performance_model, dict):
        performance_model = PerformanceModel.from_dict(performance_model)
    return CostModel(performance_model).passthrough_factors


def _same_shapes(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in (
            "encoder_units",
            "tokens_per_unit",
            "llm_visual_tokens",
            "text_tokens",
            "target_tokens",
        )
    )


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is not finite: the run stops before the update."""


def _check_finite(step: int, losses: dict[str, float], grad_norm: float) -> None:
    """Stop (every rank: the loss and the norm are global) before a non-finite update
    reaches the weights or a checkpoint."""
    bad = {f"loss ({mode})": v for mode, v in losses.items() if not math.isfinite(v)}
    if not math.isfinite(grad_norm):
        bad["gradient norm"] = grad_norm
    if bad:
        found = ", ".join(f"{name} {value}" for name, value in bad.items())
        raise NonFiniteError(
            f"step {step}: {found} is not finite; stopped before the update (the weights and "
            "checkpoints are those of the previous step): lower --lr, keep --grad-clip, or "
            "check the data"
        )


def _fault_step(rank: int) -> tuple[int, str] | None:
    """(step, kind) of the failure :data:`FAULT_ENV` injects on this rank: ``RANK:STEP``
    raises there, ``RANK:STEP:hang`` stops responding there (the reliability tests')."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "hang"):
            raise ValueError
        fault_rank, fault_step = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={spec!r} must be RANK:STEP or RANK:STEP:hang") from None
    kind = parts[2] if len(parts) == 3 else "raise"
    return (fault_step, kind) if fault_rank == rank else None
