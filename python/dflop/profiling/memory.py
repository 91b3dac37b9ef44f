"""Peak memory as torch measures it: the CUDA allocator's peak on a GPU, the profiler's
record of every CPU allocation on a CPU.

On a GPU ``torch.cuda.max_memory_allocated`` is the peak. A CPU has no such counter, so
:func:`measure_peak_bytes` runs the work under ``torch.profiler`` with
``profile_memory=True``: the profiler records every allocation and free of torch's CPU
allocator with the bytes allocated at that moment, and the largest of those is the peak
(what tensors held; not the Python interpreter, not fragmentation). This is what dflop's
memory model is checked against (``benchmarks/bench_memory.py``).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

__all__ = ["MemoryPeak", "measure_peak_bytes", "profiled_peak"]


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
    """Run ``fn()`` and return the peak of the bytes torch's allocator held meanwhile
    (see the module docstring) with ``fn``'s result."""
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

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    peak, start = profiled_peak(prof)
    return MemoryPeak(peak, start, result)


def profiled_peak(prof: Any) -> tuple[int, int]:
    """``(peak, start)`` allocated bytes of a finished ``torch.profiler.profile`` run with
    ``profile_memory=True`` (its trace's memory records; (0, 0) without any)."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="dflop-memory-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    records = sorted(
        (e for e in events if e.get("name") == "[memory]" and "Total Allocated" in e["args"]),
        key=lambda e: e.get("ts", 0),
    )
    if not records:
        return 0, 0
    records = [e["args"] for e in records]
    first = records[0]
    start = int(first["Total Allocated"]) - int(first.get("Bytes", 0))
    return max(int(r["Total Allocated"]) for r in records), start
