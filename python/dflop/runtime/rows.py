"""Row packing for the bridge: gather the rows bound for a peer into one contiguous buffer
(pack), put received rows in place (unpack), for features forward and gradients back.

On CUDA tensors, with the CUDA extension ``dflop._cuda`` (built when the install found a
CUDA compiler), each call is one kernel enqueued on a CUDA stream (default: the current
one) that nothing on the host waits for; rows are opaque bytes, so every dtype (bf16, fp16,
fp32) and any row width works. Elsewhere (CPU tensors, or no extension) torch's
``index_select`` / ``index_copy_`` do the same. Indices are checked on the host first (a
device kernel could report a bad index only by faulting): a value out of range, or a
destination written twice, raises ``ValueError`` naming the position and value.
"""

from __future__ import annotations

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


def cuda_kernels_available() -> bool:
    """Whether CUDA tensors go through dflop's kernels (the extension is built and sees a
    device)."""
    return _cuda is not None and _cuda.device_count() > 0


def gather_rows(
    src: Tensor, index: Any, out: Tensor | None = None, *, stream: Any = None
) -> Tensor:
    """``out[r] = src[index[r]]``: pack the rows ``index`` names (dim 0) into ``out``
    (allocated when None: ``(len(index), *src.shape[1:])``). ``index``: host integers (a
    numpy array, list or CPU tensor). ``stream``: the CUDA stream to run on (default: the
    current one)."""
    idx = _host_index(index)
    _check_tensor("src", src)
    _core.check_row_index(idx, int(src.shape[0]), unique=False, name="index")
    if out is None:
        out = torch.empty((idx.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
    _check_rows("out", out, src, idx.shape[0])
    if _use_kernels(src):
        _launch(_cuda.gather_rows, src, idx, out, stream)
    elif idx.shape[0]:
        torch.index_select(src, 0, torch.from_numpy(idx).to(src.device), out=out)
    return out


def scatter_rows(src: Tensor, index: Any, out: Tensor, *, stream: Any = None) -> Tensor:
    """``out[index[r]] = src[r]`` in place: unpack received rows to the places ``index``
    names (each at most once); rows of ``out`` it does not name are left as they are."""
    idx = _host_index(index)
    _check_tensor("src", src)
    _check_tensor("out", out)
    _core.check_row_index(idx, int(out.shape[0]), unique=True, name="index")
    if src.shape[0] != idx.shape[0]:
        raise ValueError(f"src has {src.shape[0]} rows, index {idx.shape[0]} entries")
    _check_rows("src", src, out, int(src.shape[0]))
    if _use_kernels(src):
        _launch(_cuda.scatter_rows, src, idx, out, stream)
    elif idx.shape[0]:
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
    return np.ascontiguousarray(array, dtype=np.int64)


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


def _use_kernels(tensor: Tensor) -> bool:
    return tensor.device.type == "cuda" and _cuda is not None


def _launch(kernel: Any, src: Tensor, idx: np.ndarray, out: Tensor, stream: Any) -> None:
    if not idx.shape[0] or not src[0].numel():
        return
    run_on = stream if stream is not None else torch.cuda.current_stream(src.device)
    # Pinned, so that the upload is asynchronous; torch's host allocator keeps the pinned
    # block until the copy is done.
    with torch.cuda.stream(run_on):
        device_index = torch.from_numpy(idx).pin_memory().to(src.device, non_blocking=True)
    if run_on != torch.cuda.current_stream(src.device):
        # Made on the current stream, used on another: keep them until that work is done.
        src.record_stream(run_on)
        out.record_stream(run_on)
    row_bytes = src[0].numel() * src.element_size()
    kernel(src.data_ptr(), device_index.data_ptr(), idx.shape[0], out.data_ptr(), row_bytes,
           run_on.cuda_stream)  # fmt: skip
