"""``StepProfiler``: what the last ``trace_steps`` steps measure beyond their timeline.

- ``profile_trace``: a torch.profiler trace (Chrome JSON, CPU and CUDA) per rank, and how
  much of the GPU transfers overlapped compute in it;
- ``memory_report``: every rank's peak memory over those steps (CPU: the profiler's record
  of the allocator; GPU: the allocator's peak) beside what the memory model predicts for
  its stage on the very same steps and schedules.

Every method is called on every rank (they meet at barriers and gathers); rank 0 prints
and keeps the numbers.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import numpy as np

__all__ = ["StepProfiler"]


class StepProfiler:
    """The profiling window of one rank.

    Args:
        config: the run's settings.
        device: this rank's torch device.
        global_stage: this rank's stage (encoder stages first).
        llm_replica: this rank's LLM data-parallel replica (None on an encoder rank of its
            own): its memory is predicted on the samples of that replica's microbatches.
        start_step: the run's first step (the window starts at the last
            ``trace_steps`` steps, not before it).
        stage_memory: rank 0: ``(shapes, assignment, llm_replica) -> bytes per global
            stage`` by the memory model (what a plan is fitted with), the LLM's stages on the
            samples of ``llm_replica``'s microbatches (None: the largest replica's).
    """

    def __init__(
        self,
        config: Any,
        device: Any,
        global_stage: int,
        start_step: int,
        stage_memory: Callable[[Any, np.ndarray, int | None], list[float]] | None,
        llm_replica: int | None = None,
    ) -> None:
        from dflop.runtime import dist

        self.config = config
        self.device = device
        self.global_stage = global_stage
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.is_leader = self.rank == 0
        self.first_step = max(start_step, config.steps - config.trace_steps)
        self._stage_memory = stage_memory
        self.llm_replica = llm_replica
        self._profiler: Any = None
        self._memory_start_bytes = 0
        self._memory_steps: list[tuple[Any, list[np.ndarray]]] = []
        self.memory_report: list[dict[str, Any]] = []
        """Rank 0, with memory_report: per rank, its stage's measured and predicted peak."""
        self.transfer_overlaps: list[tuple[str, dict[str, Any]]] = []
        """Rank 0, with profile_trace: (trace file, TransferOverlap fields) per rank."""

    @property
    def enabled(self) -> bool:
        """Whether the window runs under a torch.profiler (a trace, or memory measured
        on a CPU; on a GPU the allocator's peak needs none)."""
        config = self.config
        return bool(config.profile_trace) or (config.memory_report and self.device.type != "cuda")

    def before_step(self, step: int) -> None:
        """At the window's first step, before anything of it runs: start the profiler."""
        if step == self.first_step and self.enabled:
            self._profiler = self._start()

    def record_schedules(self, step: int, shapes: Any, schedules: dict[str, Any]) -> None:
        """Rank 0: keep what the memory model needs of every step in the window."""
        if self.config.memory_report and self.is_leader and step >= self.first_step:
            assignments = [np.asarray(s.assignment) for s in schedules.values()]
            self._memory_steps.append((shapes, assignments))

    def finish(self) -> None:
        """After the last step: stop the profiler, write its trace, report."""
        if self.enabled:
            self._finish(self._profiler)
            self._profiler = None

    def close(self) -> None:
        """Stop a profiler a failed step left running."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None

    def _start(self) -> Any:
        """A torch.profiler over the coming steps, started before a barrier that every
        rank then passes. In a thread world only rank 0 runs one: it sees the whole
        process's GPU work (but only rank 0's thread's CPU ops), and marks the world's
        communication stream in it. With ``memory_report`` it records allocations (on a
        GPU the peak comes from the allocator, reset here)."""
        import torch

        from dflop.runtime import dist
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

    def _finish(self, profiler: Any) -> None:
        """Stop the profiler, write its trace and measure the transfer overlap in it; the
        leader prints every trace's numbers and keeps them for the report."""
        import torch

        from dflop.runtime import dist
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
        from dflop.runtime import dist

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
        found = (self.rank, self.global_stage, self.llm_replica, measured)
        gathered: list[Any] | None = [None] * self.world_size if self.is_leader else None
        dist.gather_object(found, gathered, dst=0)
        if not self.is_leader:
            return
        # Each rank's own prediction: its stage on its own replica's samples (a replica
        # with the lighter microbatches holds less than the stage's largest replica).
        predicted: dict[int | None, list[float]] = {}
        for replica in {g[2] for g in gathered}:
            peaks: list[float] = []
            for shapes, assignments in self._memory_steps:
                for assignment in assignments:
                    stages = self._stage_memory(shapes, assignment, replica)
                    peaks = [max(a, b) for a, b in zip(peaks, stages)] or list(stages)
            predicted[replica] = peaks
        lines = ["memory, peak per rank over the last steps: measured | the memory model's"]
        for rank, stage, replica, peak in gathered:
            if peak is None:  # a thread world: one process, measured on rank 0
                continue
            # A thread world's one process holds every rank's stage.
            model = (
                sum(predicted[g[2]][g[1]] for g in gathered)
                if threads
                else predicted[replica][stage]
            )
            what = "all ranks (one process)" if threads else f"rank {rank} (stage {stage})"
            self.memory_report.append(
                {"rank": rank, "stage": stage, "measured_bytes": peak, "predicted_bytes": model}
            )
            lines.append(
                f"  {what}: {peak / 1e9:.3f} GB | {model / 1e9:.3f} GB "
                f"({(model - peak) / peak:+.1%})"
            )
        print("\n".join(lines), flush=True)
