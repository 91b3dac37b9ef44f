"""The LM head and the cross-entropy over target tokens, in chunks: no full logits tensor.

A 152k-token vocabulary makes the logits of a long sample the largest tensor of a step
(an 18k-token answer: 11 GB of fp32 logits, and as much again for their gradient). Like
the fused linear-cross-entropy kernels real trainers use (Liger-Kernel, Apple's Cut
Cross-Entropy, torchtune's chunked loss), :func:`chunked_lm_loss` never holds them: the
rows (hidden states of the target positions) are processed ``chunk_tokens`` at a time,
each chunk's logits made, reduced to its loss and dropped; the backward makes each
chunk's logits again (one more head GEMM) and turns them into the chunk's gradients at
once. Logits memory is one chunk's, ``min(chunk_tokens, targets) x vocab``, whatever the
sample's length.

Precision follows transformers' loss: logits in the head's dtype, the softmax and the
loss in float32; the head's weight gradient accumulates over chunks in its own dtype
(one ``addmm`` per chunk, as Liger does).

Vocabulary-parallel heads: a head weight sharded by rows over a tensor-parallel group (a
``DTensor`` with ``Shard(0)``, Megatron's vocab-parallel output layer) computes the logits
of its own vocabulary slice; the row maxima, the softmax sums and the target logits are
all-reduced over the group, and the input gradient is summed over it, so every rank
returns the full loss and the full input gradient while holding ``vocab / tp`` columns
of each chunk.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["DEFAULT_LOSS_CHUNK_TOKENS", "chunked_lm_loss", "head_logit_shard"]

SPLIT_HALF = "dflop_split_half"
"""The attribute :mod:`dflop.runtime.split_backward` sets on the node (the ``ctx``) of a
``SPLIT_AWARE`` autograd Function: ``"input"`` when a zero-bubble ``I`` runs it,
``"weight"`` when its ``W`` does; absent in a plain backward."""

DEFAULT_LOSS_CHUNK_TOKENS = 1024
"""Target rows per chunk of :func:`chunked_lm_loss` (``TrainConfig.loss_chunk_tokens``):
at a 152k vocabulary one chunk's float32 logits take 0.6 GB, against the 10-30 ms of GPU
time its GEMMs take, so the per-chunk overhead stays small."""


def head_logit_shard(weight: Tensor) -> tuple[Tensor, int, Any]:
    """``(local weight rows, first vocabulary index, process group or None)`` of an LM
    head weight: a plain tensor or a replicated ``DTensor`` holds every row; a ``DTensor``
    sharded by rows (``Shard(0)``) over a 1-D mesh holds its slice, which starts where the
    lower ranks' slices end (torch's even split: ``ceil(V / tp)`` rows a rank, the last
    fewer)."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - torch without DTensor
        return weight, 0, None
    if not isinstance(weight, DTensor):
        return weight, 0, None
    placements = weight.placements
    local = weight.to_local()
    if not any(isinstance(p, Shard) for p in placements):
        return local, 0, None
    if len(placements) != 1 or placements[0] != Shard(0):
        raise ValueError(
            f"the LM head weight is a DTensor placed {placements}: chunked_lm_loss takes a "
            "replicated head or one sharded by vocabulary rows (Shard(0)) over a 1-D mesh"
        )
    mesh = weight.device_mesh
    rank = mesh.get_local_rank()
    rows = -(-weight.shape[0] // mesh.size())
    return local, min(rank * rows, weight.shape[0]), mesh.get_group()


def _all_reduce(tensor: Tensor, op: Any, group: Any) -> Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _ChunkedHeadLoss(torch.autograd.Function):
    """Sum over rows of ``cross_entropy(hidden @ weight.T + bias, targets)`` (see the
    module docstring); ``weight`` holds vocabulary rows ``[start, start + len)``. Split
    aware (:mod:`dflop.runtime.split_backward`): a zero-bubble ``I`` computes the hidden
    gradient only, its ``W`` the weight and bias gradients only."""

    SPLIT_AWARE = True

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        chunk_tokens: int,
        start: int,
        group: Any,
    ) -> Tensor:
        rows = hidden.shape[0]
        lse = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for a in range(0, rows, chunk_tokens):
            b = min(a + chunk_tokens, rows)
            logits = _logits(hidden[a:b], weight, bias)
            picked = _all_reduce(_pick(logits, targets[a:b], start), dist.ReduceOp.SUM, group)
            row_max = _all_reduce(logits.max(dim=1).values, dist.ReduceOp.MAX, group)
            logits.sub_(row_max[:, None]).exp_()
            sums = _all_reduce(logits.sum(dim=1), dist.ReduceOp.SUM, group)
            del logits
            lse[a:b] = sums.log_().add_(row_max)
            total += (lse[a:b] - picked).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_tokens, ctx.start, ctx.group = chunk_tokens, start, group
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        half = getattr(ctx, SPLIT_HALF, None)
        want_hidden = want_hidden and half != "weight"
        want_weight, want_bias = (want and half != "input" for want in (want_weight, want_bias))
        if not (want_hidden or want_weight or want_bias):
            return None, None, None, None, None, None, None
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        grad_bias = torch.zeros_like(bias) if want_bias and bias is not None else None
        scale = grad_total.to(torch.float32)
        for a in range(0, hidden.shape[0], ctx.chunk_tokens):
            b = min(a + ctx.chunk_tokens, hidden.shape[0])
            # d loss / d logits = softmax - one_hot(target), times the upstream gradient.
            grad = _logits(hidden[a:b], weight, bias).sub_(lse[a:b, None]).exp_()
            local, mine = _local_targets(targets[a:b], ctx.start, weight.shape[0])
            rows = torch.arange(b - a, device=grad.device)
            grad[rows, local] -= mine.to(grad.dtype)  # one column per row: deterministic
            grad = grad.mul_(scale).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[a:b] = grad @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), hidden[a:b])
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0)
            del grad
        if grad_hidden is not None:
            _all_reduce(grad_hidden, dist.ReduceOp.SUM, ctx.group)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """float32 logits of a chunk (computed in the head's dtype, as ``nn.Linear``)."""
    return nn.functional.linear(hidden, weight, bias).float()


