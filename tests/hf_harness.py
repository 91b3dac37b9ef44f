"""What the Hugging Face equivalence tests share: one pipelined step of a spec under
dflop's runtime on one rank, and the comparison with the transformers model's gradients."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from dflop.models.spec import StageSlice
from dflop.models.trainable import TrainableParts, add_lora, freeze_stage
from dflop.runtime import RuntimeLayout, Topology
from dflop.runtime.colocated import stage_parts
from dflop.runtime.engine import PipelineEngine, build_stage
from dflop.runtime.recompute import is_recomputed
from dflop.runtime.step_data import StepPlan
from dflop.runtime.tensor_parallel import full_tensor
from dflop.scheduling.balance import schedule_from_assignment
from torch.distributed.tensor import DTensor, distribute_tensor


def step_plan(spec, batch, layout_kw, assignment):
    """(layout, plan) of one step over ``batch`` with the given LLM bins, as every rank
    derives them."""
    layout = RuntimeLayout.simple(
        **layout_kw,
        encoder_layers=spec.encoder_layers,
        llm_layers=spec.llm_layers,
        global_batch=len(batch),
    )
    shapes = batch.shapes
    costs = np.stack([shapes.encoder_tokens, shapes.seq_len], axis=1).astype(float)
    schedule = schedule_from_assignment(
        costs, assignment, layout.num_microbatches, layout.llm.dp, microbatch_dims=[0]
    )
    variable = spec.tokens_per_unit is None
    plan = StepPlan.build(
        schedule,
        shapes,
        layout,
        batch.target_tokens(),
        tokens_per_unit=spec.tokens_per_unit,
        visual_newline=spec.visual_newline,
        unit_tokens=batch.unit_tokens() if variable else None,
        token_merge=spec.token_merge,
    )
    return layout, plan


def run_rank_step(rank, spec, batch, layout_kw, assignment, seed, trainable="full", order=None):
    """This rank's stage runs one step; its loss, targets, gradients (TP shards gathered:
    every TP rank calls it in the same order) and how many parameters are sharded.
    ``trainable``: the parts that train (:class:`TrainableParts`), the rest frozen;
    ``order``: the pipeline order (default: the layout's)."""
    layout, plan = step_plan(spec, batch, layout_kw, assignment)
    topology = Topology.create(layout, rank)
    info = topology.info
    stage = build_stage(
        spec,
        info,
        seed=seed,
        tp_group=topology.tp_group,
        tp_size=layout.module(info.module).tp,
        layout=layout,
    )
    parts = TrainableParts.parse(trainable)
    for module, part in stage_parts(stage, info.module):  # a colocated stage: both parts
        freeze_stage(part, spec, module, parts, seed)
        perturb_lora_b(part)  # by the full model's names
    engine = PipelineEngine(topology, stage, debug=True, trainable=parts, order=order)
    result = engine.run_step(plan, batch)
    grads = {  # the full model's names (a colocated stage's parts hold disjoint ones)
        name: full_tensor(p.grad).numpy().copy()
        for _, part in stage_parts(stage, info.module)
        for name, p in part.named_parameters()
        if p.grad is not None
    }
    return {
        "loss_sum": result.loss_sum,
        "targets": result.num_target_tokens,
        "grads": grads,
        "sharded": sum(isinstance(p, DTensor) for p in stage.parameters()),
        "adapters": [isinstance(p, DTensor) for n, p in stage.named_parameters() if "lora_" in n],
        "backward_passes": result.backward_passes,
        "module": info.module,
        "visual_microbatches": info.module == "llm"
        and sum(mb.llm[info.dp_rank].visual_rows > 0 for mb in plan.microbatches),
        "is_last_stage": info.is_last_stage,
        "kinds": sorted({a.kind for a in result.actions}),
        "recomputed": [is_recomputed(part) for _, part in stage_parts(stage, info.module)],
    }


def freeze_reference(model, spec, trainable="full", seed=0) -> None:
    """Freeze the parts of the whole transformers ``model`` that ``trainable`` freezes,
    by the spec's own part of each parameter (the encoder's are those its whole encoder
    stage holds); ``lora`` parts: frozen weights and the adapters dflop's stages get for
    ``seed`` (PEFT's, added to the whole model), their B made non-zero as the ranks'."""
    parts = TrainableParts.parse(trainable)
    whole = StageSlice("encoder", (0, spec.encoder_layers))
    encoder_names = {name for name, _ in spec.build_stage(whole, seed=0).named_parameters()}

    def part_of(name):
        return spec.parameter_part("encoder" if name in encoder_names else "llm", name)

    for name, p in model.named_parameters():
        p.requires_grad_(parts.mode(part_of(name)) == "full")
    add_lora(model, parts, part_of, seed)
    perturb_lora_b(model)


def perturb_lora_b(model) -> None:
    """Set every LoRA B (PEFT initialises it to zero, where A's gradient is zero too) to
    small values drawn from its own name, so that both adapter matrices' gradients are
    compared; the same on dflop's stages and on the reference model."""
    for name, p in model.named_parameters():
        if "lora_B" in name:
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            value = 0.05 * torch.randn(p.shape, generator=generator)
            if isinstance(p, DTensor):  # a tensor-parallel shard: this rank's slice
                value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
            with torch.no_grad():
                p.copy_(value)


def reference_step(model, samples, targets, forward):
    """The transformers model on each sample alone (``forward(model, sample)`` -> mean
    loss), weighted into the gradient of the batch's mean loss: (loss sum, gradients)."""
    torch.set_num_threads(1)
    total = int(np.sum(targets))
    loss_sum = 0.0
    for sample, n in zip(samples, targets):
        loss = forward(model, sample)
        if loss.requires_grad:  # else frozen parts: e.g. a text-only sample, frozen LLM
            (loss * (int(n) / total)).backward()
        loss_sum += loss.item() * int(n)
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return loss_sum, grads


def assert_matches(results, ref_loss, ref_grads, layout_kw):
    """Every rank reports the step's loss; after the DP all-reduce (and with TP,
    gathered) every rank holds the whole gradient of each parameter it holds; all
    parameters are held; with tensor parallelism every rank holds shards, else none."""
    for r in results:
        assert r["loss_sum"] == pytest.approx(ref_loss, rel=1e-5)
    held = set()
    for r in results:
        for name, grad in r["grads"].items():
            held.add(name)
            tol = 1e-6 + 1e-4 * float(np.abs(ref_grads[name]).max())
            diff = float(np.abs(grad - ref_grads[name]).max())
            assert diff <= tol, f"{name}: max |grad - ref| = {diff:.3g} > {tol:.3g}"
    assert held == set(ref_grads), sorted(held ^ set(ref_grads))[:4]
    tp = layout_kw.get("encoder_tp", 1) > 1
    assert all((r["sharded"] > 0) == tp for r in results), [r["sharded"] for r in results]
    # Activation recompute ran where the layout asks for it (a colocated encoder's
    # follows the LLM's), and nowhere else.
    for r in results:
        module = "llm" if layout_kw.get("colocated") else r["module"]
        want = bool(layout_kw.get(f"{'encoder' if module == 'encoder' else 'llm'}_recompute"))
        assert r["recomputed"] == [want] * len(r["recomputed"]), r["recomputed"]
    # LoRA adapters of sharded layers are sharded with them (a half of each pair).
    for r in results:
        assert any(r["adapters"]) == (tp and bool(r["adapters"])), r["adapters"]


def assert_backward_only_where_trained(results, trainable) -> None:
    """A stage with nothing trainable at or before it ran no backward pass; the others
    ran at least one (counted by the engine)."""
    parts = TrainableParts.parse(trainable)
    for r in results:
        runs = parts.stage_backward(r["module"], r["is_last_stage"])
        assert (r["backward_passes"] > 0) == runs, (r["module"], r["is_last_stage"], r)
        if r["module"] == "llm" and not parts.trains("llm"):
            # A frozen LLM passes gradients on only for microbatches with visual rows.
            assert r["backward_passes"] == r["visual_microbatches"], r


# Frozen-part regimes and the layouts (indices into LAYOUTS) each is tested on.
# LoRA under tensor parallelism: adapters on both modules (column- and row-parallel
# layers of the tower, the projector and the LLM).
FROZEN_CASES = [
    ("frozen-vision", 0),
    ("frozen-vision", 2),
    ("projector", 0),
    ("lora", 0),
    ("encoder=lora,llm=lora", 2),
    ("lora", 3),
]
FROZEN_IDS = [
    "frozen_vision-enc_dp2_llm_pp2",
    "frozen_vision-tp2",
    "projector-enc_dp2_llm_pp2",
    "lora-enc_dp2_llm_pp2",
    "lora_both-tp2",
    "lora-colocated_llm_pp2_rc",
]


LAYOUTS = [
    # encoder dp 2 (samples' units spread over both replicas), LLM pp 2, 3 microbatches.
    # Microbatch 2 holds the two text-only samples.
    (dict(encoder_dp=2, llm_pp=2, num_microbatches=3), [0, 2, 0, 1, 0, 1, 2, 0], 4),
    # one encoder stage and one LLM stage, 2 microbatches.
    (dict(num_microbatches=2), [0, 1, 0, 1, 0, 1, 1, 0], 2),
    # tensor parallelism: encoder and LLM each over 2 TP ranks.
    (dict(encoder_tp=2, llm_tp=2, num_microbatches=2), [0, 1, 0, 1, 0, 1, 1, 0], 4),
    # colocated: the encoder inside the first of 2 LLM stages (no encoder rank), both
    # under activation recompute (every block's forward runs again in the backward).
    (
        dict(llm_pp=2, num_microbatches=3, colocated=True, llm_recompute=True),
        [0, 2, 0, 1, 0, 1, 2, 0],
        2,
    ),
]
LAYOUT_IDS = ["enc_dp2_llm_pp2", "one_stage_each", "enc_tp2_llm_tp2", "colocated_llm_pp2_rc"]
