"""PerformanceModel fitting, persistence and CostModel predictions."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from dflop.data.shapes import SampleShapes
from dflop.profiling import (
    CostModel,
    EncoderTimeCoefficients,
    LLMTimeCoefficients,
    MemoryCoefficients,
    PerformanceModel,
    fit_encoder_time,
    fit_llm_time,
    fit_memory,
    nonnegative_least_squares,
)


def _shapes(units: list[int], visual: list[int], text: list[int]) -> SampleShapes:
    n = len(units)
    return SampleShapes(
        encoder_units=np.array(units, dtype=np.int64),
        tokens_per_unit=np.where(np.array(units) > 0, 729, 0).astype(np.int64),
        llm_visual_tokens=np.array(visual, dtype=np.int64),
        text_tokens=np.array(text, dtype=np.int64),
        modality=np.zeros(n, dtype=np.int8),
    )


def test_nnls_matches_unconstrained_when_interior_and_clips_otherwise() -> None:
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (40, 3))
    x_true = np.array([1.0, 2.0, 0.5])
    x = nonnegative_least_squares(a, a @ x_true)
    np.testing.assert_allclose(x, x_true, rtol=1e-9)
    # a target that wants a negative coefficient gets exactly 0 there
    x = nonnegative_least_squares(a, a @ np.array([1.0, -1.0, 0.5]))
    assert x[1] == 0.0 and np.all(x >= 0)
    # brute-force check of optimality against a grid of feasible points
    best = np.sum((a @ x - a @ np.array([1.0, -1.0, 0.5])) ** 2)
    for trial in rng.uniform(0, 2, (200, 3)):
        assert np.sum((a @ trial - a @ np.array([1.0, -1.0, 0.5])) ** 2) >= best - 1e-12


def test_fit_recovers_known_llm_coefficients_from_noisy_data() -> None:
    rng = np.random.default_rng(1)
    true = LLMTimeCoefficients(per_token_s=3e-5, per_token_sq_s=2e-9, constant_s=4e-3)
    tokens, sq = [], []
    for total in (1024, 2048, 4096, 8192):
        for parts in (1, 2, 4, 8):
            seqs = np.full(parts, total // parts)
            tokens.append(seqs.sum())
            sq.append(np.dot(seqs, seqs))
    tokens, sq = np.array(tokens, float), np.array(sq, float)
    clean = true.per_token_s * tokens + true.per_token_sq_s * sq + true.constant_s
    noisy = clean * np.exp(rng.normal(0, 0.01, clean.shape))
    coef, report = fit_llm_time(tokens, sq, noisy, holdout_fraction=0.25, seed=0)
    assert coef.per_token_s == pytest.approx(true.per_token_s, rel=0.05)
    assert coef.per_token_sq_s == pytest.approx(true.per_token_sq_s, rel=0.1)
    assert coef.constant_s == pytest.approx(true.constant_s, rel=0.5)
    assert report.num_holdout_points == 4 and report.num_fit_points == 12
    assert report.holdout_median_abs_rel_error < 0.03
    assert report.fit_median_abs_rel_error < 0.03


def test_fit_encoder_exact_and_holdout_error_reported() -> None:
    units = np.array([1, 2, 3, 4, 6, 8, 12, 16], float)
    times = 0.01 * units + 0.002
    coef, report = fit_encoder_time(units, times, holdout_fraction=0.25)
    assert coef.per_unit_s == pytest.approx(0.01, rel=1e-9)
    assert coef.constant_s == pytest.approx(0.002, rel=1e-6)
    assert report.num_holdout_points == 2
    assert report.holdout_median_abs_rel_error < 1e-9
    # a holdout cannot starve the fit: at least coefficients + 1 points are fitted
    _, small = fit_encoder_time([1, 2, 4], [0.1, 0.2, 0.4], holdout_fraction=0.9)
    assert small.num_fit_points == 3 and small.num_holdout_points == 0
    assert math.isnan(small.holdout_median_abs_rel_error)


def test_fit_is_nonnegative_when_data_suggest_a_negative_intercept() -> None:
    units = np.array([1, 2, 4, 8], float)
    coef, _ = fit_encoder_time(units, 0.01 * units - 0.004)
    assert coef.constant_s == 0.0 and coef.per_unit_s > 0


def test_fit_memory_linear() -> None:
    mem = fit_memory([1, 2, 4, 8], [3e6 + 1e6 * u for u in (1, 2, 4, 8)])
    assert mem.per_item_bytes == pytest.approx(1e6)
    assert mem.constant_bytes == pytest.approx(3e6)
    assert mem.predict_bytes(10) == pytest.approx(13e6)


def test_fit_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"time_s\[1\]"):
        fit_encoder_time([1, 2], [0.1, -0.2])
    with pytest.raises(ValueError, match="same length"):
        fit_encoder_time([1, 2, 3], [0.1, 0.2])
    with pytest.raises(ValueError, match="holdout_fraction"):
        fit_encoder_time([1, 2, 3], [0.1, 0.2, 0.3], holdout_fraction=1.0)
    with pytest.raises(ValueError, match="at least 3 measurements"):
        fit_llm_time([1, 2], [1, 4], [0.1, 0.2])
    with pytest.raises(ValueError, match=r"num_units\[0\]"):
        fit_encoder_time([math.nan, 1], [0.1, 0.2])


def test_coefficient_dataclasses_validate_their_fields() -> None:
    with pytest.raises(ValueError, match="EncoderTimeCoefficients.per_unit_s"):
        EncoderTimeCoefficients(per_unit_s=-1.0, constant_s=0.0)
    with pytest.raises(ValueError, match="LLMTimeCoefficients.per_token_sq_s"):
        LLMTimeCoefficients(per_token_s=1.0, per_token_sq_s=math.nan, constant_s=0.0)
    with pytest.raises(ValueError, match="MemoryCoefficients.constant_bytes"):
        MemoryCoefficients(per_item_bytes=1.0, constant_bytes=-5)
    with pytest.raises(ValueError, match="PerformanceModel.tensor_parallel_size"):
        PerformanceModel(
            encoder=EncoderTimeCoefficients(1, 0),
            llm=LLMTimeCoefficients(1, 0, 0),
            tensor_parallel_size=0,
        )
    with pytest.raises(TypeError, match="PerformanceModel.llm"):
        PerformanceModel(encoder=EncoderTimeCoefficients(1, 0), llm=(1, 0, 0))  # type: ignore[arg-type]


def _model() -> PerformanceModel:
    units = np.array([1, 2, 3, 4, 6, 8, 12, 16], float)
    enc, enc_report = fit_encoder_time(units, 0.01 * units + 0.002, holdout_fraction=0.25)
    return PerformanceModel(
        encoder=enc,
        llm=LLMTimeCoefficients(per_token_s=3e-5, per_token_sq_s=2e-9, constant_s=4e-3),
        encoder_memory=MemoryCoefficients(2e6, 1e8),
        llm_memory=MemoryCoefficients(1e5, 2e8),
        tensor_parallel_size=2,
        tokens_per_unit=729,
        encoder_fit=enc_report,
        metadata={
            "device_name": "test",
            "dtype": "bfloat16",
            "torch_version": "x",
            "n": np.int64(3),
        },
    )


def test_save_load_roundtrip(tmp_path) -> None:
    model = _model()
    path = tmp_path / "perf.json"
    model.save(path)
    loaded = PerformanceModel.load(path)
    assert loaded.encoder == model.encoder
    assert loaded.llm == model.llm
    assert loaded.encoder_memory == model.encoder_memory
    assert loaded.llm_memory == model.llm_memory
    assert loaded.tensor_parallel_size == 2 and loaded.tokens_per_unit == 729
    assert loaded.encoder_fit == model.encoder_fit
    assert math.isnan(loaded.llm_fit.holdout_median_abs_rel_error)  # nan survives as null
    assert loaded.metadata["device_name"] == "test" and loaded.metadata["n"] == 3
    data = json.loads(path.read_text())
    assert data["format"] == "dflop.performance_model"
    assert "dflop" in model.summary() or "PerformanceModel" in model.summary()


def test_load_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.json"):
        PerformanceModel.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="'format'"):
        PerformanceModel.load(bad)
    data = _model().to_dict()
    del data["llm"]
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'llm'"):
        PerformanceModel.load(bad)
    data = _model().to_dict()
    data["encoder"]["per_unit_s"] = -1
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="per_unit_s"):
        PerformanceModel.load(bad)


def test_cost_model_costs_shapes_and_values() -> None:
    model = CostModel(_model())
    shapes = _shapes(units=[0, 4, 10], visual=[0, 1000, 3000], text=[500, 200, 100])
    costs = model.costs(shapes)
    assert costs.shape == (3, 2) and costs.dtype == np.float64 and costs.flags.c_contiguous
    seq = np.array([500, 1200, 3100], float)
    np.testing.assert_allclose(costs[:, 0], 0.01 * np.array([0, 4, 10]), rtol=1e-9)
    np.testing.assert_allclose(costs[:, 1], 3e-5 * seq + 2e-9 * seq**2, rtol=1e-12)
    np.testing.assert_allclose(model.microbatch_constant_s, [0.002, 4e-3], rtol=1e-6)
    # a microbatch: costs summed plus the constants
    enc_s, llm_s = model.predict_microbatch(shapes)
    assert enc_s == pytest.approx(costs[:, 0].sum() + 0.002, rel=1e-6)
    assert llm_s == pytest.approx(costs[:, 1].sum() + 4e-3, rel=1e-12)
    # no visual units: no encoder time at all
    text_only = shapes.take(np.array([0]))
    assert model.predict_microbatch(text_only)[0] == 0.0
    both = model.predict_microbatches([shapes, text_only])
    assert both.shape == (2, 2) and both[0, 1] == pytest.approx(llm_s)
    assert model.costs(shapes.take(np.array([], dtype=np.int64))).shape == (0, 2)


def test_cost_model_argument_errors() -> None:
    with pytest.raises(TypeError, match="performance_model"):
        CostModel("perf.json")  # type: ignore[arg-type]
    model = CostModel(_model())
    with pytest.raises(TypeError, match="shapes must be"):
        model.costs(np.zeros((3, 2)))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shapes_in_microbatch"):
        model.predict_microbatch([1, 2])  # type: ignore[arg-type]


def test_costs_feed_the_scheduler() -> None:
    dflop = pytest.importorskip("dflop")
    model = CostModel(_model())
    rng = np.random.default_rng(0)
    n = 32
    units = rng.integers(0, 10, n)
    shapes = _shapes(list(units), list(units * 300), list(rng.integers(50, 500, n)))
    schedule = dflop.schedule(model.costs(shapes), num_microbatches=4, dp_size=2)
    assert schedule.num_samples == n


def _frozen_model() -> PerformanceModel:
    from dataclasses import replace

    return replace(
        _model(),
        forward_fraction=(0.3, 0.35),
        passthrough_backward_factor=[0.5, 0.55],  # any pair: stored as a tuple of floats
        passthrough_activation_fraction=(np.float64(0.6), 0.25),
    )


def test_frozen_shares_roundtrip_and_summary(tmp_path) -> None:
    model = _frozen_model()
    assert model.forward_fraction == (0.3, 0.35)
    assert model.passthrough_backward_factor == (0.5, 0.55)
    assert model.passthrough_activation_fraction == (0.6, 0.25)
    assert all(type(v) is float for v in model.passthrough_activation_fraction)
    data = model.to_dict()
    assert data["forward_fraction"] == [0.3, 0.35]
    back = PerformanceModel.from_dict(json.loads(json.dumps(data)))
    for name in (
        "forward_fraction",
        "passthrough_backward_factor",
        "passthrough_activation_fraction",
    ):
        assert getattr(back, name) == getattr(model, name)
    path = tmp_path / "perf.json"
    model.save(path)
    assert PerformanceModel.load(path).passthrough_backward_factor == (0.5, 0.55)
    # kept by the copies the cost model makes
    corrected = model.with_time_coefficients(model.encoder, model.llm)
    assert corrected.passthrough_activation_fraction == (0.6, 0.25)
    assert (
        "frozen:  forward 30% / 35% of forward+backward; pass-through backward 0.50 / 0.55 "
        "of a full one, activations 60% / 25% (encoder / llm)"
    ) in model.summary()
    partial = PerformanceModel.from_dict({**data, "passthrough_activation_fraction": None})
    assert partial.passthrough_activation_fraction is None
    assert "activations n/a" in partial.summary()


def test_frozen_shares_absent_from_old_files_are_none() -> None:
    data = _model().to_dict()
    for name in (
        "forward_fraction",
        "passthrough_backward_factor",
        "passthrough_activation_fraction",
    ):
        assert data.pop(name) is None
    old = PerformanceModel.from_dict(data)
    assert old.forward_fraction is None
    assert old.passthrough_backward_factor is None
    assert old.passthrough_activation_fraction is None
    assert "frozen:" not in old.summary()


@pytest.mark.parametrize(
    "value, problem",
    [
        ((0.5, 1.5), "in \\[0, 1\\]"),
        ((-0.1, 0.5), "in \\[0, 1\\]"),
        ((0.5, float("nan")), "in \\[0, 1\\]"),
        ((0.5,), "got 1 values"),
        ((0.1, 0.2, 0.3), "got 3 values"),
        (0.5, "pair"),
        ("ab", "pair"),
        ({"encoder": 0.1, "llm": 0.2}, "pair"),
        ((True, 0.5), "pair"),
        (("0.1", 0.5), "pair"),
    ],
)
def test_frozen_shares_are_validated(value, problem) -> None:
    for name in (
        "forward_fraction",
        "passthrough_backward_factor",
        "passthrough_activation_fraction",
    ):
        with pytest.raises(ValueError, match=f"PerformanceModel.{name} must be.*{problem}"):
            PerformanceModel(
                encoder=EncoderTimeCoefficients(1, 0),
                llm=LLMTimeCoefficients(1, 0, 0),
                **{name: value},
            )


def test_bad_frozen_share_in_a_file_names_the_field(tmp_path) -> None:
    data = _frozen_model().to_dict()
    data["passthrough_backward_factor"] = [0.5, 2.0]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bad.json: PerformanceModel.passthrough_backward_factor"):
        PerformanceModel.load(bad)


def test_cost_model_passthrough_factors() -> None:
    assert CostModel(_model()).passthrough_factors is None
    costs = CostModel(_frozen_model())
    assert costs.passthrough_factors == {
        "forward_fraction": (0.3, 0.35),
        "backward": (0.5, 0.55),
        "activations": (0.6, 0.25),
    }
    with pytest.raises(AttributeError):
        costs.passthrough_factors = None  # type: ignore[misc]
    from dataclasses import replace

    no_memory = replace(_frozen_model(), passthrough_activation_fraction=None)
    assert CostModel(no_memory).passthrough_factors["activations"] is None
