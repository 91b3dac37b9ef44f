"""Row packing for the bridge: gather the rows bound for a peer into one contiguous buffer
(pack), put received rows in place (unpack), for features forward and gradients back.

On CUDA tensors, with the CUDA extension ``dflop._cuda`` (built when the install found a
CUDA compiler), each call is one kernel enqueued on a CUDA stream (default: the current
one) that nothing on the host waits for; rows are opaque bytes, so every dtype (bf16, fp16,
fp32) and any row width works. Elsewhere (CPU tensors, or no extension) torch's
``index_select`` / ``index_copy_`` do the same, as does a GPU the kernels cannot run on
(no code built for it, an old driver: one warning). Indices are checked on the host
first (a device kernel could report a bad index only by faulting): a value out of range,
or a destination written twice, raises ``ValueError`` naming the position and value;
``src`` and ``out`` must not overlap.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dflop import _core
from dflop.errors import InputTypeError

__all__ = ["cuda_kernels_available", "gather_rows", "scatter_rows"]

try:
    from dflop import _cuda
except ImportError:  # built without a CUDA compiler
    _cuda = None


_UNUSABLE_DEVICES: set[int] = set()
"""CUDA devices where a kernel launch failed (a GPU the build has no code for, an old
driver): their calls take torch's path, with one warning."""


@functools.lru_cache(maxsize=1)
def cuda_kernels_available() -> bool:
    """Whether CUDA tensors go through dflop's kernels (the extension is built and sees a
    device)."""
    return _cuda is not None and _cuda.device_count() > 0


def gather_rows(
    src: Tensor, index: Any, out: Tensor | None = None, *, stream: Any = None
) -> Tensor:
    """``out[r] = src[index[r]]``: pack the rows ``index`` names (dim 0) into ``out``
    (allocated when None: ``(len(index), *src.shape[1:])``). ``index``: host integers (a
    numpy array, list or CPU tensor). ``stream``: a CUDA stream of ``src``'s device to run
    on (default: the current one); it first waits for the current stream (which made
    ``src``), and the caller orders its use of ``out`` after it."""
    idx = _host_index(index)
    _check_tensor("src", src)
    _core.check_row_index(idx, int(src.shape[0]), unique=False, name="index")
    with _running_on(src.device, stream):
        if out is None:
            out = torch.empty((idx.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
        _check_rows("out", out, src, idx.shape[0])
        _check_disjoint(src, out)
        _keep_until_done(src, out)
        if not _launched("gather_rows", src, idx, out):
            torch.index_select(src, 0, torch.from_numpy(idx).to(src.device), out=out)
    return out


def scatter_rows(src: Tensor, index: Any, out: Tensor, *, stream: Any = None) -> Tensor:
    """``out[index[r]] = src[r]`` in place: unpack received rows to the places ``index``
    names (each at most once); rows of ``out`` it does not name are left as they are.
    ``stream``: as for :func:`gather_rows`."""
    idx = _host_index(index)
    _check_tensor("src", src)
    _check_tensor("out", out)
    _core.check_row_index(idx, int(out.shape[0]), unique=True, name="index")
    if src.shape[0] != idx.shape[0]:
        raise ValueError(f"src has {src.shape[0]} rows, index {idx.shape[0]} entries")
    _check_rows("src", src, out, int(src.shape[0]))
    _check_disjoint(src, out)
    with _running_on(out.device, stream):
        _keep_until_done(src, out)
        if not _launched("scatter_rows", src, idx, out):
            out.index_copy_(0, torch.from_numpy(idx).to(out.device), src)
    return out


def _host_index(index: Any) -> np.ndarray:
    if isinstance(index, Tensor):
        if index.device.type != "cpu":
            raise InputTypeError(
                f"index must be on the host (numpy or a CPU tensor), got {index.device}"
            )
        index = index.numpy()
    array = np.asarray(index)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InputTypeError(f"index must be a 1-D integer array, got {array.dtype} {array.shape}")
    array = np.ascontiguousarray(array, dtype=np.int64)
    # torch.from_numpy warns on a read-only array (a plan's cached index is one).
    return array if array.flags.writeable else array.copy()


def _check_tensor(name: str, tensor: Any) -> None:
    if not isinstance(tensor, Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() < 1 or not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous with a row dim, got shape {tuple(tensor.shape)}"
        )


def _check_rows(name: str, tensor: Tensor, like: Tensor, rows: int) -> None:
    """``tensor`` has ``rows`` rows shaped like ``like``'s, with its dtype and device."""
    _check_tensor(name, tensor)
    if (tensor.dtype, tensor.device) != (like.dtype, like.device):
        raise ValueError(
            f"{name} is {tensor.dtype} on {tensor.device}, expected {like.dtype} on {like.device}"
        )
    if tuple(tensor.shape) != (rows, *like.shape[1:]):
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}, expected {(rows, *like.shape[1:])}"
        )


def _check_disjoint(src: Tensor, out: Tensor) -> None:
    """The kernels read src while other blocks write out: they must not share memory."""
    if src.device != out.device or not src.numel() or not out.numel():
        return
    a0, b0 = src.data_ptr(), out.data_ptr()
    a1, b1 = a0 + src.numel() * src.element_size(), b0 + out.numel() * out.element_size()
    if a0 < b1 and b0 < a1:
        raise ValueError("src and out overlap in memory; write into a separate tensor")


@contextlib.contextmanager
def _running_on(device: torch.device, stream: Any) -> Iterator[None]:
    """On CUDA: ``device`` current, ``stream`` (default: the current one) current, and a
    side stream ordered after the current stream's work."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        current = torch.cuda.current_stream(device)
        run_on = current if stream is None else stream
        if run_on.device != device:
            raise ValueError(f"stream is on {run_on.device}, the tensors on {device}")
        if run_on != current:
            run_on.wait_stream(current)
        with torch.cuda.stream(run_on):
            yield


def _keep_until_done(*tensors: Tensor) -> None:
    """CUDA tensors possibly made on another stream: the allocator keeps their memory until
    the current stream's work (the copy, dflop's kernel or torch's) is done."""
    if tensors[0].device.type == "cuda":
        stream = torch.cuda.current_stream(tensors[0].device)
        for tensor in tensors:
            tensor.record_stream(stream)


def _launched(name: str, src: Tensor, idx: np.ndarray, out: Tensor) -> bool:
    """Run dflop's kernel ``name`` on the current stream if it can; False: use torch's."""
    device = src.device
    if device.type != "cuda" or not cuda_kernels_available() or device.index in _UNUSABLE_DEVICES:
        return False
    if not idx.shape[0] or not src[0].numel():
        return True
    stream = torch.cuda.current_stream(device)
    # Pinned, so that the upload is asynchronous; torch's host allocator keeps the pinned
    # block until the copy is done. Allocated on this stream, as the kernel reads it here.
    device_index = torch.from_numpy(idx).pin_memory().to(device, non_blocking=True)
    row_bytes = src[0].numel() * src.element_size()
    try:
        getattr(_cuda, name)(
            src.data_ptr(), device_index.data_ptr(), idx.shape[0], out.data_ptr(), row_bytes,
            stream.cuda_stream,
        )  # fmt: skip
    except RuntimeError as error:  # launch refused: no code for this GPU, an old driver
        _UNUSABLE_DEVICES.add(device.index)
        warnings.warn(
            f"dflop._cuda cannot run on {device} ({error}); using torch's row copies there",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True
