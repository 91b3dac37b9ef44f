"""Activation recompute (``rc`` in a plan, ``enc_rc`` / ``llm_rc`` in a layout): each
transformer block of a stage keeps only its inputs through the forward and runs its
forward again in the backward, so a stage holds one block's activations at a time instead
of all of them (what the planner's memory model prices for a module with ``recompute``).

:func:`apply_recompute` wraps the blocks a stage names (``stage.recompute_blocks()``) in
``torch.utils.checkpoint`` (non-reentrant: it follows ``torch.autograd.grad`` with
``inputs``, which the zero-bubble split backward uses, and keyword arguments, which the
Hugging Face layers take). The block's module is unchanged (same parameters, same
``state_dict`` keys): checkpoints, exports and tensor-parallel plans see the same model.
The RNG state is restored for the recomputed forward, so a block with dropout recomputes
what it computed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflop.errors import InputTypeError

__all__ = ["apply_recompute", "is_recomputed"]

_WRAPPED = "_dflop_recompute_forward"


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # a forward-only pass keeps nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(stage: nn.Module) -> nn.Module:
    """Run every block of ``stage`` (``stage.recompute_blocks()``) under activation
    checkpointing; returns ``stage``. Idempotent.

    Raises:
        InputTypeError: ``stage`` does not name its blocks (``recompute_blocks``).
    """
    blocks = getattr(stage, "recompute_blocks", None)
    if not callable(blocks):
        raise InputTypeError(
            f"{type(stage).__name__} does not name its transformer blocks "
            "(recompute_blocks()): activation recompute cannot wrap them; plan the module "
            "without recompute"
        )
    for block in blocks():
        if getattr(block, _WRAPPED, False):
            continue
        # An instance attribute: nn.Module.__call__ (and its hooks) call it in place of
        # the class's forward; parameters and state_dict keys stay the block's own.
        block.forward = functools.partial(_checkpointed, block.forward)
        setattr(block, _WRAPPED, True)
    return stage


def is_recomputed(stage: nn.Module) -> bool:
    """Whether :func:`apply_recompute` wrapped ``stage``'s blocks (and it has any)."""
    blocks = getattr(stage, "recompute_blocks", None)
    found = list(blocks()) if callable(blocks) else []
    return bool(found) and all(getattr(b, _WRAPPED, False) for b in found)
