"""Plans are auditable, and the trainer derives what the plan predicted.

For encoder DP 1, 2 and 3, on batches with microbatches that hold fewer samples, and
fewer visual units, than there are encoder replicas (and a video that must be shared):
the plan records every sampled batch's schedule, encoder split and per-(replica, stage,
microbatch) times; re-simulating the records gives the plan's step times; and the
trainer's own derivation (``StepPlan.build`` for the split the runtime executes, the
``StepPredictor`` it predicts with, its layout and cost-config conversions), given the same
batch, schedule and cost model, gives the same split and the same times.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from dflop.data.costs import AnalyticCostModel
from dflop.data.shapes import Modality, SampleShapes
from dflop.models import model_config
from dflop.planner import (
    Plan,
    PlannerConfig,
    StepAudit,
    StepPredictor,
    audited,
    evaluate_layout,
    prepare_inputs,
    runtime_scored,
)
from dflop.runtime.step_data import StepPlan
from dflop.runtime.topology import RuntimeLayout
from dflop.scheduling.async_scheduler import AsyncScheduler
from dflop.scheduling.balance import schedule_from_assignment
from dflop.train.planning import MemoryBudget, core_layout, cost_configs, local_cluster

CONFIG = model_config("tiny")
TPU = CONFIG.vision.tokens_per_unit
GLOBAL_BATCH, MICROBATCHES = 6, 3

# Per sampled batch: units of each sample (0: text-only). Batch 0 holds a 7-frame video
# and single-unit samples; batch 1 a text-only pair; batch 2 a sample of two units.
UNITS = [[7, 0, 1, 0, 1, 2], [0, 0, 3, 1, 0, 4], [2, 0, 0, 1, 0, 0]]
TEXT = [[20, 40, 9, 60, 12, 15], [50, 30, 8, 14, 70, 6], [10, 90, 25, 8, 40, 33]]


class FixedBatches:
    """A distribution whose batch ``seed`` is ``UNITS[seed]`` (the planner samples batch b
    with seed ``seed + b``)."""

    def sample(self, num_samples: int, seed: int = 0) -> SampleShapes:
        units = np.array(UNITS[seed % len(UNITS)][:num_samples], dtype=np.int64)
        video = units == units.max()
        modality = np.where(
            units == 0, Modality.TEXT, np.where(video, Modality.VIDEO, Modality.IMAGE)
        )
        return SampleShapes(
            encoder_units=units,
            tokens_per_unit=np.where(units > 0, TPU, 0),
            llm_visual_tokens=units * TPU,
            text_tokens=np.array(TEXT[seed % len(TEXT)][:num_samples], dtype=np.int64),
            modality=modality.astype(np.int8),
        )


def _layout(encoder_dp: int = 1, order: str | None = None, **sizes) -> RuntimeLayout:
    """The test model's layout of MICROBATCHES x GLOBAL_BATCH (``sizes``: other
    ``RuntimeLayout.simple`` arguments, e.g. ``llm_dp=2, colocated=True``)."""
    return RuntimeLayout.simple(
        encoder_dp=encoder_dp,
        encoder_layers=CONFIG.vision.layers,
        llm_layers=CONFIG.decoder.layers,
        num_microbatches=MICROBATCHES,
        global_batch=GLOBAL_BATCH,
        order=order,
        **sizes,
    )


# Every pipeline order dflop runs here: the layout's default (1F1B) and zero bubble (its
# backwards split, the W share priced per stage).
ORDERS = [None, "zb-h1"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("encoder_dp", [1, 2, 3])
def test_trainer_derives_the_plans_split_and_stage_times(encoder_dp: int, order: str) -> None:
    encoder, llm = cost_configs(CONFIG)
    cost_model = AnalyticCostModel(encoder, llm)
    layout = _layout(encoder_dp, order)
    cluster = local_cluster(layout.world_size, MemoryBudget(8e9, 0.0, "test"))
    config = PlannerConfig(num_batches=len(UNITS), seed=0)
    inputs = prepare_inputs(
        cost_model, encoder, llm, global_batch=GLOBAL_BATCH, shapes=FixedBatches(), num_batches=3
    )
    scored = audited(cluster, inputs, evaluate_layout(cluster, inputs, core_layout(layout), config))
    assert len(scored.steps) == len(UNITS)
    assert scored.order == order and scored.pipeline_order == layout.pipeline_order
    assert all(step.order == layout.pipeline_order for step in scored.steps)
    assert all(bool(step.weight_s.size) == (order == "zb-h1") for step in scored.steps)
    assert scored.prediction.lower_bound_s <= scored.prediction.step_time_s * (1 + 1e-9)
    # The plan's prediction is the mean of its records, and the records re-simulate to it.
    times = [step.step_time_s for step in scored.steps]
    assert scored.prediction.step_times_s == pytest.approx(times, rel=1e-12)
    assert scored.prediction.step_time_s == pytest.approx(np.mean(times), rel=1e-12)
    predictor = StepPredictor(cluster, encoder, llm, core_layout(layout))
    shared = fewer_units = 0
    for b, step in enumerate(scored.steps):
        assert step.simulate().step_time_s == pytest.approx(step.step_time_s, rel=1e-12)
        again = StepAudit.from_dict(json.loads(json.dumps(step.to_dict())))
        assert again.simulate().step_time_s == pytest.approx(step.step_time_s, rel=1e-12)
        # The runtime's split of the same schedule (the trainer broadcasts these costs).
        shapes = FixedBatches().sample(GLOBAL_BATCH, b)
        schedule = schedule_from_assignment(
            np.zeros((GLOBAL_BATCH, 2)), step.assignment, MICROBATCHES, 1, microbatch_dims=(0,)
        )
        plan = StepPlan.build(
            schedule,
            shapes,
            layout,
            np.maximum(shapes.text_tokens // 2, 1),
            tokens_per_unit=TPU,
            encoder_costs=cost_model.costs(shapes)[:, 0],
        )
        for k, mb in enumerate(plan.microbatches):
            recorded = step.split_of(k)
            np.testing.assert_array_equal(mb.split.sample_ids, recorded["sample"])
            np.testing.assert_array_equal(mb.split.first_unit, recorded["first_unit"])
            np.testing.assert_array_equal(mb.split.num_units, recorded["num_units"])
            np.testing.assert_array_equal(mb.split.replica, recorded["replica"])
            # An idle encoder replica is predicted to take no time.
            for e, share in enumerate(mb.encoder):
                if share.units == 0:
                    assert not step.encoder_forward_s[e, :, k].any()
            units = int(shapes.encoder_units[mb.visual_sample_ids].sum())
            fewer_units += 0 < units < encoder_dp
            shared += int(np.unique(mb.split.sample_ids).size < mb.split.num_pieces)
        # The trainer's prediction of the same schedule: the same numbers.
        mine = predictor.audit(cost_model, shapes, step.assignment)
        for name in ("encoder_forward_s", "encoder_backward_s", "llm_forward_s", "llm_backward_s"):
            np.testing.assert_allclose(getattr(mine, name), getattr(step, name), rtol=1e-12)
        for name in ("microbatch", "sample", "first_unit", "num_units", "replica"):
            np.testing.assert_array_equal(mine.pieces[name], step.pieces[name])
        assert mine.step_time_s == pytest.approx(step.step_time_s, rel=1e-12)
    if encoder_dp > 1:
        assert shared > 0  # some sample's units are spread over replicas (the video)
    if encoder_dp == 3:
        assert fewer_units > 0


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("encoder_dp", [1, 2, 3])
@pytest.mark.parametrize("trainable", ["full", "frozen-vision", "projector"])
def test_plan_schedules_each_step_as_the_trainer_does(
    encoder_dp: int, trainable: str, order: str
) -> None:
    """The plan's recorded schedules are the ones the trainer's scheduler computes for the
    same batches (the predictor's stage costs, its pipeline model, its AsyncScheduler), so
    the plan's prediction is of the schedules the runtime executes; under every training
    regime (the scheduler's pipeline runs the regime's backward as the runtime does)."""
    encoder, llm = cost_configs(CONFIG)
    cost_model = AnalyticCostModel(encoder, llm)
    layout = _layout(encoder_dp, order)
    cluster = local_cluster(layout.world_size, MemoryBudget(8e9, 0.0, "test"), link_latency_s=2e-4)
    config = PlannerConfig(
        num_batches=len(UNITS), seed=5, forward_fraction=(0.4, 0.35), trainable=trainable
    )
    inputs = prepare_inputs(
        cost_model,
        encoder,
        llm,
        global_batch=GLOBAL_BATCH,
        shapes=FixedBatches(),
        num_batches=3,
        forward_fraction=config.forward_fraction,
        trainable=trainable,
    )
    # What the trainer's calibration hands its scheduler: the shares under the regime.
    regime_shares = (inputs.encoder.forward_share, inputs.llm.forward_share)
    scored = evaluate_layout(cluster, inputs, core_layout(layout), config)
    planned = runtime_scored(cluster, inputs, scored, config)
    predictor = StepPredictor(cluster, encoder, llm, core_layout(layout), config)
    times = [step.step_time_s for step in planned.steps]
    assert planned.prediction.step_time_s == pytest.approx(np.mean(times), rel=1e-12)
    with AsyncScheduler(
        MICROBATCHES, 1, microbatch_dims=(0,), seed=config.seed, lookahead=len(UNITS)
    ) as scheduler:
        for b in range(len(UNITS)):  # the trainer's step b, on sampled batch b
            shapes = FixedBatches().sample(GLOBAL_BATCH, b)
            costs, model = predictor.scheduler_view(
                cost_model, shapes, regime_shares, cluster.link_latency_s, config.forward_fraction
            )
            assert model.order == order
            if trainable != "full":
                assert model.backward == ("last", "all")
                assert model.backward_gate == (None, 0 if trainable == "projector" else None)
            scheduler.submit(b, costs, pipeline=model, units=shapes.encoder_units)
        for b, step in enumerate(planned.steps):
            np.testing.assert_array_equal(scheduler.get(b).assignment, step.assignment)
    # No worse than the search's own balanced schedule (it starts from it).
    assert planned.prediction.step_time_s <= scored.prediction.step_time_s * (1 + 1e-9)


def test_cli_simulate_resimulates_the_recorded_steps(tmp_path) -> None:
    out = tmp_path / "plan.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dflop.cli",
            "plan",
            "--gpus",
            "16",
            "--global-batch",
            "64",
            "--batches",
            "2",
            "-o",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    plan = Plan.load(out)
    assert len(plan.best.steps) == 2
    done = subprocess.run(
        [sys.executable, "-m", "dflop.cli", "simulate", str(out), "--batch", "1", "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    summary = json.loads(done.stdout)
    assert summary["source"] == "recorded"
    assert summary["step_time_s"] == pytest.approx(plan.best.steps[1].step_time_s, rel=1e-12)
    assert summary["planned_step_time_s"] == pytest.approx(plan.best.steps[1].step_time_s)


@pytest.mark.parametrize("trainable", ["full", "lora"])
def test_zero_bubble_prices_the_heads_remade_logits(trainable: str) -> None:
    """Under ZB-H1 the LLM's last stage runs one LM-head forward more than under 1F1B (the
    split-aware chunked head: W remakes each chunk's logits for the head's weight
    gradient), all of it in W; where the head does not train (LoRA) nothing more. Every
    other cell is the same. The trainer's scheduler prices the same seconds (its model's
    last-stage W extra over the batch's average-stage LLM costs)."""
    encoder, llm = cost_configs(CONFIG)
    cost_model = AnalyticCostModel(encoder, llm)
    config = PlannerConfig(num_batches=1, seed=0, trainable=trainable)
    cluster = local_cluster(_layout(1).world_size, MemoryBudget(8e9, 0.0, "test"))
    predictors = {
        order: StepPredictor(cluster, encoder, llm, core_layout(_layout(1, order)), config)
        for order in (None, "zb-h1")
    }
    for b in range(len(UNITS)):
        shapes = FixedBatches().sample(GLOBAL_BATCH, b)
        assignment = np.arange(GLOBAL_BATCH) % MICROBATCHES
        plain, zb = (p.audit(cost_model, shapes, assignment) for p in predictors.values())
        np.testing.assert_array_equal(plain.llm_forward_s, zb.llm_forward_s)
        np.testing.assert_array_equal(plain.encoder_backward_s, zb.encoder_backward_s)
        np.testing.assert_array_equal(plain.llm_backward_s[:, :-1], zb.llm_backward_s[:, :-1])
        extra = zb.llm_backward_s[0, -1] - plain.llm_backward_s[0, -1]
        weight = zb.weight_s.reshape(1, -1, MICROBATCHES)[0, -1]
        costs, model = predictors["zb-h1"].scheduler_view(cost_model, shapes, (0.3, 0.3), 0.0)
        scheduler_extra_s = model.last_stage_weight_extra[1] * costs[:, 1].sum()
        assert model.last_stage_weight_extra[0] == 0.0
        if trainable == "lora":
            np.testing.assert_allclose(extra, 0.0, atol=1e-15)
            assert scheduler_extra_s == 0.0
            continue
        # Over the batch, the scheduler's extra is the audit's (its costs: an average stage).
        ran_backward = plain.llm_backward_s[0, -1] > 0
        assert ran_backward.all()
        assert scheduler_extra_s == pytest.approx(extra.sum(), rel=1e-9)
        # The head's forward: the forward share of each microbatch's last-stage part.
        samples = predictors[None]._inputs(cost_model, shapes).samples
        last_s = samples["llm_s"] * samples["llm_last_fraction"]
        llm_module = predictors[None]._inputs(cost_model, shapes).llm
        head = np.bincount(assignment, last_s, MICROBATCHES) * llm_module.forward_fraction
        for k in range(MICROBATCHES):
            if plain.llm_backward_s[0, -1, k] == 0.0:  # no backward, no W
                assert extra[k] == 0.0
                continue
            assert extra[k] == pytest.approx(head[k], rel=1e-9) and head[k] > 0
            share = (weight[k] - extra[k]) / plain.llm_backward_s[0, -1, k]
            assert share == pytest.approx(llm_module.weight_share, rel=1e-9)


