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
   pipelined forward/backward (:class:`~dflop.runtime.pipeline.PipelineEngine`), then the
   AdamW step on this rank's stage;
4. gather every rank's measured actions to rank 0, which prints the step's metrics, feeds
   the measured microbatch times to the cost model's adaptive correction
   (:func:`~dflop.train.metrics.measured_microbatch_times` documents the mapping), and
   submits the next schedule.

In ``compare`` mode a step runs twice on the same weights and batch (dflop's schedule and
the data-blind one, alternating which goes first), and the optimizer steps once.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflop.models.spec import model_spec
from dflop.runtime.topology import RuntimeLayout
from dflop.scheduling.balance import Schedule, data_blind_schedule, schedule_from_assignment
from dflop.scheduling.pipeline import PipelineModel
from dflop.train.config import TrainConfig
from dflop.train.data import StepShapes, _step_seed, length_policy
from dflop.train.metrics import (
    RankRecord,
    StepMetrics,
    format_step,
    measured_microbatch_times,
    step_metrics,
    timeline_records,
)

__all__ = ["FAULT_ENV", "NonFiniteError", "TrainReport", "Trainer"]

FAULT_ENV = "DFLOP_FAULT_INJECT"
"""``"RANK:STEP"``: that rank raises at the start of that step (to test failure handling)."""


