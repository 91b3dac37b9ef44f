"""Tensor parallelism of a pipeline stage through torch's own tensor-parallel API.

:func:`apply_tensor_parallel` shards any stage that declares its plan, Megatron-style,
with ``torch.distributed.tensor.parallel.parallelize_module``. A stage declares:

- ``tensor_parallel_plan() -> {submodule name: "colwise" | "rowwise" | "vocab"}``:
  typically attention q/k/v column-parallel and the output projection row-parallel, the
  MLP's first layer(s) column- and last layer row-parallel, and the LM head
  vocabulary-parallel (``"vocab"``: its weight's rows split over the ranks, as Megatron's
  output layer; the chunked loss, :mod:`dflop.models.loss`, computes each rank's slice of
  the logits, and a plain forward gathers them); every module not named stays replicated
  (embeddings, norms);
- ``tensor_parallel_sizes() -> [(config field, value)]``: what the TP size must divide
  (heads, KV heads, MLP widths), so an error names the field;
- optionally ``use_local_heads(tp_size)``: set attention head counts to the local ones.

dflop's ``VisionStage`` / ``DecoderStage`` and the Hugging Face stages
(:mod:`dflop.models.hf`) declare theirs; column-parallel q/k/v of a contiguous run of
``heads / tp`` query heads and ``kv_heads / tp`` key/value heads pair every local query
head with its own key/value head.

Every block's input and output stay replicated, plain tensors (no sequence parallelism):
per block, the forward does one all-reduce after each row-parallel layer and the backward
one all-reduce per column-parallel layer. So the stage's inputs, outputs, the loss and the
gradients of the replicated parameters are identical on every TP rank, and a pipeline can
send activations between stages exactly as with tp=1 (see docs/models.md, "Tensor
parallelism"). Sharded parameters become ``DTensor``s; :func:`local_tensor` gives the
local shard of a parameter or gradient (for a flat DP all-reduce).

A stage then mixes ``DTensor`` and plain parameters, which torch's multi-tensor kernels
refuse ("got mixed torch.Tensor and DTensor"): ``foreach`` / ``fused`` optimizers and
``torch.nn.utils.clip_grad_norm_`` fail on such a list. Give the optimizer
:func:`optimizer_param_groups` (one group per kind; any ``foreach`` / ``fused`` setting
then works) and compute the gradient norm with :func:`grad_sq_sum`.

Backends: on torch 2.13 this runs on CPU with gloo (gloo has every collective DTensor
uses here: all_reduce, all_gather, reduce_scatter, broadcast, scatter) and on GPUs with
NCCL; the tests run it on gloo.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dflop.errors import InputTypeError

__all__ = [
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "full_tensor",
    "grad_sq_sum",
    "local_tensor",
    "optimizer_param_groups",
    "tensor_parallel_plan",
    "tp_device_mesh",
]

COLWISE = "colwise"
ROWWISE = "rowwise"
VOCAB = "vocab"


def _check_tp_size(tp_size: Any) -> int:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    return tp_size


def _declared(stage: Any, method: str) -> Any:
    fn = getattr(stage, method, None)
    if not callable(fn):
        raise InputTypeError(
            f"{type(stage).__name__} declares no tensor-parallel plan (its "
            "tensor_parallel_plan() and tensor_parallel_sizes())"
        )
    return fn()


def check_tensor_parallel(stage: nn.Module, tp_size: int) -> None:
    """Raise ``ValueError`` naming the config field that ``tp_size`` does not divide.

    Attention heads (and KV heads) must split evenly over the TP ranks, and so must the
    MLP widths (Megatron's rule; it keeps every rank's shard the same shape). Pure: no
    torch.distributed.
    """
    tp = _check_tp_size(tp_size)
    for name, value in _declared(stage, "tensor_parallel_sizes"):
        if value % tp != 0:
            raise ValueError(
                f"{name}={value} is not divisible by the tensor-parallel size tp={tp}; "
                f"choose a tp that divides it (or change {name})"
            )


def tensor_parallel_plan(stage: nn.Module) -> dict[str, str]:
    """The stage's sharding plan: fully qualified submodule name -> ``"colwise"`` /
    ``"rowwise"`` / ``"vocab"`` (names relative to ``stage``); every module not named stays
    replicated. Pure: no torch.distributed."""
    plan = dict(_declared(stage, "tensor_parallel_plan"))
    bad = sorted(kind for kind in set(plan.values()) if kind not in (COLWISE, ROWWISE, VOCAB))
    if bad:
        raise ValueError(
            f"tensor-parallel plan kind {bad[0]!r} is not 'colwise', 'rowwise' or 'vocab'"
        )
    return plan


def tp_device_mesh(tp_mesh_or_group: Any, device_type: str) -> Any:
    """A 1-D ``DeviceMesh`` over the TP ranks: a ``DeviceMesh`` is returned as is, a
    process group (e.g. ``Topology.tp_group``) is wrapped with ``DeviceMesh.from_group``,
    which creates no new process group (so only the TP ranks need to call it)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(tp_mesh_or_group, DeviceMesh):
        if tp_mesh_or_group.ndim != 1:
            raise ValueError(
                f"the tensor-parallel DeviceMesh must be 1-D, got {tp_mesh_or_group.ndim}-D"
            )
        return tp_mesh_or_group
    return DeviceMesh.from_group(tp_mesh_or_group, device_type)


