"""dflop.pipeline_schedule and dflop.PipelineModel: the simulated step it minimises, its
guarantees (never worse than the balanced start, bins non-empty, growth bound), the async
front end, and errors that name the argument."""

from __future__ import annotations

import math
from dataclasses import replace

import dflop
import numpy as np
import pytest
from dflop.scheduling.async_scheduler import AsyncScheduler
from dflop.simulator import simulate_pipeline
from hypothesis import given, settings
from hypothesis import strategies as st


def skewed(n: int, seed: int) -> np.ndarray:
    """Images (encoder-heavy) and texts (LLM-heavy), per-stage seconds."""
    rng = np.random.default_rng(seed)
    image = rng.random(n) < 0.45
    encoder = np.where(image, 0.5 + rng.random(n), 0.0)
    llm = np.where(image, 0.1 + 0.2 * rng.random(n), 0.2 + 0.6 * rng.random(n))
    return np.stack([encoder, llm], axis=1)


def reference_step(costs, schedule, model: dflop.PipelineModel) -> float:
    """The model's step built by hand: per-stage loads (a chunk: its share of a stage's),
    then dflop.simulator over the pipeline's program."""
    m, dp = schedule.num_microbatches, schedule.dp_size
    bins = np.zeros((m * dp, costs.shape[1]))
    np.add.at(bins, schedule.assignment, costs)
    bins = bins.reshape(m, dp, -1)
    chunks = model.chunks or (1,) * len(model.stages)
    virtual = sum(count * v for count, v in zip(model.stages, chunks))
    forward = np.zeros((dp, virtual, m))
    backward = np.zeros((dp, virtual, m))
    weight = np.zeros((dp, virtual, m))  # a split order's W (zb-h1)
    runs_backward = []  # per virtual stage
    # A sample with cost in a module, per (replica, microbatch) share.
    has_work = np.zeros((m * dp, costs.shape[1]))
    np.add.at(has_work, schedule.assignment, costs > 0)
    has_work = has_work.reshape(m, dp, -1) > 0
    s = 0
    for c, (count, v) in enumerate(zip(model.stages, chunks)):
        load = bins[:, :, c].T  # (dp, m)
        if c in schedule.microbatch_dims:
            load = np.broadcast_to(bins[:, :, c].sum(axis=1), (dp, m))
        extra = (model.last_stage_weight_extra or (0.0,) * len(model.stages))[c] * load
        load = np.where(load > 0, load + model.microbatch_constant_s[c], 0.0) / v
        mode = (model.backward or ("all",) * len(model.stages))[c]
        gate = (model.backward_gate or (None,) * len(model.stages))[c]
        gated = np.ones((dp, m), dtype=bool) if gate is None else has_work[:, :, gate].T
        for k in range(count * v):
            runs = mode == "all" or (mode == "last" and k == count * v - 1)
            forward[:, s, :] = model.forward_fraction[c] * load
            backward[:, s, :] = np.where(gated & runs, load - forward[:, s, :], 0.0)
            # W: all of the backward where the input takes no gradient, else the module's
            # share; the module's last stage adds its extra.
            input_grad = s > 0 and runs_backward[-1]
            share = (model.weight_fraction or (0.5,) * len(model.stages))[c] if input_grad else 1
            weight[:, s, :] = share * backward[:, s, :]
            if k == count * v - 1:
                weight[:, s, :] += np.where(backward[:, s, :] > 0, extra, 0.0)
                backward[:, s, :] += np.where(backward[:, s, :] > 0, extra, 0.0)
            runs_backward.append(runs)
            s += 1
    latency = np.full(virtual - 1, model.link_latency_s)
    return simulate_pipeline(
        forward,
        backward,
        gradient_links=None if all(runs_backward) else np.asarray(runs_backward[:-1], np.uint8),
        link_latency_s=latency,
        order=model.order or ("interleaved-1f1b" if max(chunks) > 1 else "1f1b"),
        stages=list(model.stages),
        chunks=list(chunks),
        weight_s=weight if model.order == "zb-h1" else None,
    ).step_time_s