@dataclass
class TrainReport:
    """What rank 0 returns: every step's metrics and the timelines of the last steps."""

    config: dict[str, Any]
    layout: dict[str, Any]
    metrics: list[StepMetrics]
    timelines: dict[str, list[dict[str, Any]]]
    """Per mode: event records of the last ``trace_steps`` steps, laid end to end."""
    start_step: int
    performance_model: dict[str, Any] | None = None
    """The cost model's corrected coefficients at the end."""
    stats: dict[str, Any] = field(default_factory=dict)
    planned_step_time_s: float = math.nan
    """The plan's predicted step time for the layout (set by the launcher; nan: none)."""


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

        from dflop.runtime import comm as dist
        from dflop.runtime.pipeline import PipelineEngine, build_stage
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
        self.engine = PipelineEngine(
            self.topology,
            self.stage,
            debug=config.debug,
            loss_chunk_tokens=config.loss_chunk_tokens,
        )
        # Sharded (DTensor) and replicated parameters in separate groups: torch's
        # multi-tensor kernels refuse a mixed list.
        self.optimizer = torch.optim.AdamW(
            optimizer_param_groups(self.stage), lr=config.lr, weight_decay=config.weight_decay
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
        self.start_step = 0
        self._resume()
        self.cost_model = None
        self.scheduler = None
        # The forward shares a plan was scored with, refined by what the steps measure.
        fractions = forward_fraction or (1.0 / 3.0, 1.0 / 3.0)
        self._forward_fraction = {"encoder": float(fractions[0]), "llm": float(fractions[1])}
        self._last_step_wall_s: float | None = None
        self._link_latency_s = 0.0
        self._latency_fits: collections.deque[float] = collections.deque(maxlen=9)
        self._observed_steps: collections.deque[tuple[Any, Schedule, float]] = collections.deque(
            maxlen=32
        )
        self._calibrated = False
        self._plan_cost_model: Any = None
        # Rank 0: the planner's model of this run's steps (times, memory).
        self.predictor = self._step_predictor(cluster) if self.is_leader else None
        self._submitted: dict[int, Any] = {}  # rank 0: the shapes each schedule was asked for
        self.samples_replaced = 0
        """Batch samples replaced because their record's images did not decode."""
        self.transfer_overlaps: list[tuple[str, dict[str, Any]]] = []
        # memory_report: the measured window's steps (shapes and every mode's schedule).
        self._memory_steps: list[tuple[Any, list[np.ndarray]]] = []
        self.memory_report: list[dict[str, Any]] = []
        self._memory_start_bytes = 0
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
            runtime_planner_config(self.config.loss_chunk_tokens, num_batches=1),
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
        self._plan_forward_fraction = (
            self._forward_fraction["encoder"],
            self._forward_fraction["llm"],
        )
        # Until the steps calibrate it, the latency the plan was scored with.
        self._link_latency_s = self.predictor.cluster.link_latency_s
        self.scheduler = AsyncScheduler(
            self.layout.num_microbatches,
            self.layout.llm.dp,
            microbatch_dims=(0,),
            seed=self.config.seed,
            lookahead=self.config.lookahead,
            max_growth=self.config.max_growth,
        )
        for step in range(
            self.start_step, min(self.config.steps, self.start_step + self.config.lookahead)
        ):
            self._submit(step)

    def _resume(self) -> None:
        """Load the checkpoint to resume from: rank 0 chooses it (the step ``latest``
        names when it verifies, else the newest intact one, saying so) and tells every
        rank, so all resume from the same step."""
        from dflop.runtime import comm as dist
        from dflop.train.checkpoint import find_checkpoint, load_checkpoint

        if not self.config.checkpoint_dir:
            return
        choice: list[Any] = [None]
        if self.is_leader:
            found = find_checkpoint(
                self.config.checkpoint_dir, self.world_size, log=lambda m: print(m, flush=True)
            )
            choice = [None if found is None else str(found)]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return
        state = load_checkpoint(choice[0], self.rank, self._checkpoint_identity())
        self.stage.load_state_dict(state["stage"])
        self.optimizer.load_state_dict(state["optimizer"])
        # The optimizer's state restores the saved run's hyper-parameters; this run's
        # settings apply from its first step (the launcher said which ones changed).
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr
            group["weight_decay"] = self.config.weight_decay
        self.start_step = int(state["step"]) + 1
        if self.is_leader:
            print(f"resumed from {choice[0]} (step {self.start_step} next)", flush=True)

    def _checkpoint_identity(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_dict(),
            "model": self.config.model,
            "world_size": self.world_size,
            "seed": self.config.seed,
        }

    # ------------------------------------------------------------------ scheduling (rank 0)

    def _scheduler_view(self, shapes: Any) -> tuple[np.ndarray, PipelineModel]:
        """What the scheduler sees of ``shapes``: per-sample seconds of an average stage of
        each module (the encoder's on one replica: its replicas share each microbatch by
        unit) and the pipeline, by the planner's model of this layout (the same numbers a
        plan was scored with) priced by the current cost model and calibration."""
        costs, constants = self.predictor.stage_costs(self.cost_model, shapes)
        model = PipelineModel.for_layout(
            self.layout,
            stage_constant_s=constants,
            forward_fraction=(self._forward_fraction["encoder"], self._forward_fraction["llm"]),
            link_latency_s=self._link_latency_s,
        )
        return costs, model

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
            self.scheduler.submit(step, model.balance_costs(costs), deadline_s=deadline)

    def _leader_schedules(self, step: int, shapes: Any) -> dict[str, Schedule]:
        m, dp = self.layout.num_microbatches, self.layout.llm.dp
        out: dict[str, Schedule] = {}
        for mode in self.config.modes:
            if mode == "dflop":
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
                    stage_costs, model = self._scheduler_view(shapes)
                    costs = model.balance_costs(stage_costs)
                out[mode] = data_blind_schedule(costs, m, dp, microbatch_dims=(0,))
        return out

    def _audit(self, s: Schedule, shapes: Any) -> Any:
        """The planner's model of this step under schedule ``s`` (the same function a plan
        is scored with: the encoder split, the slowest replica per encoder stage, links,
        all-reduce), priced by the current cost model with the calibrated forward shares
        and link latency."""
        return self.predictor.audit(
            self.cost_model,
            shapes,
            s.assignment,
            forward_fraction=(self._forward_fraction["encoder"], self._forward_fraction["llm"]),
            link_latency_s=self._link_latency_s if self._calibrated else None,
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

    def _calibrate_latency(
        self, records: list[RankRecord], schedule: Schedule, audit: Any, shapes: Any
    ) -> None:
        """Fit the per-transfer latency that makes the step model, fed the cost model's
        action times (the step's audit), reproduce the measured step: it takes what the
        action times do not explain (per-message costs, Python overhead, the loss
        all-reduce, and the waiting that timing noise adds to a pipeline). The median of
        the last fits: one step slowed by another process on shared cores moves it little;
        later predictions use it."""
        if audit.llm_forward_s.shape[1] + audit.num_encoder_stages < 2:
            return  # one stage: no links
        measured = max(r.step_time_s for r in records)
        self._observed_steps.append((shapes, schedule, measured))
        self._latency_fits.append(fit_link_latency([audit], measured))
        self._link_latency_s = float(np.median(self._latency_fits))
        self._calibrated = True

    def final_link_latency_s(self) -> float | None:
        """The latency that, with the cost model and forward shares as they are now (the
        run's end), makes the mean simulated step of the last observed steps equal their
        mean measured step: a consistent snapshot for planning (``dflop plan --local``
        calibrates with it). The running estimate pairs each step's latency with the cost
        model of that step, which kept moving."""
        if not self._calibrated or not self._observed_steps:
            return None
        audits = [self._audit(s, shapes) for shapes, s, _ in self._observed_steps]
        measured = float(np.mean([t for _, _, t in self._observed_steps]))
        return fit_link_latency(audits, measured)

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
                    print(f"step {step}: skipped a record, replaced by a redraw: {why}", flush=True)
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

        from dflop.runtime import comm as dist

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
            mode: schedule_from_assignment(zeros, assignments[i], m, dp, microbatch_dims=(0,))
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
            )
            for mode, result in mode_results.items()
        }

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainReport | None:
        """Run steps ``start_step .. config.steps - 1``; see the module docstring."""
        from dflop.runtime import comm as dist
        from dflop.runtime.step_data import StepPlan

        config = self.config
        fault = _fault_step(self.rank)
        metrics: list[StepMetrics] = []
        recent: dict[str, collections.deque] = {
            mode: collections.deque(maxlen=config.trace_steps) for mode in config.modes
        }
        bar = self._progress_bar()
        num_fallbacks_before = 0
        profiled_from = max(self.start_step, config.steps - config.trace_steps)
        profiler = None
        try:
            for step in range(self.start_step, config.steps):
                if step == profiled_from and self._profiling():
                    profiler = self._start_profiler()
                if step == fault:
                    raise RuntimeError(
                        f"injected failure on rank {self.rank} at step {step} ({FAULT_ENV})"
                    )
                wall_start = time.perf_counter()
                batch = self._step_batch(step)
                shapes = batch.shapes
                schedules, encoder_costs = self._broadcast_schedules(step, shapes)
                audits, planned = {}, math.nan
                if self.is_leader and self.cost_model is not None:
                    audits = {mode: self._audit(s, shapes) for mode, s in schedules.items()}
                    planned = self._plan_audit(schedules["dflop"], shapes).step_time_s
                if config.memory_report and self.is_leader and step >= profiled_from:
                    assignments = [np.asarray(s.assignment) for s in schedules.values()]
                    self._memory_steps.append((shapes, assignments))
                order = list(config.modes) if step % 2 == 0 else list(reversed(config.modes))
                results, plans = {}, {}
                for mode in order:
                    plans[mode] = StepPlan.build(
                        schedules[mode],
                        shapes,
                        self.layout,
                        batch.target_tokens(),
                        tokens_per_unit=self.spec.tokens_per_unit,
                        visual_newline=self.spec.visual_newline,
                        encoder_costs=encoder_costs,
                        unit_tokens=(
                            batch.unit_tokens() if self.spec.tokens_per_unit is None else None
                        ),
                        token_merge=self.spec.token_merge,
                    )
                    results[mode] = self.engine.run_step(plans[mode], batch)
                grad_norm = self._clip_gradients()
                _check_finite(step, {m: r.loss for m, r in results.items()}, grad_norm)
                self.optimizer.step()
                gathered: list[Any] | None = [None] * self.world_size if self.is_leader else None
                dist.gather_object(self._record(results), gathered, dst=0)
                self._last_step_wall_s = time.perf_counter() - wall_start
                if self.is_leader:
                    for mode in config.modes:
                        records = [g[mode] for g in gathered]
                        row = step_metrics(
                            step,
                            mode,
                            results[mode].loss,
                            records,
                            len(shapes),
                            int(shapes.seq_len.sum()),
                            predicted_step_time_s=(
                                audits[mode].step_time_s if mode in audits else math.nan
                            ),
                            schedule_ratio=schedules[mode].ratio,
                            grad_norm=grad_norm,
                            plan_model_step_time_s=planned if mode == "dflop" else math.nan,
                        )
                        metrics.append(row)
                        recent[mode].append((records, row.step_time_s))
                        learn = mode == "dflop" and step > self.start_step
                        if learn and not config.deterministic:
                            # Only dflop's run feeds the cost model and the latency fit:
                            # in compare mode the blind run overlaps its modules less, and
                            # on shared CPU cores (memory bandwidth) its microbatches run
                            # faster than dflop's. A run's first step is left out: it pays
                            # one-time costs (first kernels, allocations, connections).
                            # A deterministic run keeps its model: no timing in schedules.
                            self._observe(records, schedules[mode], plans[mode], shapes)
                            self._calibrate_latency(records, schedules[mode], audits[mode], shapes)
                        self._log(row, bar)
                    if bar is not None:
                        bar.update(1)
                saved = bool(config.checkpoint_dir) and (
                    step == config.steps - 1
                    or (config.checkpoint_every and (step + 1) % config.checkpoint_every == 0)
                )
                if saved:
                    self.save_checkpoint(step)
                if step < config.steps - 1 and self._stop_agreed():
                    # A SIGTERM reached some rank: every rank stops after this same step.
                    if config.checkpoint_dir and not saved:
                        self.save_checkpoint(step)
                    self.stopped_after_step = step
                    break
            if self._profiling():
                self._finish_profiler(profiler)
                profiler = None
            if config.save_hf:
                self.save_hf_checkpoint(config.save_hf)
            if self.scheduler is not None:
                num_fallbacks_before = self.scheduler.num_fallbacks
        finally:
            if profiler is not None:  # a step failed while profiling: stop it
                profiler.stop()
            if bar is not None:
                bar.close()
            if self.scheduler is not None:
                self.scheduler.close()
        if not self.is_leader:
            return None
        return TrainReport(
            config=config.to_dict(),
            layout=self.layout.to_dict(),
            metrics=metrics,
            timelines={mode: _lay_out(recent[mode]) for mode in config.modes},
            start_step=self.start_step,
            performance_model=(
                self.cost_model.performance_model.to_dict() if self.cost_model else None
            ),
            stats={
                "stopped_after_step": self.stopped_after_step,
                "schedule_fallbacks": num_fallbacks_before,
                # Records whose images did not decode, and the batch samples redrawn.
                "bad_records": sorted(self.step_shapes.bad_records.values()),
                "samples_replaced": self.samples_replaced,
                # The calibration of the step model (dflop plan --local uses it).
                "link_latency_s": self.final_link_latency_s(),
                "forward_fraction": dict(self._forward_fraction),
                # With profile_trace: (trace file, TransferOverlap fields) per profiled rank.
                "transfer_overlap": self.transfer_overlaps,
                # With memory_report: per rank, its stage's measured and predicted peak.
                "memory": self.memory_report,
            },
        )

    def _profiling(self) -> bool:
        """Whether the last ``trace_steps`` steps run under a torch.profiler (a trace, or
        memory measured; on a GPU the allocator's peak needs no profiler)."""
        config = self.config
        return bool(config.profile_trace) or (config.memory_report and self.device.type != "cuda")

    def _start_profiler(self) -> Any:
        """A torch.profiler over the coming steps, started before a barrier that every
        rank then passes. In a thread world only rank 0 runs one: it sees the whole
        process's GPU work (but only rank 0's thread's CPU ops), and marks the world's
        communication stream in it. With ``memory_report`` it records allocations (on a
        GPU the peak comes from the allocator, reset here)."""
        import torch

        from dflop.runtime import comm as dist
        from dflop.runtime.thread_world import current as current_world
        from dflop.train.gpu_trace import mark_transfer_stream

        profiler = None
        if self.is_leader or dist.get_backend() != dist.THREADS:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            memory = self.config.memory_report and self.device.type != "cuda"
            if memory:  # the profiler counts from here: what is held before, once
                from dflop.profiling.memory import live_tensor_bytes

                self._memory_start_bytes = live_tensor_bytes()
            profiler = torch.profiler.profile(activities=activities, profile_memory=memory)
            profiler.start()
            world = current_world()
            if world is not None and world[0].comm_stream is not None:
                mark_transfer_stream(world[0].comm_stream)  # NCCL's streams need none
        dist.barrier()  # started before any rank goes on
        return profiler

    def _finish_profiler(self, profiler: Any) -> None:
        """Stop the profiler, write its trace and measure the transfer overlap in it; the
        leader prints every trace's numbers and keeps them for the report."""
        import torch

        from dflop.runtime import comm as dist
        from dflop.train.gpu_trace import TransferOverlap, transfer_overlap

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier()  # every rank's (thread's) profiled work is done
        trace_path = None
        if profiler is not None:
            profiler.stop()
            if self.config.profile_trace:  # a profiler exports once: the memory report reads it
                trace_path = self.config.profile_trace
                if dist.get_backend() != dist.THREADS and self.world_size > 1:
                    root, ext = os.path.splitext(trace_path)
                    trace_path = f"{root}.rank{self.rank}{ext or '.json'}"
                os.makedirs(os.path.dirname(os.path.abspath(trace_path)), exist_ok=True)
                profiler.export_chrome_trace(trace_path)
        if self.config.memory_report:
            self._report_memory(profiler, trace_path)
        if not self.config.profile_trace:
            return
        found = None
        if trace_path is not None:
            found = (trace_path, dataclasses.asdict(transfer_overlap(trace_path)))
        gathered: list[Any] | None = [None] * self.world_size if self.is_leader else None
        dist.gather_object(found, gathered, dst=0)
        if self.is_leader:
            self.transfer_overlaps = [g for g in gathered if g is not None]
            for path, numbers in self.transfer_overlaps:
                print(f"profile {path}: {TransferOverlap(**numbers).describe()}", flush=True)

    def _report_memory(self, profiler: Any, trace_path: str | None) -> None:
        """Every rank's peak memory over the measured steps (CPU: the profiler's record of
        the allocator, from its exported trace at ``trace_path`` if there is one; GPU: the
        allocator's peak), gathered on the leader beside what the memory model predicts for
        each rank's stage on those very steps and schedules."""
        import torch

        from dflop.profiling.memory import profiled_peak
        from dflop.runtime import comm as dist

        threads = dist.get_backend() == dist.THREADS
        if threads and not self.is_leader:  # one process, one allocator: rank 0 reads it
            measured: float | None = None
        elif self.device.type == "cuda":
            measured = float(torch.cuda.max_memory_allocated(self.device))
        else:
            measured = (
                float(self._memory_start_bytes + profiled_peak(profiler, trace_path))
                if profiler is not None
                else None
            )
        found = (self.rank, self.info.global_stage, measured)
        gathered: list[Any] | None = [None] * self.world_size if self.is_leader else None
        dist.gather_object(found, gathered, dst=0)
        if not self.is_leader:
            return
        cost_model = self._plan_cost_model or self._memory_cost_model()
        predicted: list[float] = []
        for shapes, assignments in self._memory_steps:
            for assignment in assignments:
                stages = self.predictor.stage_memory_bytes(cost_model, shapes, assignment)
                predicted = [max(a, b) for a, b in zip(predicted, stages)] or list(stages)
        lines = ["memory, peak per rank over the last steps: measured | the memory model's"]
        for rank, stage, peak in gathered:
            if peak is None:  # a thread world: one process, measured on rank 0
                continue
            # A thread world's one process holds every rank's stage.
            model = sum(predicted[g[1]] for g in gathered) if threads else predicted[stage]
            what = "all ranks (one process)" if threads else f"rank {rank} (stage {stage})"
            self.memory_report.append(
                {"rank": rank, "stage": stage, "measured_bytes": peak, "predicted_bytes": model}
            )
            lines.append(
                f"  {what}: {peak / 1e9:.3f} GB | {model / 1e9:.3f} GB "
                f"({(model - peak) / peak:+.1%})"
            )
        print("\n".join(lines), flush=True)

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

        from dflop.runtime import comm as dist
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

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop (SIGTERM): one all-reduce of a flag."""
        import torch

        from dflop.runtime import comm as dist
        from dflop.runtime.launch import StopRequested

        flag = torch.tensor([int(StopRequested.requested())], device=self._comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def save_checkpoint(self, step: int) -> None:
        """Save every rank's stage and optimizer after ``step`` (call on every rank)."""
        from dflop.runtime import comm as dist
        from dflop.train.checkpoint import save_checkpoint
        from dflop.train.resume import run_settings

        state = {
            "stage": self.stage.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self._checkpoint_identity(),
        }
        save_checkpoint(
            self.config.checkpoint_dir,
            step,
            self.rank,
            state,
            barrier=dist.barrier,
            world_size=self.world_size,
            settings=run_settings(self.config, self.layout),
        )

    def save_hf_checkpoint(self, folder: str) -> None:
        """Write the model as a Hugging Face checkpoint folder (call on every rank): each
        stage's first replica writes its own safetensors file (its TP ranks gather the
        shards first), rank 0 the rest (untrained tensors, the index, ``config.json``)."""
        from dflop.runtime import comm as dist
        from dflop.runtime.pipeline import StageChunks
        from dflop.runtime.tensor_parallel import full_tensor

        info = self.info
        weight_map: dict[str, str] = {}
        if info.dp_rank == 0:  # every TP rank gathers the shards (a collective), one writes
            stage = self.stage
            own = stage.model_state_dict() if isinstance(stage, StageChunks) else stage.state_dict()
            state = {k: full_tensor(v) for k, v in own.items()}
            if info.tp_rank == 0:
                name = f"model-{info.module}-stage{info.global_stage:03d}.safetensors"
                weight_map = self.spec.save_shard(folder, name, state)
        gathered: list[Any] | None = [None] * self.world_size if self.is_leader else None
        dist.gather_object(weight_map, gathered, dst=0)
        if self.is_leader:
            merged = {key: name for part in gathered for key, name in part.items()}
            self.spec.finish_checkpoint(folder, merged, seed=self.config.seed)
            print(f"saved the model in the Hugging Face layout to {folder}", flush=True)
        dist.barrier()

    # ------------------------------------------------------------------ rank 0 bookkeeping

    def _observe(self, records: list[RankRecord], s: Schedule, plan: Any, shapes: Any) -> None:
        """Feed measured times to the cost model: per microbatch, every encoder replica's
        time for the units of its pieces, and every LLM replica's for its bin."""
        encoder_s, llm_s, fraction = measured_microbatch_times(
            records, s.num_microbatches, self.layout.encoder.dp, s.dp_size
        )
        for module, value in fraction.items():  # smoothed forward share, for predictions
            self._forward_fraction[module] = 0.8 * self._forward_fraction[module] + 0.2 * value
        if self.cost_model is None or not self.config.adaptive:
            return
        rows, times = [], []
        for j, mb in enumerate(plan.microbatches):
            for e, share in enumerate(mb.encoder):
                if share.units:
                    rows.append(_pieces_as_shapes(shapes, share))
                    times.append((encoder_s[j, e], math.nan))
            for r in range(s.dp_size):
                rows.append(shapes.take(s.microbatches(r)[j]))
                times.append((math.nan, llm_s[j, r]))
        self.cost_model.observe(rows, np.array(times))

    def _progress_bar(self) -> Any:
        if not (self.is_leader and self.config.progress and sys.stdout.isatty()):
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(
            total=self.config.steps, initial=self.start_step, unit="step", dynamic_ncols=True
        )

    def _log(self, row: StepMetrics, bar: Any) -> None:
        every = self.config.log_every
        if not every or ((row.step + 1) % every and row.step != self.config.steps - 1):
            return
        line = format_step(row, self.config.steps)
        if bar is not None:
            bar.write(line)
        else:
            print(line, flush=True)


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