def test_zero_bubble_memory_keeps_what_w_waits_for() -> None:
    """Under ZB-H1 each stage also holds the gradients its pending W passes wait for
    (PlannerModule.weight_grad_bytes_per_token_layer, checked against the runtime's split
    backward in tests/unit/runtime/test_split_backward.py); under 1F1B nothing more. The
    encoder's first stage (no input path) keeps its output's gradient instead."""
    from dataclasses import replace

    encoder, llm = cost_configs(CONFIG)
    cost_model = AnalyticCostModel(encoder, llm)
    inputs = prepare_inputs(
        cost_model, encoder, llm, global_batch=GLOBAL_BATCH, shapes=FixedBatches(), num_batches=3
    )
    without = replace(
        inputs,
        encoder=replace(inputs.encoder, weight_grad_bytes_per_token_layer=0.0),
        llm=replace(inputs.llm, weight_grad_bytes_per_token_layer=0.0),
    )
    assert inputs.llm.weight_grad_bytes_per_token_layer > 0
    config = PlannerConfig(num_batches=3, seed=0)
    for order in (None, "zb-h1"):
        layout = _layout(1, order)
        cluster = local_cluster(layout.world_size, MemoryBudget(8e9, 0.0, "test"))
        core = core_layout(layout)
        held, bare = (
            evaluate_layout(cluster, x, core, config).prediction.stage_memory_bytes
            for x in (inputs, without)
        )
        extra = np.subtract(held, bare)
        if order is None:
            np.testing.assert_array_equal(extra, 0.0)
        else:  # the LLM stage (its input takes the projector's gradient) keeps more
            assert extra[-1] > 0 and np.all(extra >= 0)