MODEL = dflop.PipelineModel(
    stages=(1, 2),
    forward_fraction=(0.3, 0.4),
    microbatch_constant_s=(0.02, 0.01),
    link_latency_s=0.003,
)


REGIMES = {
    "full": {},
    "frozen_encoder": dict(backward=("none", "all")),
    "trained_projector": dict(backward=("last", "all")),
    "projector_only": dict(backward=("last", "all"), backward_gate=(None, 0)),
}


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("chunks", [None, (1, 2)], ids=["1f1b", "interleaved"])
@pytest.mark.parametrize("regime", REGIMES)
def test_step_time_is_the_simulated_pipeline(dp, chunks, regime):
    costs = skewed(40, 0)
    model = replace(MODEL, chunks=chunks, **REGIMES[regime])
    s = dflop.schedule(costs, 4, dp, microbatch_dims=(0,))
    assert model.step_time_s(costs, s) == pytest.approx(reference_step(costs, s, model), rel=1e-12)
    if chunks:  # the refinement simulates the interleaved program too
        refined = dflop.pipeline_schedule(costs, 4, dp, pipeline=model, microbatch_dims=(0,))
        assert refined.num_microbatches == 4
        assert model.step_time_s(costs, refined) <= model.step_time_s(costs, s) + 1e-12
    with pytest.raises(ValueError, match="multiple of stages"):
        dflop.pipeline_schedule(costs, 5, dp, pipeline=replace(MODEL, chunks=(1, 2)))


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("regime", REGIMES)
def test_a_split_order_runs_the_last_stages_extra_in_w(dp, regime):
    """Under ZB-H1 each stage's W is its module's share of the backward (all of it where
    the input takes no gradient), and a module's last stage runs its extra in W too (the
    chunked LM head's remade logits: a fraction of the microbatch's cost in that module's
    column), as the planner's audit prices it; the refinement simulates that program."""
    costs = skewed(40, 0)
    plain = replace(MODEL, order="zb-h1", weight_fraction=(0.6, 0.45), **REGIMES[regime])
    model = replace(plain, last_stage_weight_extra=(0.0, 2.0))
    s = dflop.schedule(costs, 4, dp, microbatch_dims=(0,))
    assert model.step_time_s(costs, s) == pytest.approx(reference_step(costs, s, model), rel=1e-12)
    assert plain.step_time_s(costs, s) == pytest.approx(reference_step(costs, s, plain), rel=1e-12)
    assert model.step_time_s(costs, s) > plain.step_time_s(costs, s)
    refined = dflop.pipeline_schedule(costs, 4, dp, pipeline=model, microbatch_dims=(0,))
    assert model.step_time_s(costs, refined) <= model.step_time_s(costs, s) + 1e-12
    with pytest.raises(ValueError, match=r"last_stage_weight_extra=\(0.0, -1.0\) needs one"):
        replace(model, last_stage_weight_extra=(0.0, -1.0))


def test_a_stage_without_backward_waits_for_no_gradient():
    """By hand, encoder then LLM (one stage each), two microbatches, 0.5 s links: encoder
    F0 [0, 1], F1 [1, 2]; LLM F0 [1.5, 2.5], B0 [2.5, 4.5], F1 [4.5, 5.5], B1 [5.5, 7.5].
    A trained encoder's (empty) B1 waits for B1's gradient (7.5 + 0.5 = 8); a frozen one
    is sent none; a frozen LLM under a trained projector runs no backward for the
    text-only microbatch (LLM B1 empty at 5.5; the encoder's empty B1 after one link: 6,
    as in the planner's simulation)."""
    model = dflop.PipelineModel((1, 1), (1.0, 1 / 3), (0.0, 0.0), 0.5)
    schedule = dflop.schedule_from_assignment(
        np.array([[1.0, 3.0], [1.0, 3.0]]), [0, 1], 2, 1, microbatch_dims=(0,)
    )
    costs = np.array([[1.0, 3.0], [1.0, 3.0]])
    assert model.step_time_s(costs, schedule) == pytest.approx(8.0)
    frozen = replace(model, backward=("none", "all"))
    assert frozen.step_time_s(costs, schedule) == pytest.approx(7.5)
    text_only = np.array([[1.0, 3.0], [0.0, 3.0]])
    projector = replace(model, backward=("last", "all"), backward_gate=(None, 0))
    assert projector.step_time_s(text_only, schedule) == pytest.approx(6.0)
    assert replace(projector, backward_gate=None).step_time_s(text_only, schedule) == pytest.approx(
        8.0
    )


