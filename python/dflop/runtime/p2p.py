"""Point-to-point messages between ranks: what the pipeline engine (stage to stage) and
the bridge communicator (encoder replicas to LLM replicas) share.

- :func:`message_tag`: one tag per (microbatch, receiving chunk, direction, header or
  payload). gloo
  matches a receive to the send of the same peer and tag, so messages of different
  microbatches or directions can be in flight between two ranks in any order (NCCL
  ignores tags and matches per peer in issue order, which both users respect).
- :func:`debug_header` / :func:`header_mismatch`: in debug mode a small int64 header
  precedes every payload: ``[magic, microbatch, direction, dtype code, ndim, dims...]``.
  The receiver compares it with the shape its own plan gives before it posts the payload
  receive (gloo aborts the process on a payload longer than the posted buffer), and a
  mismatch becomes an error naming both ranks instead of a hang or a crash.
- :func:`collective_device`: where a group's message buffers live (the current CUDA
  device under NCCL, else the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dflop.runtime import dist
from dflop.runtime.thread_world import current

__all__ = [
    "FORWARD",
    "BACKWARD",
    "HEADER_LEN",
    "collective_device",
    "debug_header",
    "header_mismatch",
    "header_payload_bytes",
    "message_tag",
]

FORWARD = 0
"""Direction of activations / features (towards the loss)."""
BACKWARD = 1
"""Direction of gradients."""

_MAGIC = 0x0DF1_0F12  # tells a debug header from stray data
_MAX_DIMS = 4
HEADER_LEN = 5 + _MAX_DIMS
"""Length of a debug header (int64)."""
_FIELDS = ("magic", "microbatch", "direction", "dtype", "ndim")
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def message_tag(
    microbatch: int, direction: int, header: bool = False, *, chunk: int = 0, num_chunks: int = 1
) -> int:
    """The tag of the payload (or debug header) of ``microbatch`` in ``direction``, to the
    receiving model chunk ``chunk`` of ``num_chunks`` (interleaved stages exchange several
    chunks' messages of one microbatch between the same two ranks)."""
    slot = int(microbatch) * int(num_chunks) + int(chunk)
    return (2 * slot + int(direction)) * 2 + int(header)


def collective_device(group: Any = None) -> torch.device:
    """Where message and collective buffers of ``group`` live: the current CUDA device
    under NCCL, the world's device in a thread world, the CPU otherwise (gloo)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == dist.THREADS:
        return current()[0].device
    return torch.device("cpu")


def debug_header(
    microbatch: int,
    direction: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The debug header announcing a payload of ``shape`` and ``dtype``."""
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"a debug header holds at most {_MAX_DIMS} dims, got shape {shape}")
    dims = [int(d) for d in shape] + [-1] * (_MAX_DIMS - len(shape))
    values = [_MAGIC, int(microbatch), int(direction), _DTYPE_CODES.get(dtype, 0), len(shape)]
    return torch.tensor(values + dims, dtype=torch.int64, device=device)


def _shape(values: list[int]) -> tuple[int, ...] | None:
    ndim = values[4]
    return tuple(values[5 : 5 + ndim]) if 0 <= ndim <= _MAX_DIMS else None


def header_mismatch(received: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None if the received header equals the expected one, else what differs
    (``"shape: sent (4, 8), expected (2, 8)"``)."""
    got, want = received.tolist(), expected.tolist()
    if got == want:
        return None
    diffs = [
        f"{name}: sent {g}, expected {w}"
        for name, g, w in zip(_FIELDS, got[:5], want[:5])
        if g != w and name != "ndim"
    ]
    if _shape(got) != _shape(want):
        diffs.append(f"shape: sent {_shape(got)}, expected {_shape(want)}")
    return ", ".join(diffs)


def header_payload_bytes(header: torch.Tensor) -> int:
    """Bytes of the payload a received header announces (0 if it is not a header): what
    a receiver must drain after a mismatch so that the sender does not hang."""
    values = header.tolist()
    shape = _shape(values)
    if values[0] != _MAGIC or shape is None or any(d < 0 for d in shape):
        return 0
    itemsize = _DTYPES.get(values[3], torch.uint8).itemsize
    count = 1
    for d in shape:
        count *= d
    return count * itemsize