@pytest.mark.parametrize("trainable", ["full", "frozen-vision"])
def test_a_colocated_plan_schedules_each_step_as_the_trainer_does(trainable: str) -> None:
    """A colocated layout (the encoder inside the first LLM stage, run by the runtime as
    ``RuntimeLayout(colocated=True)``): the trainer schedules step b with the predictor's
    ``planned_step`` (the planner's own balance and microbatch order, seeded as batch b)
    into exactly the schedule the plan records, and its audit gives the plan's step
    time."""
    encoder, llm = cost_configs(CONFIG)
    cost_model = AnalyticCostModel(encoder, llm)
    layout = _layout(llm_pp=2, colocated=True)
    core = core_layout(layout)
    assert core["colocated"] and core["llm"]["first_rank"] == 0
    cluster = local_cluster(layout.world_size, MemoryBudget(8e9, 0.0, "test"), link_latency_s=2e-4)
    config = PlannerConfig(
        num_batches=len(UNITS), seed=5, forward_fraction=(0.4, 0.35), trainable=trainable
    )
    inputs = prepare_inputs(
        cost_model,
        encoder,
        llm,
        global_batch=GLOBAL_BATCH,
        shapes=FixedBatches(),
        num_batches=3,
        forward_fraction=config.forward_fraction,
        trainable=trainable,
    )
    planned = runtime_scored(
        cluster, inputs, evaluate_layout(cluster, inputs, core, config), config
    )
    assert planned.colocated
    predictor = StepPredictor(cluster, encoder, llm, core, config)
    for b, step in enumerate(planned.steps):
        shapes = FixedBatches().sample(GLOBAL_BATCH, b)
        mine = predictor.planned_step(cost_model, shapes, seed=config.seed + b)
        np.testing.assert_array_equal(mine.assignment, step.assignment)
        assert mine.num_encoder_stages == 0
        assert mine.step_time_s == pytest.approx(step.step_time_s, rel=1e-12)
        audit = predictor.audit(cost_model, shapes, mine.assignment)  # the trainer's audit
        assert audit.step_time_s == pytest.approx(step.step_time_s, rel=1e-12)
        costs, model = predictor.scheduler_view(
            cost_model, shapes, (0.4, 0.35), cluster.link_latency_s, config.forward_fraction
        )
        assert model is None and costs.shape == (GLOBAL_BATCH, 2)