def test_refines_the_balanced_schedule():
    costs = skewed(48, 1)
    balanced = dflop.schedule(costs, 24, microbatch_dims=(0,), seed=3)
    refined = dflop.pipeline_schedule(costs, 24, microbatch_dims=(0,), seed=3, pipeline=MODEL)
    stats = refined.stats
    assert stats["start_step_time_s"] == pytest.approx(MODEL.step_time_s(costs, balanced))
    assert stats["step_time_s"] == pytest.approx(MODEL.step_time_s(costs, refined), rel=1e-12)
    assert stats["step_time_s"] <= stats["ordered_step_time_s"] <= stats["start_step_time_s"]
    # On a skewed mix with equal module totals the refinement saves over 15% of the step.
    assert stats["step_time_s"] < 0.85 * stats["start_step_time_s"]
    # Microbatch loads stay within max_growth of the balanced makespan, per dimension.
    grown = refined.microbatch_loads.max(axis=0) / balanced.microbatch_loads.max(axis=0)
    assert np.all(grown <= 1.05 + 1e-9)
    assert np.all(np.bincount(refined.assignment, minlength=24) > 0)


def test_deterministic_for_a_seed():
    costs = skewed(64, 2)
    a = dflop.pipeline_schedule(costs, 16, seed=9, pipeline=MODEL)
    b = dflop.pipeline_schedule(costs, 16, seed=9, pipeline=MODEL)
    np.testing.assert_array_equal(a.assignment, b.assignment)


def test_zero_budget_only_orders_the_microbatches():
    costs = skewed(32, 4)
    start = dflop.schedule(costs, 8)
    r = dflop.pipeline_schedule(costs, 8, pipeline=MODEL, start=start, time_budget_ms=0)
    assert r.stats["step_time_s"] == r.stats["ordered_step_time_s"]
    # Same microbatches (as sets of samples), possibly renumbered.
    groups = {frozenset(np.flatnonzero(start.assignment == b)) for b in range(8)}
    assert groups == {frozenset(np.flatnonzero(r.assignment == b)) for b in range(8)}


def test_default_model_and_one_dimension():
    costs = np.random.default_rng(0).lognormal(size=30)
    r = dflop.pipeline_schedule(costs, 6)
    assert r.stats["step_time_s"] <= r.stats["start_step_time_s"]


