"""The pipeline engine's test setup, shared by the process tests
(``integration/test_runtime_engine.py``) and the thread-world tests
(``unit/runtime/test_thread_world.py``): the tiny model, one global batch, the layouts, a
rank's step and the single-process reference it must equal."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from dflop.data.shapes import Modality, SampleShapes
from dflop.models import build_model, model_config
from dflop.models.registry import model_spec
from dflop.models.trainable import TrainableParts, freeze_stage
from dflop.runtime import RuntimeLayout, Topology
from dflop.runtime.colocated import stage_parts
from dflop.runtime.engine import PipelineEngine, build_stage
from dflop.runtime.recompute import is_recomputed
from dflop.runtime.step_data import StepPlan
from dflop.runtime.synthetic_batch import SyntheticBatch
from dflop.runtime.tensor_parallel import full_tensor
from dflop.scheduling.actions import load_program, pipeline_program
from dflop.scheduling.balance import schedule_from_assignment

PRESET = "tiny"
CONFIG = model_config(PRESET)
TPU = CONFIG.vision.tokens_per_unit
MODEL_SEED, DATA_SEED = 3, 7
SPAWN_TIMEOUT_S = 60.0

# A global batch of 8 samples: samples 2, 3 and 6 are text-only.
UNITS = np.array([2, 1, 0, 0, 3, 1, 0, 2])
TEXT = np.array([10, 6, 12, 5, 8, 20, 7, 9])

# Case (a): encoder dp=2, LLM pp=2 (4 ranks), 4 microbatches (LLM dp=1: bin = microbatch).
# Microbatch 1 is text-only; microbatch 3 has one image sample, so one encoder replica
# has nothing to do.
LAYOUT_A = dict(encoder_dp=2, llm_pp=2, num_microbatches=4)
ASSIGN_A = [0, 0, 1, 1, 0, 2, 2, 3]
# Case (b): encoder pp=1 dp=1, LLM pp=1 dp=2 (3 ranks), 2 microbatches x 2 replicas
# (bin = 2 * microbatch + replica). Microbatch 1 is text-only on both replicas.
LAYOUT_B = dict(llm_dp=2, num_microbatches=2)
ASSIGN_B = [0, 0, 2, 3, 1, 1, 3, 1]


# The same model with DecoderConfig.image_newline: a per-sample operation over all of a
# sample's units, which runs on the LLM's first stage after the units' features arrive from
# every encoder replica.
NEWLINE_CONFIG = dataclasses.replace(
    CONFIG, decoder=dataclasses.replace(CONFIG.decoder, image_newline=True)
)


def _shapes(config=CONFIG) -> SampleShapes:
    modality = np.where(UNITS > 0, Modality.IMAGE, Modality.TEXT).astype(np.int8)
    return SampleShapes(
        encoder_units=UNITS.copy(),
        tokens_per_unit=np.where(UNITS > 0, TPU, 0),
        llm_visual_tokens=config.llm_visual_tokens(UNITS),
        text_tokens=TEXT.copy(),
        modality=modality,
    )


def _layout(spec: dict, config=CONFIG) -> RuntimeLayout:
    return RuntimeLayout.simple(
        **spec,
        encoder_layers=config.vision.layers,
        llm_layers=config.decoder.layers,
        global_batch=len(UNITS),
    )


def _step_inputs(spec: dict, assignment: list[int], config=CONFIG):
    """(layout, plan, batch): what every rank derives on its own, identically."""
    layout = _layout(spec, config)
    shapes = _shapes(config)
    costs = np.stack([shapes.encoder_tokens, shapes.seq_len], axis=1).astype(float)
    schedule = schedule_from_assignment(
        costs, assignment, layout.num_microbatches, layout.llm.dp, microbatch_dims=[0]
    )
    batch = SyntheticBatch(shapes, config, seed=DATA_SEED)
    plan = StepPlan.build(
        schedule,
        shapes,
        layout,
        batch.target_tokens(),
        tokens_per_unit=TPU,
        visual_newline=config.decoder.image_newline,
    )
    return layout, plan, batch


def _full_name(module: str, name: str) -> str:
    return ("vision." if module == "encoder" else "decoder.") + name


def _rank_step(
    rank: int,
    world_size: int,
    spec: dict,
    assignment: list[int],
    debug: bool,
    tamper: bool,
    config=CONFIG,
    device: str = "cpu",
    program_path: str | None = None,
    trainable: str = "full",
    order: str | None = None,
):
    """One pipelined step on one rank; returns its losses, actions and gradients.
    ``tamper``: the second encoder stage's plan disagrees with the first's.
    ``program_path``: run the program in that file instead of the layout's schedule.
    ``trainable``: the parts that train (:class:`TrainableParts`), the rest frozen.
    ``order``: the pipeline order (default: the layout's)."""
    layout, plan, batch = _step_inputs(spec, assignment, config)
    topology = Topology.create(layout, rank)
    info = topology.info
    if tamper and info.module == "encoder" and not info.is_first_stage:
        # This rank believes microbatch 0's first encoder share has one more unit.
        mb = plan.microbatches[0]
        share = dataclasses.replace(mb.encoder[0], units=mb.encoder[0].units + 1)
        mb = dataclasses.replace(mb, encoder=(share, *mb.encoder[1:]))
        plan = dataclasses.replace(plan, microbatches=(mb, *plan.microbatches[1:]))
    stage = build_stage(
        config,
        info,
        seed=MODEL_SEED,
        device=device,
        tp_group=topology.tp_group,
        tp_size=layout.module(info.module).tp,
        layout=layout,
    )
    parts = TrainableParts.parse(trainable)
    for module, part in stage_parts(stage, info.module):  # a colocated stage: both parts
        freeze_stage(part, model_spec(config), module, parts, MODEL_SEED)
    program = None if program_path is None else load_program(program_path)
    engine = PipelineEngine(
        topology, stage, debug=debug, program=program, trainable=parts, order=order
    )
    result = engine.run_step(plan, batch)
    chunked = info.num_chunks > 1  # a StageChunks: names start with the chunk's index
    grads = {  # full_tensor gathers tensor-parallel shards (a no-op for plain tensors)
        _full_name(module, name.split(".", 1)[1] if chunked else name): full_tensor(p.grad)
        .cpu()
        .numpy()
        .copy()
        for module, part in stage_parts(stage, info.module)
        for name, p in part.named_parameters()
        if p.grad is not None
    }
    stages, chunks = layout.pipeline_stages
    if program is None:
        program = pipeline_program(
            order or layout.pipeline_order, stages, plan.num_microbatches, chunks=chunks
        )
    expected = list(program.actions[info.global_stage])
    return {
        "loss_sum": result.loss_sum,
        "num_target_tokens": result.num_target_tokens,
        "actions": result.actions,
        "expected_actions": expected,
        "busy_s": result.busy_s,
        "step_time_s": result.step_time_s,
        "grads": grads,
        "dp_rank": info.dp_rank,
        "module": info.module,
        "is_last_stage": info.is_last_stage,
        "backward_passes": result.backward_passes,
        "trainable_params": sum(p.requires_grad for p in stage.parameters()),
        "holds_encoder": info.holds_encoder,
        # Per part (a colocated stage: encoder, LLM): whether its blocks run recomputed.
        "recomputed": [is_recomputed(part) for _, part in stage_parts(stage, info.module)],
    }


def _reference(config=CONFIG, trainable: str = "full"):
    """Loss sum, target count and gradients (of the parameters that train) of one process
    on the whole batch."""
    torch.set_num_threads(1)
    model = build_model(config, seed=MODEL_SEED)
    parts, spec = TrainableParts.parse(trainable), model_spec(config)
    for name, p in model.named_parameters():
        module, _, local = name.partition(".")
        p.requires_grad_(parts.trains(spec.parameter_part(_MODULE_OF[module], local)))
    batch = SyntheticBatch(_shapes(config), config, seed=DATA_SEED)
    sum_loss, num_targets = model(**batch.model_inputs(np.arange(len(UNITS))))
    (sum_loss / num_targets).backward()
    grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters() if p.requires_grad}
    return sum_loss.item(), int(num_targets), grads


