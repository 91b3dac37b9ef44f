"""Tensor parallelism of a pipeline stage through torch's own tensor-parallel API.

:func:`apply_tensor_parallel` shards a ``VisionStage`` or ``DecoderStage`` Megatron-style
with ``torch.distributed.tensor.parallel.parallelize_module``:

- attention: ``q_proj`` / ``k_proj`` / ``v_proj`` column-parallel (each TP rank holds a
  contiguous run of ``heads / tp`` query heads and ``kv_heads / tp`` key/value heads, so
  grouped-query attention pairs every local query head with its own local kv head),
  ``o_proj`` / ``out_proj`` row-parallel;
- MLP: ``gate_proj`` / ``up_proj`` (decoder) or ``fc1`` (encoder) column-parallel,
  ``down_proj`` / ``fc2`` row-parallel; the projector's ``linear_1`` / ``linear_2`` the same;
- replicated: embeddings, norms, the patch convolution, the decoder's ``image_newline``
  and output head.

Every block's input and output stay replicated, plain tensors (no sequence parallelism):
per block, the forward does one all-reduce after each row-parallel layer and the backward
one all-reduce per column-parallel layer. So the stage's inputs, outputs, the loss and the
gradients of the replicated parameters are identical on every TP rank, and a pipeline can
send activations between stages exactly as with tp=1 (see the README, "Tensor
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

Head counts: the attention modules reshape q/k/v by their ``heads`` / ``kv_heads``
attributes. After sharding those attributes hold the LOCAL counts (``heads / tp``); the
decoder's attention needs nothing else. The vision attention reshapes its output with the
full hidden size, so its blocks get a :class:`LocalHeadsVisionAttention` (the same
``q_proj`` ... ``out_proj`` submodules, so parameter names do not change) whose forward
reshapes with the local width.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflop.models.decoder import DecoderAttention, DecoderStage
from dflop.models.vision import VisionAttention, VisionStage

__all__ = [
    "LocalHeadsVisionAttention",
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


def _check_tp_size(tp_size: Any) -> int:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    return tp_size


def check_tensor_parallel(stage: VisionStage | DecoderStage, tp_size: int) -> None:
    """Raise ``ValueError`` naming the config field that ``tp_size`` does not divide.

    Attention heads (and the decoder's ``kv_heads``) must split evenly over the TP ranks,
    and so must the MLP widths (Megatron's rule; it keeps every rank's shard the same
    shape). Pure: no torch.distributed.
    """
    tp = _check_tp_size(tp_size)
    fields: list[tuple[str, int]]
    if isinstance(stage, VisionStage):
        v, p = stage.vision_config, stage.projector_config
        fields = [
            ("VisionConfig.heads", v.heads),
            ("VisionConfig.mlp_hidden", v.mlp_hidden),
        ]
        if stage.projector is not None:
            fields.append(("ProjectorConfig.intermediate", p.intermediate))
    elif isinstance(stage, DecoderStage):
        c = stage.config
        fields = [
            ("DecoderConfig.heads", c.heads),
            ("DecoderConfig.kv_heads", c.kv_heads),
            ("DecoderConfig.mlp_hidden", c.mlp_hidden),
        ]
    else:
        raise TypeError(
            f"stage must be a VisionStage or a DecoderStage, got {type(stage).__name__}"
        )
    for name, value in fields:
        if value % tp != 0:
            raise ValueError(
                f"{name}={value} is not divisible by the tensor-parallel size tp={tp}; "
                f"choose a tp that divides it (or change {name})"
            )


def tensor_parallel_plan(stage: VisionStage | DecoderStage) -> dict[str, str]:
    """The sharding plan: fully qualified submodule name -> ``"colwise"`` / ``"rowwise"``.

    Names are relative to ``stage`` (``layers.3.self_attn.q_proj``,
    ``encoder.blocks.0.mlp.fc1``, ``projector.linear_2`` ...); every module not named
    stays replicated. Pure: no torch.distributed.
    """
    plan: dict[str, str] = {}
    if isinstance(stage, VisionStage):
        for i in stage.encoder.blocks:
            base = f"encoder.blocks.{i}"
            for name in ("q_proj", "k_proj", "v_proj"):
                plan[f"{base}.self_attn.{name}"] = COLWISE
            plan[f"{base}.self_attn.out_proj"] = ROWWISE
            plan[f"{base}.mlp.fc1"] = COLWISE
            plan[f"{base}.mlp.fc2"] = ROWWISE
        if stage.projector is not None:
            plan["projector.linear_1"] = COLWISE
            plan["projector.linear_2"] = ROWWISE
    elif isinstance(stage, DecoderStage):
        for i in stage.layers:
            base = f"layers.{i}"
            for name in ("q_proj", "k_proj", "v_proj"):
                plan[f"{base}.self_attn.{name}"] = COLWISE
            plan[f"{base}.self_attn.o_proj"] = ROWWISE
            for name in ("gate_proj", "up_proj"):
                plan[f"{base}.mlp.{name}"] = COLWISE
            plan[f"{base}.mlp.down_proj"] = ROWWISE
    else:
        raise TypeError(
            f"stage must be a VisionStage or a DecoderStage, got {type(stage).__name__}"
        )
    return plan


class LocalHeadsVisionAttention(nn.Module):
    """``VisionAttention`` over this TP rank's heads: the same ``q_proj`` / ``k_proj`` /
    ``v_proj`` / ``out_proj`` modules (so the same parameter names), ``heads`` = the local
    head count, and an output reshape to the local width instead of the full hidden size.
    (With ``reshape(units, tokens, -1)`` in ``VisionAttention.forward`` this class would
    not be needed.)"""

    def __init__(self, source: VisionAttention, local_heads: int) -> None:
        super().__init__()
        self.heads = local_heads
        self.q_proj = source.q_proj
        self.k_proj = source.k_proj
        self.v_proj = source.v_proj
        self.out_proj = source.out_proj

    def forward(self, x: Tensor) -> Tensor:
        units, tokens, _ = x.shape

        def split_heads(t: Tensor) -> Tensor:  # [U, N, local D] -> [U, heads, N, d]
            return t.view(units, tokens, self.heads, -1).transpose(1, 2)

        q, k, v = (split_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(units, tokens, -1))


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


def apply_tensor_parallel(
    stage: VisionStage | DecoderStage, tp_mesh_or_group: Any, *, tp_size: int
) -> VisionStage | DecoderStage:
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

    # Local head counts (the attention modules reshape by these attributes).
    if isinstance(stage, VisionStage):
        local_heads = stage.vision_config.heads // tp_size
        for block in stage.encoder.blocks.values():
            block.self_attn = LocalHeadsVisionAttention(block.self_attn, local_heads)
    else:
        for block in stage.layers.values():
            attn: DecoderAttention = block.self_attn
            attn.heads = stage.config.heads // tp_size
            attn.kv_heads = stage.config.kv_heads // tp_size

    styles = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}
    plan = {name: styles[kind]() for name, kind in tensor_parallel_plan(stage).items()}
    if plan:
        # src_data_rank=None: every TP rank holds the same full weights, so each keeps its
        # own slice without a scatter from rank 0.
        parallelize_module(stage, mesh, plan, src_data_rank=None)
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

    Sharded (``DTensor``) gradients contribute their local shard; plain (replicated)
    gradients contribute only if ``include_replicated`` -- pass ``tp_rank == 0`` so that
    summing the result over a TP group counts every parameter exactly once. For a whole
    pipeline's norm: contribute on DP replica 0 only (replicas hold the same gradients
    after the DP all-reduce), all-reduce the sum over all ranks, take the square root.
    """
    from torch.distributed.tensor import DTensor

    total = torch.zeros((), dtype=torch.float64)
    for p in module.parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor) or include_replicated:
            g = local_tensor(p.grad).detach()
            total = total.to(g.device) + g.double().pow(2).sum()
    return total