def test_async_scheduler_refines_in_the_background():
    costs = skewed(48, 5)
    with AsyncScheduler(12, microbatch_dims=(0,), seed=2, pipeline=MODEL) as scheduler:
        scheduler.submit(0, costs)
        scheduler.submit(1, costs, pipeline=dflop.PipelineModel())
        got0, got1 = scheduler.get(0), scheduler.get(1)
    want = dflop.pipeline_schedule(costs, 12, microbatch_dims=(0,), seed=2, pipeline=MODEL)
    np.testing.assert_array_equal(got0.assignment, want.assignment)
    assert got1.stats["step_time_s"] == pytest.approx(
        dflop.PipelineModel().step_time_s(costs, got1)
    )


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(8, 60),
    m=st.integers(1, 8),
    dp=st.integers(1, 2),
    seed=st.integers(0, 2**32),
    growth=st.sampled_from([1.0, 1.05, 1.5, math.inf]),
)
def test_never_worse_and_no_empty_bin(n, m, dp, seed, growth):
    if n < m * dp:
        return
    costs = skewed(n, seed % 1000)
    r = dflop.pipeline_schedule(
        costs, m, dp, microbatch_dims=(0,), seed=seed, pipeline=MODEL, max_growth=growth
    )
    assert r.stats["step_time_s"] <= r.stats["start_step_time_s"] * (1 + 1e-12)
    assert np.all(np.bincount(r.assignment, minlength=m * dp) > 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(stages=(1,), forward_fraction=(0.3, 0.3)), "one entry per module"),
        (dict(stages=(1, 0)), r"stages\[1\] must be >= 1"),
        (dict(forward_fraction=(0.3, 1.2)), r"forward_fraction\[1\]"),
        (dict(microbatch_constant_s=(-1.0, 0.0)), r"microbatch_constant_s\[0\]"),
        (dict(link_latency_s=math.nan), "link_latency_s"),
        (dict(chunks=(2, 1)), r"chunks\[0\]=2: only the last module"),
        (dict(chunks=(1,)), "chunks needs one entry per module"),
        (dict(backward=("all", "some")), r"backward=\('all', 'some'\) needs one of"),
        (dict(backward=("all",)), "backward=.*per module"),
        (dict(backward_gate=(None, 1)), "backward_gate=.*another module"),
        (dict(backward_gate=(None, 5)), "backward_gate=.*another module"),
    ],
)
def test_bad_pipeline_model(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dflop.PipelineModel(**kwargs)


def test_pipeline_model_normalises_numbers():
    model = dflop.PipelineModel(np.array([1, 2]), (np.float32(0.5), 1), [0, 0.001], 0)
    assert model.stages == (1, 2) and all(type(v) is int for v in model.stages)
    assert model.forward_fraction == (0.5, 1.0) and model.link_latency_s == 0.0
    with pytest.raises(TypeError, match=r"forward_fraction\[0\] must be a number"):
        dflop.PipelineModel(forward_fraction=("0.5", 0.3))
    with pytest.raises(TypeError, match=r"stages\[1\] must be an integer"):
        dflop.PipelineModel(stages=(1, 2.5))


def test_bad_arguments_are_named():
    costs = skewed(20, 0)
    with pytest.raises(ValueError, match="D=2 columns but the PipelineModel describes 3"):
        dflop.pipeline_schedule(
            costs, 4, pipeline=dflop.PipelineModel((1, 1, 1), (0.3,) * 3, (0,) * 3)
        )
    with pytest.raises(ValueError, match="max_growth"):
        dflop.pipeline_schedule(costs, 4, max_growth=0.5)
    with pytest.raises(TypeError, match="max_growth"):
        dflop.pipeline_schedule(costs, 4, max_growth="big")
    with pytest.raises(ValueError, match="seed"):
        dflop.pipeline_schedule(costs, 4, seed=-1)
    with pytest.raises(ValueError, match="start has 20 samples in 5 x 1 bins"):
        dflop.pipeline_schedule(costs, 4, start=dflop.schedule(costs, 5))
    with pytest.raises(TypeError, match="start must be a dflop.Schedule"):
        dflop.pipeline_schedule(costs, 4, start=[0] * 20)
    with pytest.raises(ValueError, match="time_budget_ms"):
        dflop.pipeline_schedule(costs, 4, time_budget_ms=-1)
    with pytest.raises(ValueError, match="time_limit_s"):
        dflop.pipeline_schedule(costs, 4, start=dflop.schedule(costs, 4), time_limit_s=math.nan)
    with pytest.raises(ValueError, match=r"microbatch_dims=\(\)"):
        dflop.pipeline_schedule(costs, 4, microbatch_dims=(0,), start=dflop.schedule(costs, 4))
    with pytest.raises(ValueError, match="max_growth"):
        AsyncScheduler(4, max_growth=0.5)
    with pytest.raises(TypeError, match="pipeline must be a dflop.PipelineModel"):
        AsyncScheduler(4, pipeline=(1, 1))
    with pytest.raises(TypeError, match="pipeline must be a dflop.PipelineModel"):
        dflop.pipeline_schedule(costs, 4, pipeline=(1, 1))
    with pytest.raises(ValueError, match="costs has 19 rows"):
        dflop.PipelineModel().step_time_s(costs[:19], dflop.schedule(costs, 4))
