"""Peak memory as torch measures it: the CUDA allocator's peak on a GPU, the profiler's
record of every CPU allocation on a CPU.

On a GPU ``torch.cuda.max_memory_allocated`` is the peak. A CPU has no such counter, so
:func:`measure_peak_bytes` runs the work under ``torch.profiler`` with
``profile_memory=True``: the profiler records every allocation and free of torch's CPU
allocator while it runs, with the running total of what it saw allocated, whose largest
value is the peak above the start (:func:`profiled_peak`); what was allocated before (the
weights, the optimizer's states) is the bytes of the live tensors when it starts
(:func:`live_tensor_bytes`: every tensor the interpreter holds, each storage once). The sum
is what tensors held at the peak: not the interpreter, not the allocator's free lists.
This is what dflop's memory model is checked against (``dflop train --memory-report``,
``benchmarks/bench_memory.py``).
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from typing import Any, Callable

__all__ = ["MemoryPeak", "live_tensor_bytes", "measure_peak_bytes", "profiled_peak"]


class MemoryPeak:
    """What :func:`measure_peak_bytes` found: ``peak_bytes`` (allocated at the peak),
    ``start_bytes`` (allocated when the work began, the weights among them), and the
    work's result."""

    def __init__(self, peak_bytes: int, start_bytes: int, result: Any) -> None:
        self.peak_bytes = int(peak_bytes)
        self.start_bytes = int(start_bytes)
        self.result = result

    @property
    def added_bytes(self) -> int:
        """The peak above what was allocated when the work began."""
        return self.peak_bytes - self.start_bytes


def measure_peak_bytes(fn: Callable[[], Any], device: Any = "cpu") -> MemoryPeak:
    """Run ``fn()`` and return the peak of the bytes torch held meanwhile (see the module
    docstring) with ``fn``'s result."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return MemoryPeak(torch.cuda.max_memory_allocated(device), start, result)
    from torch.profiler import ProfilerActivity, profile

    start = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return MemoryPeak(start + profiled_peak(prof), start, result)


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of the storages of every tensor the interpreter holds on ``device_type``
    (each storage once; a parameter's gradient and an optimizer's states included)."""
    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            # type(), not isinstance: no __class__ lookup on the interpreter's other objects
            if not issubclass(type(obj), torch.Tensor) or obj.device.type != device_type:
                continue
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError, ReferenceError):
            continue  # meta, sparse and other tensors without a plain storage
    seen.pop(0, None)  # empty tensors
    return int(sum(seen.values()))


def profiled_peak(prof: Any, trace_path: str | None = None) -> int:
    """The most bytes a finished ``torch.profiler.profile`` run (``profile_memory=True``)
    saw allocated above what was allocated when it started (0 without any record).
    ``trace_path``: the run's trace, already exported there (a profiler exports once)."""
    if trace_path is not None:
        return _trace_peak(trace_path)
    fd, path = tempfile.mkstemp(suffix=".json", prefix="dflop-memory-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return _trace_peak(path)
    finally:
        os.unlink(path)


def _trace_peak(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        events = json.load(f).get("traceEvents", [])
    totals = [
        int(e["args"]["Total Allocated"])
        for e in events
        if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})
    ]
    return max([0, *totals])