def _local_targets(targets: Tensor, start: int, rows: int) -> tuple[Tensor, Tensor]:
    """Targets as columns of this rank's slice (clamped into it) and whether they are in
    it."""
    local = targets - start
    mine = (local >= 0) & (local < rows)
    return local.clamp(0, max(rows - 1, 0)), mine


def _pick(logits: Tensor, targets: Tensor, start: int) -> Tensor:
    """Each row's logit of its target (0 where the target is in another rank's slice)."""
    local, mine = _local_targets(targets, start, logits.shape[1])
    picked = logits.gather(1, local[:, None])[:, 0]
    return torch.where(mine, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def chunked_lm_loss(
    hidden: Tensor, head: nn.Module, targets: Tensor, chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS
) -> Tensor:
    """Summed next-token cross-entropy of ``head(hidden)`` against ``targets`` (float32,
    0-dim), computed ``chunk_tokens`` rows at a time (see the module docstring).

    Args:
        hidden: ``[N, hidden]`` final-norm hidden states of the target positions only.
        head: the output layer (``nn.Linear``: ``weight [V, hidden]``, optional bias), its
            weight a tensor or a ``DTensor`` (replicated, or vocab-sharded: ``Shard(0)``).
        targets: ``LongTensor[N]`` in ``[0, V)``.
        chunk_tokens: rows per chunk (>= 1).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [N, hidden] and targets [N], got {tuple(hidden.shape)} and "
            f"{tuple(targets.shape)}"
        )
    weight, start, group = head_logit_shard(head.weight)
    bias = getattr(head, "bias", None)
    if bias is not None:
        bias, _, _ = head_logit_shard(bias)
    if hidden.shape[0] == 0:  # no target: a zero that still reaches every input
        zero = (hidden.sum() + weight.sum() * 0).float() * 0
        return zero if bias is None else zero + bias.sum().float() * 0
    return _ChunkedHeadLoss.apply(hidden, weight, bias, targets, chunk_tokens, start, group)
