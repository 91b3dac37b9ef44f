"""Tests of dflop's pipeline engine (dflop.runtime.engine) with real gloo processes.

Correctness: for the same weights (tiny preset, name-keyed init) and the same global batch,
a pipelined, heterogeneous multi-process step gives the loss and the per-parameter
gradients of a single-process ``MultimodalModel`` run on the whole batch. Each rank
returns its stage's gradients under the full model's parameter names; the parent compares.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dflop.data.shapes import Modality  # noqa: E402
from dflop.models.trainable import TrainableParts  # noqa: E402
from dflop.runtime import (  # noqa: E402
    SpawnError,
    Topology,
    spawn_local,
    spawn_threads,
)
from dflop.runtime import engine as engine_module  # noqa: E402
from dflop.runtime.engine import (  # noqa: E402
    PipelineEngine,
    UnsupportedActionError,
    build_stage,
    check_executable,
)
from dflop.runtime.synthetic_batch import ShapeScaler, SyntheticBatch  # noqa: E402
from dflop.runtime.topology import rank_info  # noqa: E402
from dflop.scheduling.actions import (  # noqa: E402
    PipelineAction,
    PipelineProgram,
    pipeline_program,
    save_program,
)
from engine_harness import (  # noqa: E402
    ASSIGN_A,
    ASSIGN_B,
    ASSIGN_C,
    CONFIG,
    DATA_SEED,
    DEEP_CONFIG,
    LAYOUT_A,
    LAYOUT_B,
    LAYOUT_C,
    LAYOUT_D,
    MODEL_SEED,
    NEWLINE_CONFIG,
    SPAWN_TIMEOUT_S,
    TEXT,
    TPU,
    UNITS,
    _check_against_reference,
    _layout,
    _rank_step,
    _shapes,
    _step_inputs,
)


def test_encoder_dp2_llm_pp2_matches_single_process():
    """4 ranks: encoder replicas 0, 1 (ranks 0, 1); LLM stages 0, 1 (ranks 2, 3)."""
    results = spawn_local(
        _rank_step,
        4,
        args=(LAYOUT_A, ASSIGN_A, False, False),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    _check_against_reference(results)


# Case (d): interleaved 1F1B: LLM pp=2 with 2 virtual stages (4 chunks of one layer each),
# 3 ranks, 4 microbatches; the last LLM stage's chunk 0 feeds the first stage's chunk 1.


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug_headers"])
def test_interleaved_llm_matches_single_process(debug):
    results = spawn_local(
        _rank_step,
        3,
        args=(LAYOUT_D, ASSIGN_A, debug, False, DEEP_CONFIG),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    assert [len({a.stage for a in r["actions"]}) for r in results] == [1, 2, 2]
    _check_against_reference(results, DEEP_CONFIG)


# Case (c): encoder dp=3 (4 ranks), 5 microbatches: mb 0 holds samples of 2 and 3 units (5
# units over 3 replicas: the 3-unit sample is cut), mb 1 two 1-unit samples (fewer units
# than replicas), mb 2 and mb 4 are text-only, mb 3 is sample 7 alone (2 units shared by
# two replicas, the third idle).


@pytest.mark.parametrize("config", [CONFIG, NEWLINE_CONFIG], ids=["plain", "image_newline"])
def test_encoder_dp3_shares_single_samples_units_and_matches_single_process(config):
    layout, plan, _ = _step_inputs(LAYOUT_C, ASSIGN_C, config)
    mb0, mb1, mb2, mb3, mb4 = plan.microbatches
    assert sorted(s.units for s in mb0.encoder) == [1, 2, 2]
    assert mb0.split.num_pieces == 3  # two samples, the larger cut in two
    assert sorted(s.units for s in mb1.encoder) == [0, 1, 1]
    assert mb2.is_text_only and mb4.is_text_only
    assert all(s.is_empty for s in mb2.encoder + mb4.encoder)
    assert sorted(s.units for s in mb3.encoder) == [0, 1, 1]
    pieces = sorted((int(s.sample_ids[0]), int(s.first_unit[0])) for s in mb3.encoder if s.units)
    assert pieces == [(7, 0), (7, 1)]
    results = spawn_local(
        _rank_step,
        layout.world_size,
        args=(LAYOUT_C, ASSIGN_C, False, False, config),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    _check_against_reference(results, config)
    if config.decoder.image_newline:  # trained on the LLM's first stage, and only there
        (newline,) = [
            r["grads"]["decoder.image_newline"]
            for r in results
            if "decoder.image_newline" in r["grads"]
        ]
        assert np.abs(newline).max() > 0


def test_llm_dp2_matches_single_process():
    """3 ranks: the encoder (rank 0); LLM replicas 0, 1 (ranks 1, 2); a text-only microbatch."""
    results = spawn_local(
        _rank_step,
        3,
        args=(LAYOUT_B, ASSIGN_B, False, False),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    _check_against_reference(results)


# debug=True: shape headers on every message of a correct run change nothing; debug=False:
# receives are posted one action ahead (gloo), in every stage position.
@pytest.mark.slow
@pytest.mark.parametrize("debug", [True, False])
def test_both_modules_pipelined_and_replicated(debug):
    """6 ranks: encoder pp=2 (ranks 0, 1); LLM dp=2 x pp=2 (ranks 2-5)."""
    spec = dict(encoder_pp=2, llm_dp=2, llm_pp=2, num_microbatches=2)
    results = spawn_local(
        _rank_step,
        6,
        args=(spec, ASSIGN_B, debug, False),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    _check_against_reference(results)


# Frozen parts: encoder pp=2 + LLM pp=2 (4 ranks), encoder dp=2 + LLM pp=2 (4 ranks),
# and tensor parallelism in both modules with encoder pp=2 (6 ranks: 240 s limit).
FROZEN_LAYOUTS = {
    "enc_pp2": (dict(encoder_pp=2, llm_pp=2, num_microbatches=4), ASSIGN_A, 4),
    "enc_dp2": (LAYOUT_A, ASSIGN_A, 4),
    "tp2": (dict(encoder_pp=2, encoder_tp=2, llm_tp=2, num_microbatches=4), ASSIGN_A, 6),
}


FROZEN_REGIMES = ["projector", "frozen-vision", "encoder=full,projector=frozen,llm=frozen"]


@pytest.mark.parametrize(
    "layout, trainable",
    [(layout, t) for layout in ("enc_pp2", "enc_dp2") for t in FROZEN_REGIMES]
    + [("tp2", "frozen-vision")],  # tensor parallelism: one regime
)
def test_frozen_parts_match_single_process_and_run_no_backward_there(layout, trainable):
    """Loss and every trainable gradient equal one process's with the same parts frozen;
    frozen parameters get no gradient; a stage with nothing trainable at or before it
    runs no backward pass (counted), the others do."""
    spec, assignment, world = FROZEN_LAYOUTS[layout]
    results = spawn_local(
        _rank_step,
        world,
        args=(spec, assignment, False, False, CONFIG, "cpu", None, trainable),
        timeout_s=240 if layout == "tp2" else SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    _check_against_reference(results, trainable=trainable)
    parts = TrainableParts.parse(trainable)
    for r in results:
        runs_backward = parts.stage_backward(r["module"], r["is_last_stage"])
        assert (r["backward_passes"] > 0) == runs_backward, (r["module"], r["is_last_stage"])
        if not runs_backward:
            assert r["trainable_params"] == 0 and not r["grads"]


@pytest.mark.slow
@pytest.mark.parametrize("debug", [True, False])
def test_tensor_parallel_both_modules_matches_single_process(debug):
    # Encoder tp=2, LLM tp=2 x pp=2 (6 ranks): the bridge runs on TP rank 0 and broadcasts
    # within the TP group; activations are replicated across TP ranks.
    spec = dict(encoder_tp=2, llm_tp=2, llm_pp=2, num_microbatches=4)
    results = spawn_local(
        _rank_step, 6, args=(spec, ASSIGN_A, debug, False), timeout_s=240, num_threads=1
    )
    _check_against_reference(results)


def test_debug_mode_reports_a_shape_mismatch():
    """Encoder pp=2: rank 1's plan disagrees with rank 0's; the header check names both."""
    spec = dict(encoder_pp=2, num_microbatches=2)
    with pytest.raises(
        SpawnError, match=r"rank 1 expected the activation of microbatch 0 .*shape: sent \("
    ):
        spawn_local(
            _rank_step,
            3,
            args=(spec, [0, 0, 1, 1, 0, 1, 1, 0], True, True),
            timeout_s=SPAWN_TIMEOUT_S,
            num_threads=1,
        )


# ---------------------------------------------------------------- programs the engine runs


def _split_backward(program: PipelineProgram, stage: int) -> PipelineProgram:
    """``program`` with every B of physical ``stage`` split into I then W (still valid)."""
    split = tuple(
        b
        for a in program.actions[stage]
        for b in (
            [PipelineAction(a.stage, "I", a.microbatch), PipelineAction(a.stage, "W", a.microbatch)]
            if a.kind == "B"
            else [a]
        )
    )
    actions = list(program.actions)
    actions[stage] = split
    return PipelineProgram(program.num_microbatches, program.owner, tuple(actions))


def _with_kind(program: PipelineProgram, stage: int, index: int, kind: str) -> PipelineProgram:
    actions = [list(a) for a in program.actions]
    v, _, j = actions[stage][index]
    actions[stage][index] = PipelineAction(v, kind, j)
    return PipelineProgram(program.num_microbatches, program.owner, tuple(map(tuple, actions)))


def test_check_executable_takes_every_action_kind_and_refuses_the_rest():
    program = pipeline_program("interleaved-1f1b", [1, 2], 4, chunks=[1, 2])
    check_executable(program)
    check_executable(_split_backward(program, 2))  # I and W
    with pytest.raises(
        UnsupportedActionError,
        match=r"stage 1, action 0 has kind 'X', not an action kind the runtime executes "
        r"\(F, B, I, W\)",
    ):
        check_executable(_with_kind(program, 1, 0, "X"))


# Case (e): the smallest pipeline, encoder -> LLM (2 ranks), 2 microbatches.
LAYOUT_E = dict(num_microbatches=2)
ASSIGN_E = [0, 1, 0, 1, 0, 1, 0, 1]


def _engine_refusal(rank: int, world_size: int, spec: dict):
    """Builds the engine with an edited program of the layout on every rank: the message
    each rank refused it with (None: accepted)."""
    layout = _layout(spec)
    topology = Topology.create(layout, rank)
    info = topology.info
    stage = build_stage(CONFIG, info, seed=MODEL_SEED, tp_group=topology.tp_group, layout=layout)
    stages, chunks = layout.pipeline_stages
    program = pipeline_program("1f1b", stages, layout.num_microbatches, chunks=chunks)
    try:
        PipelineEngine(topology, stage, program=_with_kind(program, 1, 2, "Z"))
    except UnsupportedActionError as error:
        return str(error)
    return None


def test_the_engine_refuses_a_program_it_cannot_run_on_every_rank():
    """The engine of every rank (a real topology in a thread world) refuses the program
    before anything runs, the ranks that hold no such action too."""
    results = spawn_threads(_engine_refusal, 2, args=(LAYOUT_E,), timeout_s=60.0)
    assert len(results) == 2 and results[0] == results[1]
    assert re.search(r"stage 1, action 2 has kind 'Z', not an action kind", results[0])


def _step_refusal(rank: int, world_size: int, spec: dict, assignment: list[int]):
    """run_step of an engine whose generated program holds an unknown kind: (message,
    whether the step's clock started)."""
    layout, plan, batch = _step_inputs(spec, assignment)
    topology = Topology.create(layout, rank)
    info = topology.info
    stage = build_stage(CONFIG, info, seed=MODEL_SEED, tp_group=topology.tp_group, layout=layout)
    engine = PipelineEngine(topology, stage)
    try:
        engine.run_step(plan, batch)
    except UnsupportedActionError as error:
        return str(error), hasattr(engine, "clock")
    return None, True


def test_run_step_refuses_a_generated_program_it_cannot_run_before_anything_runs(monkeypatch):
    """A pipeline-order generator that emits an action kind the engine lacks: run_step
    refuses the whole program on every rank before the step starts."""
    real = engine_module.pipeline_program
    monkeypatch.setattr(
        engine_module,
        "pipeline_program",
        lambda *args, **kwargs: _with_kind(real(*args, **kwargs), 1, 1, "Z"),
    )
    results = spawn_threads(_step_refusal, 2, args=(LAYOUT_E, ASSIGN_E), timeout_s=60.0)
    for message, started in results:
        assert "stage 1, action 1 has kind 'Z'" in message
        assert not started


# ---------------------------------------------------------------- zero-bubble: I and W

# (layout, assignment, world size, trainable parts): the split backward on encoder
# replicas and an LLM pipeline, behind a frozen tower (no input gradient on the encoder),
# with only the projector training.
ZERO_BUBBLE_CASES = {
    "enc_dp2_llm_pp2": (LAYOUT_A, ASSIGN_A, 4, "full"),
    "frozen_vision-enc_pp2": (*FROZEN_LAYOUTS["enc_pp2"][:2], 4, "frozen-vision"),
    "projector-enc_pp2": (*FROZEN_LAYOUTS["enc_pp2"][:2], 4, "projector"),
    # ... and under tensor parallelism (DTensor blocks), with activation recompute on
    # both modules (each block's forward again inside the split backward).
    "tp2-recompute": (
        dict(FROZEN_LAYOUTS["tp2"][0], encoder_recompute=True, llm_recompute=True),
        FROZEN_LAYOUTS["tp2"][1],
        6,
        "full",
    ),
}


@pytest.mark.parametrize("case", ZERO_BUBBLE_CASES)
def test_zero_bubble_h1_matches_single_process(case):
    """ZB-H1 (I and W actions) runs its program and gives one process's loss and
    gradients, frozen parts included."""
    spec, assignment, world, trainable = ZERO_BUBBLE_CASES[case]
    results = spawn_local(
        _rank_step,
        world,
        args=(spec, assignment, False, False, CONFIG, "cpu", None, trainable, "zb-h1"),
        timeout_s=240 if world > 4 else SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    _check_against_reference(results, trainable=trainable)  # the ZB-H1 program, exactly
    assert {a.kind for r in results for a in r["actions"]} == {"F", "I", "W"}
    for r in results:
        assert r["recomputed"] == [bool(spec.get(f"{r['module']}_recompute"))], r["recomputed"]


# Colocated layouts (the encoder inside the LLM's first stage, no ranks of its own):
# (layout, assignment, world size, trainable parts, pipeline order); two microbatches.
COLOCATED_CASES = {
    "dp2_pp2-full-1f1b": (dict(llm_dp=2, llm_pp=2), ASSIGN_B, 4, "full", None),
    # ... with the LLM's and the encoder's blocks recomputed in the backward.
    "dp2_pp2-frozen_vision-zb_h1-recompute": (
        dict(llm_dp=2, llm_pp=2, llm_recompute=True),
        ASSIGN_B,
        4,
        "frozen-vision",
        "zb-h1",
    ),
    "dp2_pp1-projector": (dict(llm_dp=2), ASSIGN_B, 2, "projector", None),
    "tp2_pp2-full": (dict(llm_tp=2, llm_pp=2), [0, 1, 1, 0, 0, 1, 1, 0], 4, "full", None),
}


@pytest.mark.parametrize("case", COLOCATED_CASES)
def test_colocated_layout_matches_single_process(case):
    """The first LLM stage runs the encoder on its own samples' images: one process's loss
    and gradients (encoder ones included, all-reduced over the LLM's replicas and sharded
    over its TP group), with frozen parts and under ZB-H1 too; no bridge, no encoder rank."""
    spec, assignment, world, trainable, order = COLOCATED_CASES[case]
    spec = dict(spec, num_microbatches=2, colocated=True)
    layout = _layout(spec)
    assert layout.world_size == world and layout.bridge_ranks == ()
    results = spawn_local(
        _rank_step,
        world,
        args=(spec, assignment, False, False, CONFIG, "cpu", None, trainable, order),
        timeout_s=SPAWN_TIMEOUT_S * 2,
        num_threads=1,
    )
    _check_against_reference(results, trainable=trainable)
    parts = TrainableParts.parse(trainable)
    for rank, r in enumerate(results):
        assert r["module"] == "llm"
        assert r["holds_encoder"] == (rank_info(layout, rank).pp_rank == 0)
        encoder_grads = [n for n in r["grads"] if n.startswith("vision.")]
        assert bool(encoder_grads) == (r["holds_encoder"] and parts.bridge_gradients)
        recompute = bool(spec.get("llm_recompute"))
        assert r["recomputed"] == [recompute] * (2 if r["holds_encoder"] else 1)


def _both_orders(rank: int, world_size: int, spec: dict, assignment: list[int]):
    """The same stage runs a 1F1B step, then two ZB-H1 steps (nothing of one step's
    messages left for the next): the steps' gradients."""
    layout, plan, batch = _step_inputs(spec, assignment)
    topology = Topology.create(layout, rank)
    stage = build_stage(
        CONFIG, topology.info, seed=MODEL_SEED, tp_group=topology.tp_group, layout=layout
    )
    out = {}
    zero_bubble = PipelineEngine(topology, stage, order="zb-h1")
    for name, engine in [
        ("1f1b", PipelineEngine(topology, stage, order="1f1b")),
        ("zb-h1", zero_bubble),
        ("zb-h1 again", zero_bubble),
    ]:
        result = engine.run_step(plan, batch)
        grads = {n: p.grad.numpy().copy() for n, p in stage.named_parameters()}
        out[name] = (result.loss_sum, grads)
    return out


def test_zero_bubble_h1_gradients_equal_1f1b():
    """On the same ranks and weights, ZB-H1's gradients equal 1F1B's to float32 rounding
    (each weight gradient is the same product, accumulated in the same microbatch order)."""
    results = spawn_local(
        _both_orders, 4, args=(LAYOUT_A, ASSIGN_A), timeout_s=SPAWN_TIMEOUT_S, num_threads=1
    )
    for r in results:
        loss_1f1b, grads_1f1b = r["1f1b"]
        for steps in ("zb-h1", "zb-h1 again"):
            loss_zb, grads_zb = r[steps]
            assert loss_zb == loss_1f1b
            assert grads_zb.keys() == grads_1f1b.keys()
            for name, grad in grads_zb.items():
                np.testing.assert_allclose(
                    grad, grads_1f1b[name], rtol=1e-6, atol=1e-9, err_msg=name
                )


def test_a_program_loaded_from_a_file_runs_and_matches_single_process(tmp_path):
    """GPipe instead of the layout's 1F1B, from a file: the engine runs exactly it, and the
    step gives the single-process loss and gradients."""
    layout = _layout(LAYOUT_A)
    stages, chunks = layout.pipeline_stages
    program = pipeline_program("gpipe", stages, layout.num_microbatches, chunks=chunks)
    assert program != pipeline_program("1f1b", stages, layout.num_microbatches, chunks=chunks)
    path = tmp_path / "gpipe.txt"
    save_program(program, path)
    results = spawn_threads(
        _rank_step,
        layout.world_size,
        args=(LAYOUT_A, ASSIGN_A, False, False, CONFIG, "cpu", str(path)),
        timeout_s=60.0,
    )
    _check_against_reference(results)
    assert [r["expected_actions"] for r in results][-1] == list(program.actions[-1])


# ---------------------------------------------------------------- single-process parts


def test_step_plan_shapes_and_split():
    layout, plan, batch = _step_inputs(LAYOUT_A, ASSIGN_A)
    assert plan.num_target_tokens == int(batch.target_tokens().sum())
    text_only = plan.microbatches[1]
    assert text_only.is_text_only
    assert all(share.is_empty for share in text_only.encoder)
    for mb in plan.microbatches:
        encoded = np.concatenate([s.sample_ids for s in mb.encoder])
        np.testing.assert_array_equal(np.unique(encoded), mb.visual_sample_ids)
        units = np.zeros(len(UNITS), np.int64)  # every unit of every sample exactly once
        for share in mb.encoder:
            assert share.feature_rows == share.units * TPU
            assert share.units == share.num_units.sum()
            np.add.at(units, share.sample_ids, share.num_units)
        np.testing.assert_array_equal(units[mb.visual_sample_ids], UNITS[mb.visual_sample_ids])
        # Balanced by unit: ceil(units / 2) on the busier encoder replica.
        assert max(s.units for s in mb.encoder) == -(-int(UNITS[mb.visual_sample_ids].sum()) // 2)
        (llm,) = mb.llm
        assert llm.tokens == int((UNITS[llm.sample_ids] * TPU + TEXT[llm.sample_ids]).sum())
        assert llm.visual_rows == sum(s.feature_rows for s in mb.encoder)
    # Microbatch 3 holds one image sample of two tiles: each encoder replica gets a tile.
    mb3 = plan.microbatches[3]
    assert [s.units for s in mb3.encoder] == [1, 1]
    assert [(int(s.sample_ids[0]), int(s.first_unit[0])) for s in mb3.encoder] in (
        [(7, 0), (7, 1)],
        [(7, 1), (7, 0)],
    )
    # Deterministic: a second build is identical.
    _, again, _ = _step_inputs(LAYOUT_A, ASSIGN_A)
    for a, b in zip(plan.microbatches, again.microbatches):
        for sa, sb in zip(a.encoder, b.encoder):
            np.testing.assert_array_equal(sa.sample_ids, sb.sample_ids)
            np.testing.assert_array_equal(sa.first_unit, sb.first_unit)


def test_a_colocated_step_plan_encodes_each_replicas_own_samples():
    """Colocated: replica r's encoder share is its LLM share's visual samples, whole, in
    the LLM's packing order (its placeholders' order), so its features need no routing."""
    _, plan, _ = _step_inputs(dict(LAYOUT_B, colocated=True), ASSIGN_B)
    for mb in plan.microbatches:
        assert len(mb.encoder) == len(mb.llm) == 2
        for encoder, llm in zip(mb.encoder, mb.llm):
            visual = llm.sample_ids[UNITS[llm.sample_ids] > 0]
            np.testing.assert_array_equal(encoder.sample_ids, visual)
            np.testing.assert_array_equal(encoder.first_unit, 0)
            np.testing.assert_array_equal(encoder.num_units, UNITS[visual])
            assert encoder.feature_rows == llm.visual_rows == UNITS[visual].sum() * TPU
        np.testing.assert_array_equal(mb.split.replica, mb.piece_llm_replica)


def test_synthetic_batch_is_deterministic_per_sample():
    batch = SyntheticBatch(_shapes(), CONFIG, seed=DATA_SEED)
    both = batch.pixel_values([0, 1])
    assert both.shape == (3, CONFIG.vision.channels, 32, 32)
    assert torch.equal(both[2:], batch.pixel_values([1]))
    # A piece renders just its units, identical to the whole sample's.
    assert torch.equal(batch.pixel_values([4], [1], [2]), batch.pixel_values([4])[1:3])
    pieces = batch.pixel_values([0, 4], [1, 0], [1, 1])
    assert torch.equal(pieces[0], both[1]) and torch.equal(pieces[1], batch.pixel_values([4])[0])
    with pytest.raises(ValueError, match=r"units \[2, 4\) are out of its 3 units"):
        batch.pixel_values([4], [2], [2])
    text = batch.text_inputs([4, 0])
    assert text.cu_seqlens.tolist() == [0, 3 * TPU + 8, 3 * TPU + 8 + 2 * TPU + 10]
    assert int(text.image_token_mask.sum()) == 5 * TPU
    assert bool((text.labels[text.image_token_mask] == -100).all())
    single = batch.text_inputs([0])
    assert torch.equal(text.token_ids[3 * TPU + 8 :], single.token_ids)


def test_fitted_shape_scaler_keeps_relative_sizes():
    from dflop.data import synthetic_shapes

    raw = synthetic_shapes(2048, seed=3)
    scaler = ShapeScaler.fitted(CONFIG, raw, max_units_per_sample=8, max_text_tokens=128)
    scaled = scaler.scale(raw)
    # Only the tail above the 99th percentile reaches the caps; the rest keeps its order.
    assert (scaled.encoder_units == 8).mean() <= 0.05 and scaled.encoder_units.max() == 8
    assert (scaled.text_tokens == 128).mean() <= 0.05
    visual = raw.encoder_units > 0
    order = np.argsort(raw.encoder_units[visual], kind="stable")
    assert np.all(np.diff(scaled.encoder_units[visual][order]) >= 0)
    assert ((scaled.encoder_units > 0) == visual).all()
    fixed = ShapeScaler.fitted(CONFIG, raw, unit_divisor=1)
    assert fixed.unit_divisor == 1 and fixed.text_divisor > 1
    with pytest.raises(ValueError, match="quantile"):
        ShapeScaler.fitted(CONFIG, raw, quantile=0.0)


def test_shape_scaler_conforms_shapes_to_the_model():
    from dflop.data import synthetic_shapes

    scaled = ShapeScaler.for_model(CONFIG).scale(synthetic_shapes(64, seed=1))
    assert (scaled.llm_visual_tokens == scaled.encoder_units * TPU).all()
    assert scaled.encoder_units.max() <= 4 and scaled.text_tokens.max() <= 64
    assert ((scaled.encoder_units > 0) == (scaled.modality != Modality.TEXT)).all()
    SyntheticBatch(scaled, CONFIG)  # accepted as is
    # The newline model's placeholders: one more per visual sample, and only for it.
    newline = ShapeScaler.for_model(NEWLINE_CONFIG).scale(synthetic_shapes(64, seed=1))
    assert (
        newline.llm_visual_tokens == scaled.llm_visual_tokens + (scaled.encoder_units > 0)
    ).all()
    SyntheticBatch(newline, NEWLINE_CONFIG)
    with pytest.raises(ValueError, match=r"x 16 tokens per unit \+ 1 newline of the model"):
        SyntheticBatch(scaled, NEWLINE_CONFIG)
