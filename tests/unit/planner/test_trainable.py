"""The planner prices the training regime the runtime runs (``--trainable``).

Frozen parts: no backward where nothing trained comes before them (and then no kept
activations and no gradient sent back to them), a backward without weight gradients where
a trained part before them needs the gradient, and neither gradients, optimizer state nor
an all-reduce for their weights. Checked on the planner's own step model (the functions
``dflop train`` predicts its steps with), by the arithmetic of the model's documented
rules, and on the paper's 64-GPU setting: a frozen tower gets fewer GPUs.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from dflop.data.costs import AnalyticCostModel
from dflop.data.synthetic import synthetic_shapes
from dflop.models import model_config
from dflop.models.trainable import PRESETS, TrainableParts
from dflop.planner import (
    ClusterSpec,
    PlannerConfig,
    StepPredictor,
    choose_layouts,
    full_training_forward_fraction,
    plan,
    prepare_inputs,
    regime_forward_fraction,
    with_trainable,
)
from dflop.planner.inputs import single_batch_inputs
from dflop.planner.model import WEIGHT_GRAD_FRACTION, PlannerModule, lora_params_per_layer
from dflop.runtime.topology import RuntimeLayout
from dflop.train.calibration import OnlineCalibration
from dflop.train.planning import MemoryBudget, core_layout, cost_configs, local_cluster

CONFIG = model_config("tiny")
PASS_ON = 1.0 - WEIGHT_GRAD_FRACTION  # a frozen layer's backward that passes gradients on


def _module() -> PlannerModule:
    return PlannerModule(num_layers=4, num_heads=4, hidden_size=64, params_per_layer=1e6)


@pytest.mark.parametrize(
    ("trainable", "encoder", "llm"),
    [
        # (body backward, last backward, body trains, last trains) per module
        ("full", (1, 1, 1, 1), (1, 1, 1, 1)),
        ("frozen-vision", (0, 1, 0, 1), (1, 1, 1, 1)),
        ("projector", (0, 1, 0, 1), (PASS_ON, PASS_ON, 0, 0)),
        ("encoder=full,projector=frozen", (1, PASS_ON, 1, 0), (1, 1, 1, 1)),
        ("encoder=frozen,projector=frozen", (0, 0, 0, 0), (1, 1, 1, 1)),
        ("llm=frozen", (1, 1, 1, 1), (PASS_ON, PASS_ON, 0, 0)),
    ],
)
def test_regime_factors(trainable: str, encoder: tuple, llm: tuple) -> None:
    enc, lm = with_trainable(_module(), _module(), trainable)
    for module, expected in ((enc, encoder), (lm, llm)):
        got = (
            module.body_backward_factor,
            module.last_backward_factor,
            module.body_trainable_fraction,
            module.last_trainable_fraction,
        )
        assert got == pytest.approx(expected)
    # The runtime's rule: a stage runs a backward exactly where the factor is not 0.
    parts = TrainableParts.parse(trainable)
    assert parts.stage_backward("encoder", is_last_stage=False) == (enc.body_backward_factor > 0)
    assert parts.stage_backward("encoder", is_last_stage=True) == (
        enc.body_backward_factor > 0 or enc.last_backward_factor > 0
    )
    # What the trainer's scheduler simulates (PipelineModel.backward) is the same rule.
    first, last = (parts.stage_backward("encoder", is_last_stage=x) for x in (False, True))
    assert enc.backward_stages == ("all" if first else "last" if last else "none")
    # A frozen LLM behind a trained part runs its backward only for visual rows.
    assert lm.backward_needs_visual == (not parts.trains("llm") and trainable != "full")


def test_lora_prices_adapters_and_a_pass_through_backward() -> None:
    encoder, llm = cost_configs(CONFIG)
    enc_lora, llm_lora = lora_params_per_layer(encoder, llm, rank=4)
    h, i = llm.hidden_size, llm.intermediate_size
    kv = llm.num_kv_heads * (llm.head_dim or h // llm.num_heads)
    q = llm.num_heads * (llm.head_dim or h // llm.num_heads)
    # q, k, v, o, gate, up, down: rank x (inputs + outputs)
    assert llm_lora == 4 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    base = _module()
    enc, lm = with_trainable(base, base, "lora", lora_params=(enc_lora, llm_lora))
    assert enc == with_trainable(base, base, "frozen-vision")[0]  # the tower is frozen
    assert lm.params_per_layer == base.params_per_layer + llm_lora
    assert lm.body_trainable_fraction == pytest.approx(llm_lora / lm.params_per_layer)
    assert lm.last_trainable_fraction == 0.0  # the LM head is frozen
    assert lm.body_backward_factor == PASS_ON  # the adapters' own backward: rank-sized
    assert lm.kept_activation_fraction == 1.0  # the adapters need the layers' inputs


def test_planner_config_names_the_regime() -> None:
    assert PlannerConfig(trainable="Frozen-Vision").trainable == "frozen-vision"
    custom = PlannerConfig(trainable="encoder=frozen").trainable
    assert custom == "frozen-vision"  # the same regime, spelt as its preset
    with pytest.raises(ValueError, match=r"PlannerConfig.trainable: .*'decoder' is not a part"):
        PlannerConfig(trainable="decoder=frozen")


@pytest.mark.parametrize("trainable", [*PRESETS, "llm=frozen"])
def test_forward_shares_convert_both_ways(trainable: str) -> None:
    full = (0.3, 0.35)
    shares = regime_forward_fraction(full, trainable)
    back = full_training_forward_fraction(shares, trainable, default=(0.25, 0.25))
    parts = TrainableParts.parse(trainable)
    # A module whose layers run no backward measures 1 and keeps the default.
    assert shares[0] == (pytest.approx(0.3) if parts.trains("encoder") else 1.0)
    assert back[0] == pytest.approx(0.3 if parts.trains("encoder") else 0.25)
    assert back[1] == pytest.approx(0.35)
    if not parts.trains("llm"):  # forward / (forward + half the backward)
        assert shares[1] == pytest.approx(0.35 / (0.35 + 0.65 * PASS_ON))
    calibration = OnlineCalibration(full, trainable)
    assert calibration.shares == pytest.approx(shares)
    assert calibration.full_training_shares == pytest.approx(full)


class MeasuredPassthrough(AnalyticCostModel):
    """A cost model that measured what a frozen layer passing gradients on runs and
    keeps (as ``dflop profile-model`` does): here a quarter of the backward and all of
    its activations."""

    passthrough_factors = {
        "forward_fraction": (1 / 3, 1 / 3),
        "backward": (0.25, 0.25),
        "activations": (1.0, 1.0),
    }


def _predictor(trainable: str, **layout: int) -> StepPredictor:
    """The planner's model of the tiny model's steps under ``layout`` (4 microbatches of a
    global batch of 8) and the regime ``trainable``."""
    encoder, llm = cost_configs(CONFIG)
    runtime = RuntimeLayout.simple(
        encoder_layers=CONFIG.vision.layers,
        llm_layers=CONFIG.decoder.layers,
        num_microbatches=4,
        global_batch=8,
        **layout,
    )
    cluster = local_cluster(runtime.world_size, MemoryBudget(8e9, 0.0, "test"))
    config = PlannerConfig(num_batches=1, trainable=trainable)
    return StepPredictor(cluster, encoder, llm, core_layout(runtime), config)


def _step(trainable: str, cost_model_type: type = AnalyticCostModel, **layout: int):
    """The planner's model of one batch on the tiny model under ``layout``: (audit, stage
    memory, predictor inputs)."""
    encoder, llm = cost_configs(CONFIG)
    cost_model = cost_model_type(encoder, llm)
    predictor = _predictor(trainable, **layout)
    batch = synthetic_shapes(8, seed=3)
    assignment = np.arange(8) % 4
    audit = predictor.audit(cost_model, batch, assignment)
    memory = predictor.stage_memory_bytes(cost_model, batch, assignment)
    inputs = single_batch_inputs(
        cost_model, encoder, llm, batch, element_bytes=predictor.config.element_bytes,
        trainable=trainable,
    )  # fmt: skip
    return audit, memory, inputs


def test_frozen_tower_runs_forward_only_and_gets_no_gradient() -> None:
    full, full_memory, _ = _step("full", encoder_pp=2, llm_pp=2)
    frozen, frozen_memory, inputs = _step("frozen-vision", encoder_pp=2, llm_pp=2)
    f = inputs.encoder.forward_fraction
    # Forwards are priced alike; the tower's first stage runs no backward at all, its last
    # only the projector's; the LLM trains in both.
    np.testing.assert_allclose(frozen.encoder_forward_s, full.encoder_forward_s, rtol=1e-12)
    assert not frozen.encoder_backward_s[:, 0].any()
    busy = full.encoder_forward_s[:, 0] > 0
    np.testing.assert_allclose(
        full.encoder_backward_s[:, 0][busy], full.encoder_forward_s[:, 0][busy] * (1 - f) / f
    )
    # The last stage loses its layers' backward (as large as the first stage's layers':
    # the split is even) and keeps the projector's and its constant's.
    constant_backward = (1 - f) * inputs.encoder.microbatch_constant_s / 2
    layers_backward = np.where(busy, full.encoder_backward_s[:, 0] - constant_backward, 0.0)
    np.testing.assert_allclose(
        full.encoder_backward_s[:, 1] - frozen.encoder_backward_s[:, 1], layers_backward, rtol=1e-9
    )
    np.testing.assert_allclose(frozen.llm_backward_s, full.llm_backward_s, rtol=1e-12)
    # No gradient goes back over the tower's inner link (the projector's input needs
    # none); the bridge and the LLM's link carry them.
    assert frozen.gradient_links.tolist() == [0, 1, 1]
    assert full.gradient_links.size == 0
    # The first encoder stage's B no longer waits for the LLM: the step is shorter.
    assert frozen.step_time_s < full.step_time_s
    # Nothing to all-reduce on a frozen stage (one replica here: nothing anyway).
    assert frozen.allreduce_s[0] == 0.0
    # Memory: the frozen stage keeps its weights only, and no activations.
    assert frozen_memory[0] < full_memory[0]
    assert frozen_memory[2:] == pytest.approx(full_memory[2:])


def test_a_frozen_llm_keeps_nothing_of_a_text_only_microbatch() -> None:
    """Under ``projector`` a microbatch without visual rows runs no LLM backward, so the
    memory model keeps none of its activations, only one layer's at a time while its
    forward runs: making it the largest microbatch (100x its text) adds at most that one
    layer to the LLM stage's memory; a trained LLM keeps all its layers' of it."""
    encoder, llm = cost_configs(CONFIG)
    cost_model = AnalyticCostModel(encoder, llm)
    batch = synthetic_shapes(8, seed=3)
    assignment = np.arange(8) % 4
    text_only = assignment == 0
    assert not batch.encoder_units[text_only].any() and batch.encoder_units[~text_only].all()
    text = batch.text_tokens.copy()
    text[text_only] *= 100
    longer = replace(batch, text_tokens=text)
    inputs = single_batch_inputs(cost_model, encoder, llm, longer)
    one_layer = (
        inputs.samples["llm_tokens"][text_only].sum() * inputs.llm.activation_bytes_per_token_layer
    )
    growth = {}
    for trainable in ("frozen-vision", "projector"):
        predictor = _predictor(trainable)
        before, after = (
            predictor.stage_memory_bytes(cost_model, shapes, assignment)[-1]
            for shapes in (batch, longer)
        )
        growth[trainable] = after - before
    assert 0 < growth["projector"] <= one_layer
    assert growth["frozen-vision"] > one_layer  # it keeps every layer's


@pytest.mark.parametrize(
    ("cost_model_type", "backward"), [(AnalyticCostModel, PASS_ON), (MeasuredPassthrough, 0.25)]
)
def test_frozen_llm_backward_skips_the_weight_gradients(cost_model_type, backward) -> None:
    full, full_memory, inputs = _step("full", cost_model_type)
    frozen, frozen_memory, _ = _step("projector", cost_model_type)
    f = inputs.llm.forward_fraction
    constant = inputs.llm.microbatch_constant_s * (1 - f)  # one stage: the whole module's
    np.testing.assert_allclose(frozen.llm_forward_s, full.llm_forward_s, rtol=1e-12)
    # A microbatch with visual rows passes the loss's gradient on to them; one without
    # runs no LLM backward at all (the runtime's engine skips it).
    visual = frozen.encoder_forward_s > 0  # (replica, stage, microbatch); one stage each
    assert visual.any() and not visual.all()
    np.testing.assert_allclose(
        frozen.llm_backward_s[visual] - constant,
        (full.llm_backward_s[visual] - constant) * backward,
        rtol=1e-9,
    )
    assert not frozen.llm_backward_s[~visual].any()
    assert frozen.gradient_links.size == 0  # the projector needs the LLM's gradient
    # A frozen LLM holds its weights only: (16 - element bytes) per parameter less; and,
    # by default, a third fewer activations (a frozen linear keeps no input).
    states = inputs.llm.num_params * (16.0 - inputs.llm.element_bytes)
    saved = full_memory[1] - frozen_memory[1]
    if cost_model_type is MeasuredPassthrough:  # measured: every activation kept
        assert saved == pytest.approx(states, rel=1e-9)
    else:
        assert saved > states * 1.5


def test_frozen_tower_gets_fewer_gpus_in_the_paper_setting() -> None:
    """vit-6b + llm-7b on 64 GPUs (bench_plan's first setting): a frozen tower costs a
    forward, so dflop gives it fewer GPUs and the step is shorter; the data-blind baseline
    trained the same way is still slower."""
    cluster = ClusterSpec(num_gpus=64, gpus_per_node=8, gpu_memory_bytes=80e9)
    model = AnalyticCostModel("vit-6b", "llm-7b")
    chosen = {}
    for trainable in ("full", "frozen-vision"):
        config = PlannerConfig(num_batches=2, top_k=1, trainable=trainable)
        inputs = prepare_inputs(
            model, model.encoder, model.llm, global_batch=256, num_batches=2, trainable=trainable
        )
        dflop, _ = choose_layouts(cluster, inputs, config, strategy="data_aware")
        blind, _ = choose_layouts(cluster, inputs, config, strategy="data_blind")
        assert dflop[0].prediction.step_time_s < blind[0].prediction.step_time_s
        chosen[trainable] = dflop[0]
    assert chosen["frozen-vision"].encoder.num_gpus < chosen["full"].encoder.num_gpus
    assert chosen["frozen-vision"].prediction.step_time_s < chosen["full"].prediction.step_time_s


def test_plans_record_the_regime() -> None:
    model = AnalyticCostModel("siglip-400m", "llm-7b")
    result = plan(
        model,
        model.encoder,
        model.llm,
        ClusterSpec(num_gpus=8),
        global_batch=32,
        config=PlannerConfig(num_batches=1, top_k=1, trainable="projector"),
    )
    assert result.inputs["trainable"] == "projector"
    assert "priced for training projector" in result.table()


class MeasuredForward(AnalyticCostModel):
    """A profiled model whose forward passes measured 40% (encoder) and 30% (LLM) of
    forward + backward."""

    passthrough_factors = {"forward_fraction": (0.4, 0.3), "backward": None, "activations": None}


def test_the_planner_prices_the_profilers_measured_forward_share() -> None:
    """PlannerConfig.forward_fraction=None takes the profiler's measured shares (the plan
    records them); an explicit value wins; without a measurement, 1/3."""
    encoder, llm = cost_configs(CONFIG)
    measured = MeasuredForward(encoder, llm)

    def shares(model, fractions=None):
        kw = dict(global_batch=8, num_batches=1)
        return prepare_inputs(model, encoder, llm, forward_fraction=fractions, **kw)

    assert shares(measured).forward_fraction == pytest.approx((0.4, 0.3))
    assert shares(measured, (0.25, 0.5)).forward_fraction == pytest.approx((0.25, 0.5))
    assert shares(AnalyticCostModel(encoder, llm)).forward_fraction == pytest.approx((1 / 3,) * 2)
    config = PlannerConfig(num_batches=1, top_k=1)
    result = plan(measured, encoder, llm, ClusterSpec(num_gpus=2), global_batch=8, config=config)
    assert result.inputs["forward_fraction"] == pytest.approx([0.4, 0.3])
