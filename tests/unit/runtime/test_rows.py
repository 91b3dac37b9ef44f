"""dflop.runtime.rows: the bridge's pack (gather) and unpack (scatter) equal torch's
index_select / index_copy_ for every dtype and row width, and bad indices are named
before any device work. The CUDA kernels' tests run where a GPU is (marker ``gpu``;
scripts/gpu_check.sh), the rest everywhere."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dflop.errors import InputTypeError  # noqa: E402
from dflop.runtime import rows  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WIDTHS = [1, 3, 8, 13, 64, 1027]  # odd widths: 2-, 6-, 26-byte rows take narrow copies


def _case(rng, device, dtype, width, rows_in=37, rows_out=23):
    src = torch.from_numpy(rng.standard_normal((rows_in, width))).to(dtype).to(device)
    gather = rng.integers(0, rows_in, rows_out)  # a plan may send a row to several peers
    scatter = rng.permutation(rows_in)[:rows_out]  # each destination once
    return src, gather, scatter


def _check_equal_to_torch(device):
    rng = np.random.default_rng(0)
    for dtype in DTYPES:
        for width in WIDTHS:
            src, gather, scatter = _case(rng, device, dtype, width)
            index = torch.from_numpy(gather).to(device)
            assert torch.equal(rows.gather_rows(src, gather), src.index_select(0, index))
            part = src[: len(scatter)].contiguous()
            out = torch.zeros_like(src)
            want = torch.zeros_like(src).index_copy_(0, torch.from_numpy(scatter).to(device), part)
            assert torch.equal(rows.scatter_rows(part, scatter, out), want)
            # 3-D rows (a row is [tokens, hidden]) and an offset, misaligned view
            cube = src.reshape(src.shape[0], 1, width)
            assert torch.equal(rows.gather_rows(cube, gather), cube.index_select(0, index))
            shifted = src.reshape(-1)[1 : 1 + 5 * width].reshape(5, width)
            assert torch.equal(rows.gather_rows(shifted, [4, 0, 2]), shifted[[4, 0, 2]])


def test_pack_and_unpack_equal_torch_on_cpu():
    _check_equal_to_torch("cpu")


def test_bad_indices_and_tensors_are_named():
    src = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"index\[2\] = 4 is out of range \[0, 4\)"):
        rows.gather_rows(src, [0, 1, 4])
    with pytest.raises(ValueError, match=r"index\[1\] = -1 is out of range"):
        rows.gather_rows(src, np.array([0, -1]))
    with pytest.raises(ValueError, match=r"index\[2\] = 1 repeats index\[0\]"):
        rows.scatter_rows(torch.zeros(3, 2), [1, 0, 1], torch.zeros(4, 2))
    with pytest.raises(InputTypeError, match="1-D integer array"):
        rows.gather_rows(src, [0.5])
    with pytest.raises(ValueError, match="src must be contiguous"):
        rows.gather_rows(src.t(), [0])
    with pytest.raises(ValueError, match="out has shape"):
        rows.gather_rows(src, [0, 1], out=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="out is torch.float16"):
        rows.gather_rows(src, [0], out=torch.zeros(1, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="src has 2 rows, index 1 entries"):
        rows.scatter_rows(torch.zeros(2, 2), [0], torch.zeros(4, 2))
    assert rows.gather_rows(src, []).shape == (0, 2)
    # The kernels read src while other blocks write out: shared memory would race.
    with pytest.raises(ValueError, match="src and out overlap in memory"):
        rows.gather_rows(src, [3, 2, 1, 0], out=src)
    with pytest.raises(ValueError, match="src and out overlap in memory"):
        rows.scatter_rows(src[:2], [3, 2], src)


def test_the_cuda_extension_imports_without_a_gpu():
    """Built with a CUDA compiler, dflop._cuda needs no CUDA runtime library at import and
    reports no device where there is none (CPU tensors take torch's path regardless)."""
    cuda = pytest.importorskip("dflop._cuda", reason="built without a CUDA compiler")
    assert cuda.device_count() == torch.cuda.device_count()
    assert rows.cuda_kernels_available() == (torch.cuda.device_count() > 0)
    with pytest.raises(RuntimeError, match="gather_rows: null device pointer"):
        cuda.gather_rows(0, 0, 1, 0, 4, 0)


gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and rows.cuda_kernels_available()),
    reason="needs a CUDA GPU and dflop._cuda",
)


@gpu
@pytest.mark.gpu
def test_kernels_equal_torch_on_the_gpu():
    _check_equal_to_torch("cuda")
    assert not rows._UNUSABLE_DEVICES  # dflop's kernels ran: no launch fell back to torch


@gpu
@pytest.mark.gpu
def test_kernels_are_ordered_on_a_side_stream():
    """Enqueued on another stream after an event, the pack sees what the compute stream
    wrote, and the compute stream sees the pack after waiting on the side stream."""
    rng = np.random.default_rng(1)
    side = torch.cuda.Stream()
    for _ in range(5):
        host = torch.from_numpy(rng.standard_normal((4096, 256)).astype(np.float32))
        src = host.cuda()
        torch.cuda._sleep(50_000_000)  # the compute stream's write lands well after...
        src.mul_(2.0)
        gather = rng.integers(0, 4096, 3000)
        ready = torch.cuda.Event()
        ready.record()
        side.wait_event(ready)
        with torch.cuda.stream(side):
            out = torch.empty(3000, 256, device="cuda")
        packed = rows.gather_rows(src, gather, out, stream=side)  # ...this is enqueued
        torch.cuda.current_stream().wait_stream(side)
        packed.add_(1.0)  # on the compute stream, after the pack
        assert torch.equal(packed.cpu(), 2.0 * host[torch.from_numpy(gather)] + 1.0)


@gpu
@pytest.mark.gpu
def test_a_side_stream_waits_for_the_current_one():
    """With stream= and no out, the pack runs after what the current stream queued before
    it (here: a long sleep, then the write of src) and allocates out on the side stream."""
    src = torch.zeros(4096, 256, device="cuda")
    torch.cuda._sleep(100_000_000)  # tens of ms of GPU time on the current stream
    src.fill_(3.0)
    side = torch.cuda.Stream()
    out = rows.gather_rows(src, np.arange(4096)[::-1].copy(), stream=side)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, torch.full_like(out, 3.0))