def apply_tensor_parallel(stage: nn.Module, tp_mesh_or_group: Any, *, tp_size: int) -> nn.Module:
    """Shard ``stage`` over the TP ranks of ``tp_mesh_or_group``, in place; returns it.

    Call it on every rank of the TP group, after the weights are initialised (the same
    full weights on every TP rank, e.g. ``stage.init_weights(seed)``: each rank keeps its
    own slice, no communication) and after moving the stage to its device. ``tp_size``
    must equal the group's size. ``tp_size == 1`` returns the stage unchanged (no mesh
    needed; ``tp_mesh_or_group`` may be None).

    Raises:
        ValueError: a config field not divisible by ``tp_size`` (named), or a group of
            another size.
    """
    check_tensor_parallel(stage, tp_size)
    if tp_size == 1:
        return stage
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    device_type = next(stage.parameters()).device.type
    mesh = tp_device_mesh(tp_mesh_or_group, device_type)
    if mesh.size() != tp_size:
        raise ValueError(f"tp_size={tp_size} but the tensor-parallel group has {mesh.size()} ranks")
    if mesh.device_type != device_type:
        raise ValueError(
            f"the DeviceMesh is on {mesh.device_type!r} but the stage's parameters are on "
            f"{device_type!r}: move the stage to its device before sharding it"
        )

    local_heads = getattr(stage, "use_local_heads", None)
    if callable(local_heads):  # attention modules that reshape by a head count
        local_heads(tp_size)
    styles = {
        COLWISE: ColwiseParallel,
        ROWWISE: RowwiseParallel,
        # The head's rows over the ranks; a plain forward's logits gathered whole.
        VOCAB: lambda: ColwiseParallel(output_layouts=Replicate()),
    }
    kinds = tensor_parallel_plan(stage)
    plan = {name: styles[kind]() for name, kind in kinds.items()}
    if plan:
        # src_data_rank=None: every TP rank holds the same full weights, so each keeps its
        # own slice without a scatter from rank 0.
        parallelize_module(stage, mesh, plan, src_data_rank=None)
    for name, kind in kinds.items():  # LoRA adapters are sharded by it (models.trainable)
        stage.get_submodule(name).tensor_parallel_style = kind
    stage.tp_size = tp_size  # type: ignore[assignment]
    return stage


def local_tensor(tensor: Tensor) -> Tensor:
    """The local shard of a ``DTensor`` (a parameter or gradient sharded by
    :func:`apply_tensor_parallel`), or ``tensor`` itself. For a DTensor the result shares
    its storage, so in-place updates (a DP all-reduce's copy back) reach the DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        with torch.no_grad():  # without autograd, to_local returns the local tensor itself
            return tensor.to_local()
    return tensor


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor of a ``DTensor`` (all-gathered over the TP ranks: call it on every
    TP rank), or ``tensor`` itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def optimizer_param_groups(module: nn.Module) -> list[dict[str, Any]]:
    """``module``'s trainable parameters as optimizer parameter groups: the ``DTensor``s
    (sharded) in one group, the plain tensors (replicated) in another; empty groups are
    left out. Extra per-group options can be added to the returned dicts."""
    from torch.distributed.tensor import DTensor

    params = [p for p in module.parameters() if p.requires_grad]
    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": group} for group in (sharded, plain) if group]


def grad_sq_sum(module: nn.Module, *, include_replicated: bool) -> Tensor:
    """This rank's share of the squared gradient norm (float64, 0-dim, no communication).

    Sharded (``DTensor`` with a ``Shard`` placement) gradients contribute their local
    shard; replicated ones (plain tensors, and ``DTensor`` s placed ``Replicate``, such as
    a row-parallel layer's bias) contribute only if ``include_replicated`` -- pass ``tp_rank == 0`` so that
    summing the result over a TP group counts every parameter exactly once. For a whole
    pipeline's norm: contribute on DP replica 0 only (replicas hold the same gradients
    after the DP all-reduce), all-reduce the sum over all ranks, take the square root.
    """
    from torch.distributed.tensor import DTensor

    total = torch.zeros((), dtype=torch.float64)
    for p in module.parameters():
        if p.grad is None:
            continue
        # A DTensor gradient may be replicated too (a row-parallel layer's bias): only
        # a sharded one is split over the TP ranks.
        sharded = isinstance(p.grad, DTensor) and any(pl.is_shard() for pl in p.grad.placements)
        if sharded or include_replicated:
            g = local_tensor(p.grad).detach()
            total = total.to(g.device) + g.double().pow(2).sum()
    return total
