"""How much of a run's GPU transfers overlapped compute, read from a torch.profiler trace
(Chrome JSON, ``TrainConfig.profile_trace``).

GPU events of the trace are intervals on streams (``tid``). Transfer streams are the
streams that run NCCL kernels (processes on GPUs) and the thread world's communication
stream, which the trainer marks when the profiler starts (:func:`mark_transfer_stream`:
one tiny ``spin_kernel`` there). Transfers are the NCCL kernels and the device-to-device
and peer copies on transfer streams (the thread world's stage-to-stage and bridge
messages); every other kernel on a transfer stream (the thread world's reductions) is
communication work, not compute. Compute is every kernel on the other streams except the
bridge's pack / unpack kernel (dflop's ``copy_rows``). Device copies on compute streams
are local copies (a clone), neither. A transfer's time counts as overlapped where a
compute kernel of another stream ran at the same moment. Host copies (inputs) are
counted apart. Names and fields as Kineto writes them (``cat`` "kernel" / "gpu_memcpy",
"Memcpy DtoD ..." / "Memcpy PtoP ...").
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TransferOverlap", "mark_transfer_stream", "transfer_overlap"]

MARKER_KERNEL = "spin_kernel"
"""The kernel of ``torch.cuda._sleep``: what :func:`mark_transfer_stream` enqueues."""


@dataclass(frozen=True)
class TransferOverlap:
    """Seconds of GPU time by kind, from one trace."""

    transfer_s: float
    """Union of the transfers' intervals."""
    overlapped_s: float
    """Of ``transfer_s``: while a compute kernel of another stream ran."""
    compute_s: float
    """Union of the compute kernels' intervals."""
    concurrent_compute_s: float
    """Of ``compute_s``: while compute kernels of two or more streams ran (stages
    computing at once on one GPU)."""
    host_copy_s: float
    """Union of host-to-device / device-to-host copies (inputs, not messages)."""
    num_transfers: int
    num_kernels: int
    compute_streams: int

    @property
    def overlap_fraction(self) -> float:
        """``overlapped_s / transfer_s`` (0 without transfers)."""
        return self.overlapped_s / self.transfer_s if self.transfer_s > 0 else 0.0

    def describe(self) -> str:
        if self.num_kernels == 0 and self.num_transfers == 0:
            return "the trace holds no GPU work (a CPU run)"
        return (
            f"GPU transfers {self.transfer_s * 1e3:.2f} ms ({self.num_transfers} copies or "
            f"NCCL kernels), {100 * self.overlap_fraction:.0f}% of it overlapped with compute; "
            f"compute {self.compute_s * 1e3:.2f} ms on {self.compute_streams} stream(s), "
            f"{self.concurrent_compute_s * 1e3:.2f} ms of it on two or more streams at once; "
            f"host copies {self.host_copy_s * 1e3:.2f} ms"
        )


def transfer_overlap(trace: str | os.PathLike[str] | Mapping[str, Any]) -> TransferOverlap:
    """Read a Chrome trace (a path or its parsed JSON) and measure the overlap."""
    if not isinstance(trace, Mapping):
        with open(trace) as f:
            trace = json.load(f)
    intervals: dict[str, list[tuple[float, float, Any]]] = {
        kind: [] for kind in ("nccl", "device_copy", "kernel", "marker", "host")
    }
    for event in trace.get("traceEvents", []):
        if not isinstance(event, Mapping) or event.get("ph") != "X":
            continue
        kind = _kind(str(event.get("cat", "")).lower(), str(event.get("name", "")).lower())
        if kind is not None:
            start_s = float(event["ts"]) * 1e-6
            end_s = start_s + float(event.get("dur", 0.0)) * 1e-6
            intervals[kind].append((start_s, end_s, event.get("tid")))
    comm_streams = {t for kind in ("nccl", "marker") for _, _, t in intervals[kind]}
    transfers = intervals["nccl"] + [i for i in intervals["device_copy"] if i[2] in comm_streams]
    compute = [i for i in intervals["kernel"] if i[2] not in comm_streams]
    by_stream: dict[Any, list[tuple[float, float]]] = {}
    for start, end, stream in compute:
        by_stream.setdefault(stream, []).append((start, end))
    overlapped = 0.0
    for stream in comm_streams:  # per transfer stream: its transfers x others' compute
        mine = _union((s, e) for s, e, t in transfers if t == stream)
        others = _union(iv for t, ivs in by_stream.items() if t != stream for iv in ivs)
        overlapped += _length(_intersect(mine, others))
    return TransferOverlap(
        transfer_s=_length(_union((s, e) for s, e, _ in transfers)),
        overlapped_s=overlapped,
        compute_s=_length(_union((s, e) for s, e, _ in compute)),
        concurrent_compute_s=_length(_at_least_two([_union(v) for v in by_stream.values()])),
        host_copy_s=_length(_union((s, e) for s, e, _ in intervals["host"])),
        num_transfers=len(transfers),
        num_kernels=len(compute),
        compute_streams=len(by_stream),
    )


def _kind(category: str, name: str) -> str | None:
    if category == "gpu_memcpy":
        return "device_copy" if "dtod" in name or "ptop" in name else "host"
    if category != "kernel":
        return None
    if "nccl" in name:
        return "nccl"
    if MARKER_KERNEL in name:
        return "marker"
    return None if "copy_rows" in name else "kernel"  # the bridge's pack: not compute


def mark_transfer_stream(stream: Any) -> None:
    """Enqueue the marker on ``stream`` (a ``torch.cuda.Stream``) while a profiler records,
    so that :func:`transfer_overlap` counts its copies as transfers."""
    import torch

    with torch.cuda.stream(stream):
        torch.cuda._sleep(1)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(
    a: list[tuple[float, float]], b: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """Intersection of two merged, sorted interval lists (one sweep)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(merged: Iterable[tuple[float, float]]) -> float:
    return sum(e - s for s, e in merged)


def _at_least_two(unions: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Where at least two of the (each already merged) interval lists are active."""
    points = sorted(
        (t, delta) for merged in unions for s, e in merged for t, delta in ((s, 1), (e, -1))
    )
    out: list[tuple[float, float]] = []
    active, since = 0, 0.0
    for t, delta in points:
        if active >= 2 and t > since:
            out.append((since, t))
        active += delta
        since = t
    return _union(out)
