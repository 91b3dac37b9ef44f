"""Transfer/compute overlap read from a profiler trace (dflop.train.gpu_trace)."""

from __future__ import annotations

import json

import pytest
from dflop.train.gpu_trace import transfer_overlap


def _event(cat: str, name: str, start_us: float, dur_us: float, stream: int) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": start_us, "dur": dur_us, "tid": stream}


def test_overlap_of_transfers_with_other_streams_compute(tmp_path):
    events = [
        # stream 7: rank A computes 0-100 us and 150-200 us; stream 9: rank B 50-120 us.
        _event("kernel", "gemm", 0, 100, 7),
        _event("kernel", "gemm", 150, 50, 7),
        _event("kernel", "softmax", 50, 70, 9),
        # Compute streams copy too (a clone): local copies, neither transfers nor compute.
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 10, 5, 7),
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 60, 5, 9),
        # The thread world's comm stream 11, marked when the profiler started: a copy
        # 90-140 us (overlaps compute 90-120 us: 30 of 50 us) and a peer copy 400-410 us
        # (nothing runs then); NCCL's stream 12 (needs no marker): a kernel 300-310 us.
        _event("kernel", "void at::cuda::(anonymous namespace)::spin_kernel(long)", 1, 1, 11),
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 90, 50, 11),
        _event("kernel", "ncclDevKernel_SendRecv", 300, 10, 12),
        _event("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 400, 10, 11),
        # Communication work, not compute: a reduction on a stream that carries the
        # transfers, and dflop's pack kernel on a communicator's stream.
        _event("kernel", "void at::native::vectorized_elementwise_kernel<add>", 95, 5, 11),
        _event("kernel", "void dflop::cuda::copy_rows<uint4, false>(...)", 125, 10, 15),
        # An input upload: counted apart, not a message.
        _event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 0, 40, 13),
        # CPU events and instant events are ignored.
        _event("cpu_op", "aten::mm", 0, 500, 1),
        {"ph": "i", "name": "marker", "ts": 5},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    found = transfer_overlap(path)
    assert found.transfer_s == pytest.approx(70e-6)
    assert found.overlapped_s == pytest.approx(30e-6)
    assert found.overlap_fraction == pytest.approx(30 / 70)
    assert found.compute_s == pytest.approx(170e-6)  # 0-120 and 150-200 us
    assert found.concurrent_compute_s == pytest.approx(50e-6)  # 50-100 us
    assert found.host_copy_s == pytest.approx(40e-6)
    assert (found.num_transfers, found.num_kernels, found.compute_streams) == (3, 3, 2)
    # Without the marker stream 11 is a compute stream: its reduction is compute, its
    # copies local ones; only NCCL's kernel remains a transfer.
    unmarked = transfer_overlap({"traceEvents": [e for e in events if e is not events[5]]})
    assert (unmarked.num_transfers, unmarked.num_kernels) == (1, 4)
    assert "43% of it overlapped with compute" in found.describe()


def test_a_transfer_on_a_compute_stream_does_not_overlap_itself():
    events = [
        _event("kernel", "gemm", 0, 100, 7),
        _event("kernel", "ncclDevKernel_AllReduce", 20, 10, 7),
    ]
    found = transfer_overlap({"traceEvents": events})
    assert found.overlapped_s == 0.0 and found.transfer_s == pytest.approx(10e-6)
    assert transfer_overlap({"traceEvents": []}).describe() == (
        "the trace holds no GPU work (a CPU run)"
    )