_MODULE_OF = {"vision": "encoder", "decoder": "llm"}


def _check_against_reference(results: list[dict], config=CONFIG, trainable: str = "full") -> None:
    ref_loss, ref_targets, ref_grads = _reference(config, trainable)
    for r in results:
        assert r["actions"] == r["expected_actions"]
        assert r["num_target_tokens"] == ref_targets
        assert r["loss_sum"] == pytest.approx(ref_loss, rel=1e-5)
        assert 0.0 < r["busy_s"] <= r["step_time_s"]
    seen: set[str] = set()
    for r in results:
        for name, grad in r["grads"].items():
            ref = ref_grads[name]
            tol = 1e-6 + 1e-4 * float(np.abs(ref).max())
            diff = float(np.abs(grad - ref).max())
            assert diff <= tol, f"{name}: max |grad - ref| = {diff:.3g} > {tol:.3g}"
            seen.add(name)
    assert seen == set(ref_grads), f"no rank returned {sorted(set(ref_grads) - seen)[:3]}"


LAYOUT_D = dict(llm_pp=2, llm_virtual_stages=2, num_microbatches=4)
DEEP_CONFIG = dataclasses.replace(CONFIG, decoder=dataclasses.replace(CONFIG.decoder, layers=4))
LAYOUT_C = dict(encoder_dp=3, num_microbatches=5)
ASSIGN_C = [0, 1, 2, 2, 0, 1, 4, 3]