def _pieces_as_shapes(shapes: Any, share: Any) -> Any:
    """An encoder replica's pieces as samples of their own units (what it computed)."""
    from dataclasses import replace

    part = shapes.take(share.sample_ids)
    units = np.asarray(share.num_units, dtype=part.encoder_units.dtype)
    return replace(part, encoder_units=units, llm_visual_tokens=units * part.tokens_per_unit)


def _lay_out(steps: collections.deque) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    offset_s = 0.0
    for records, step_time_s in steps:
        events.extend(timeline_records(records, offset_s))
        offset_s += step_time_s
    return events


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


def _fault_step(rank: int) -> int | None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    try:
        fault_rank, fault_step = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={spec!r} must be RANK:STEP") from None
    return fault_step if fault_rank == rank else None


def fit_link_latency(audits: list[Any], measured_s: float) -> float:
    """The per-transfer latency at which the mean simulated step of ``audits`` (the step
    model of each step, :class:`~dflop.planner.StepAudit`) equals ``measured_s``; 0 if the
    action times alone already reach it. Bisection: the simulated step grows with it."""

    def simulated(latency_s: float) -> float:
        return float(
            np.mean(
                [
                    a.simulate(link_latency_s=latency_s, record_events=False).step_time_s
                    for a in audits
                ]
            )
        )

    low, high = 0.0, measured_s
    if simulated(low) >= measured_s:
        return 0.0
    for _ in range(20):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if simulated(mid) < measured_s else (low, mid)
    return 0.5 * (low + high)