@pytest.mark.parametrize("colocated", [False, True])
def test_each_llm_replica_is_predicted_on_its_own_microbatches(colocated: bool) -> None:
    """``--memory-report`` compares each rank with the memory model on its own replica's
    samples: an LLM replica's stages (a colocated encoder's with them) are priced on the
    bins ``k * dp + r`` alone. The replica holding the video holds more than the other;
    the larger of the two is the stage's prediction (what every rank must fit), and an
    encoder on ranks of its own keeps that prediction."""
    encoder, llm = cost_configs(CONFIG)
    cost_model = AnalyticCostModel(encoder, llm)
    layout = _layout(llm_dp=2, colocated=colocated)
    cluster = local_cluster(layout.world_size, MemoryBudget(8e9, 0.0, "test"))
    predictor = StepPredictor(cluster, encoder, llm, core_layout(layout), PlannerConfig())
    shapes = FixedBatches().sample(GLOBAL_BATCH, 0)  # sample 0: the 7-frame video
    # One sample per bin; replica 1 (odd bins) gets the video and the longest text.
    assignment = np.array([1, 0, 2, 3, 4, 5])
    largest = predictor.stage_memory_bytes(cost_model, shapes, assignment)
    light, heavy = (
        predictor.stage_memory_bytes(cost_model, shapes, assignment, llm_replica=r) for r in (0, 1)
    )
    encoder_stages = 0 if colocated else 1
    assert len(largest) == len(light) == len(heavy) == encoder_stages + 1
    assert light[:encoder_stages] == heavy[:encoder_stages] == largest[:encoder_stages]
    assert light[-1] < heavy[-1] == pytest.approx(largest[-1], rel=1e-12)
    with pytest.raises(ValueError, match=r"memory_replica must be -1 .* \[0, 2\), got 2"):
        predictor.stage_memory_bytes(cost_model, shapes, assignment, llm_replica=2)
