"""Tests of dflop.data: family shape rules, the synthetic workload, the analytic costs.

Expected values are worked out by hand from the rules documented in
``dflop.data.families`` (comments show the arithmetic).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from dflop.data import (
    ENCODER_PRESETS,
    LLM_PRESETS,
    AnalyticCostModel,
    EncoderConfig,
    FamilySpec,
    LLMConfig,
    MixSpec,
    Modality,
    SampleShapes,
    get_family,
    shapes_from_descriptors,
    synthetic_costs,
    synthetic_shapes,
)
from dflop.data.families import (
    anyres_grid,
    dynamic_tiles,
    image_shapes,
    multi_image_shapes,
    video_shapes,
)

# ----------------------------------------------------------------------------- anyres


def _reference_grid(width: int, height: int, tile: int = 384, max_grid: int = 6):
    """Straightforward full scan of the select-best-resolution rule (the spec)."""
    best = None
    for cols in range(1, max_grid + 1):
        for rows in range(1, max_grid + 1):
            canvas_w, canvas_h = cols * tile, rows * tile
            scale = min(canvas_w / width, canvas_h / height)
            effective = min(int(width * scale) * int(height * scale), width * height)
            wasted = canvas_w * canvas_h - effective
            if best is None or effective > best[0] or (effective == best[0] and wasted < best[1]):
                best = (effective, wasted, rows, cols)
    return best[2], best[3]


@pytest.mark.parametrize(
    ("width", "height", "rows", "cols", "units", "llm_tokens"),
    [
        # 1x1 canvas holds it at scale 1; features 27x27, no unpad, no downsample:
        # 729 (base) + 27 rows * (27 + 1 newline) = 1485.
        (384, 384, 1, 1, 2, 1485),
        # 2 cols x 1 row: features 27 x 54: 729 + 27 * 55 = 2214.
        (768, 384, 1, 2, 3, 2214),
        # Fits 1x1 at scale 1.92; unpad: wider than the 27x27 grid, keep
        # int(100 * 27 / 200) = 13 rows (pad 7 each side): 729 + 13 * 28 = 1093.
        (200, 100, 1, 1, 2, 1093),
        # 6x6 grid (scale 1 at 2304): 162x162 features, t = sqrt(162^2 / (9 * 27^2)) = 2,
        # downsampled to 81x81: 729 + 81 * 82 = 7371 LLM tokens vs 37 encoder tiles.
        (2304, 2304, 6, 6, 37, 7371),
        # Tall document: height binds at 6 rows (scale 0.768); 4 cols is the smallest
        # canvas reaching that scale (waste 0): 25 tiles. Features 162 x 108, same aspect,
        # t = sqrt(162 * 108 / 6561) = 1.633 -> floor(162 / t) = 99, floor(108 / t) = 66:
        # 729 + 99 * 67 = 7362.
        (2000, 3000, 6, 4, 25, 7362),
        # Panorama: width binds at 6 cols (scale 0.576 -> 2304 x 576), 2 rows suffice.
        # Features 54 x 162; unpad keeps int(1000 * 162 / 4000) = 40 rows; t < 1.1:
        # 729 + 40 * 163 = 7249.
        (4000, 1000, 2, 6, 13, 7249),
        # Its transpose: unpad keeps 40 columns of 162 rows: 729 + 162 * 41 = 7371.
        (1000, 4000, 6, 2, 13, 7371),
    ],
)
def test_anyres_known_cases(width, height, rows, cols, units, llm_tokens):
    got_rows, got_cols = anyres_grid(width, height)
    assert (int(got_rows[0]), int(got_cols[0])) == (rows, cols)
    assert _reference_grid(width, height) == (rows, cols)
    got_units, got_tokens = image_shapes("llava-ov", width, height)
    assert int(got_units[0]) == units
    assert int(got_tokens[0]) == llm_tokens


def test_anyres_large_document_costs_encoder_much_more_than_llm():
    units, tokens = image_shapes("llava-ov", [2304, 3000], [2304, 3000])
    assert units.tolist() == [37, 37]
    # ~9 crops' worth (9 * 729 = 6561) + base + newlines: about 7k.
    assert np.all(np.abs(tokens - 7000) <= 700)
    assert np.all(units * 729 > 3.5 * tokens)


def test_anyres_grid_matches_full_scan_reference():
    rng = np.random.default_rng(7)
    width = np.concatenate(
        [rng.integers(1, 6000, 1500), rng.integers(1, 900, 500), np.arange(1, 13) * 192]
    )
    height = np.concatenate(
        [rng.integers(1, 6000, 1500), rng.integers(1, 900, 500), np.arange(1, 13) * 384]
    )
    rows, cols = anyres_grid(width, height)
    expected = [_reference_grid(int(w), int(h)) for w, h in zip(width, height)]
    assert list(zip(rows.tolist(), cols.tolist())) == expected
    # Large batches go through the per-distinct-size path: same answers.
    units_big, tokens_big = image_shapes("llava-ov", np.tile(width, 3), np.tile(height, 3))
    units_small, tokens_small = image_shapes("llava-ov", width[:200], height[:200])
    np.testing.assert_array_equal(units_big[:200], units_small)
    np.testing.assert_array_equal(tokens_big[:200], tokens_small)


def test_anyres_units_and_tokens_bounds():
    rng = np.random.default_rng(3)
    width = rng.integers(1, 8000, 5000)
    height = rng.integers(1, 8000, 5000)
    units, tokens = image_shapes("llava-ov", width, height)
    assert units.min() >= 2 and units.max() <= 37
    # Never more than base + ~9 crops' worth (with newlines and the 1.1 slack).
    assert tokens.max() <= 729 + int(1.1**2 * 9 * 729) + 27 * 6 * 1.1 + 1
    assert tokens.min() > 729


# ----------------------------------------------------------------------------- InternVL


@pytest.mark.parametrize(
    ("width", "height", "rows", "cols", "units"),
    [
        (448, 448, 1, 1, 1),  # (1,1) exact; (2,2) ties but 448^2 <= 0.5 * 4 * 448^2
        (896, 896, 2, 2, 5),  # tie (2,2) taken: 896^2 > 0.5 * 4 * 448^2; + thumbnail
        (1920, 1080, 2, 4, 9),  # aspect 1.78: 2/1 closest, (4,2) taken on the tie; + thumb
        (100, 1000, 10, 1, 11),  # aspect 0.1 = 1/10 exactly; + thumbnail
        (4000, 100, 1, 12, 13),  # aspect 40: widest grid allowed is 12 x 1
    ],
)
def test_internvl_dynamic_tiling(width, height, rows, cols, units):
    got_rows, got_cols, got_units = dynamic_tiles(width, height)
    assert (int(got_rows[0]), int(got_cols[0]), int(got_units[0])) == (rows, cols, units)
    enc_units, llm_tokens = image_shapes("internvl", width, height)
    assert int(enc_units[0]) == units
    assert int(llm_tokens[0]) == units * 256 + 2  # pixel shuffle: 256 per tile, <img></img>


def test_internvl_max_tiles_limit():
    _, _, units = dynamic_tiles([1920, 1920], [1080, 1080], max_tiles=[12, 3])
    # With 3 tiles at most: ratios 1, 2, 3, 1/2, 1/3: 2/1 closest -> 2 tiles + thumbnail.
    assert units.tolist() == [9, 3]


# ----------------------------------------------------------------------------- others


def test_multi_image_shapes():
    # LLaVA-OneVision: one 384 px tile per image, 729 tokens + 1 newline each.
    units, tokens = multi_image_shapes("llava-ov", [0, 0, 0, 2, 2], [800] * 5, [600] * 5, 3)
    assert units.tolist() == [3, 0, 2]
    assert tokens.tolist() == [3 * 730, 0, 2 * 730]
    # InternVL: 2 images -> max 6 tiles each: 800x600 (1.33) -> 3/2 grid (6) + thumbnail;
    # 4 images -> max 3 tiles each: 1/1 closest -> 1 tile, no thumbnail.
    units, tokens = multi_image_shapes("internvl", [0, 0, 1, 1, 1, 1], [800] * 6, [600] * 6, 2)
    assert units.tolist() == [14, 4]
    assert tokens.tolist() == [14 * 256 + 2 * 2, 4 * 256 + 4 * 2]


def test_video_frame_cap():
    units, tokens = video_shapes("llava-ov", [5, 32, 100, 10_000])
    assert units.tolist() == [5, 32, 32, 32]
    # 196 tokens per frame after 2x2 pooling of 27x27, plus one newline per video.
    assert tokens.tolist() == [5 * 196 + 1, 32 * 196 + 1, 32 * 196 + 1, 32 * 196 + 1]
    units, tokens = video_shapes("internvl", [100])
    assert units.tolist() == [32] and tokens.tolist() == [32 * (256 + 2)]


def test_shapes_from_descriptors_per_modality():
    shapes = shapes_from_descriptors(
        "llava-ov",
        modality=[Modality.TEXT, Modality.IMAGE, Modality.MULTI_IMAGE, Modality.VIDEO],
        text_tokens=[100, 50, 60, 70],
        image_sample_index=[2, 1, 2],
        image_width_px=[640, 384, 640],
        image_height_px=[480, 384, 480],
        video_num_frames=[0, 0, 0, 40],
    )
    assert shapes.encoder_units.tolist() == [0, 2, 2, 32]
    assert shapes.tokens_per_unit.tolist() == [0, 729, 729, 729]
    assert shapes.llm_visual_tokens.tolist() == [0, 1485, 1460, 32 * 196 + 1]
    assert shapes.seq_len.tolist() == [100, 1535, 1520, 6343]
    assert shapes.modality.dtype == np.int8


def test_text_only_costs_encoder_nothing():
    shapes = synthetic_shapes(2000, seed=5)
    text = shapes.modality == Modality.TEXT
    assert text.any()
    assert np.all(shapes.encoder_units[text] == 0)
    assert np.all(shapes.llm_visual_tokens[text] == 0)
    costs = AnalyticCostModel().costs(shapes)
    assert np.all(costs[text, 0] == 0.0)
    assert np.all(costs[~text, 0] > 0.0)
    assert np.all(costs[:, 1] > 0.0)


# ----------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize("family", ["llava-ov", "internvl"])
def test_synthetic_is_deterministic(family):
    a = synthetic_shapes(3000, seed=11, family=family)
    b = synthetic_shapes(3000, seed=11, family=family)
    c = synthetic_shapes(3000, seed=12, family=family)
    for name in (
        "encoder_units",
        "tokens_per_unit",
        "llm_visual_tokens",
        "text_tokens",
        "modality",
    ):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.seq_len, c.seq_len)
    np.testing.assert_array_equal(synthetic_costs(500, seed=3), synthetic_costs(500, seed=3))


def test_synthetic_families_share_the_draws():
    llava = synthetic_shapes(2000, seed=2, family="llava-ov")
    internvl = synthetic_shapes(2000, seed=2, family="internvl")
    np.testing.assert_array_equal(llava.modality, internvl.modality)
    np.testing.assert_array_equal(llava.text_tokens, internvl.text_tokens)
    assert set(np.unique(internvl.tokens_per_unit)) <= {0, 1025}


def test_synthetic_mix_proportions():
    n = 20_000
    shapes = synthetic_shapes(n, seed=0)
    fractions = np.bincount(shapes.modality, minlength=4) / n
    mix = MixSpec()
    expected = {
        Modality.TEXT: mix.text,
        Modality.IMAGE: mix.single_image,
        Modality.MULTI_IMAGE: mix.multi_image,
        Modality.VIDEO: mix.video,
    }
    for code, fraction in expected.items():
        assert abs(fractions[code] - fraction) < 0.015, Modality.NAMES[code]
    custom = synthetic_shapes(
        n, seed=0, mix={"single_image": 0.2, "video": 0.5, "text": 0.3, "multi_image": 0.0}
    )
    fractions = np.bincount(custom.modality, minlength=4) / n
    assert fractions[Modality.MULTI_IMAGE] == 0.0
    assert abs(fractions[Modality.VIDEO] - 0.5) < 0.015


def test_synthetic_shapes_are_realistic():
    shapes = synthetic_shapes(20_000, seed=1)
    mod = shapes.modality
    single = shapes.encoder_units[mod == Modality.IMAGE]
    assert single.min() >= 2 and single.max() <= 37
    assert 5 < single.mean() < 20
    multi = shapes.encoder_units[mod == Modality.MULTI_IMAGE]
    assert multi.min() >= 2 and multi.max() <= 12
    frames = shapes.encoder_units[mod == Modality.VIDEO]
    assert frames.min() >= 4 and frames.max() == 32
    assert 0.4 < np.mean(frames == 32) < 0.9
    # Heavy-tailed text, capped.
    text = shapes.text_tokens
    assert text.min() >= 8 and text.max() <= 8192
    assert np.percentile(text, 99) > 8 * np.median(text)
    assert np.all(shapes.seq_len == shapes.llm_visual_tokens + shapes.text_tokens)


def test_synthetic_empty_and_types():
    shapes = synthetic_shapes(0)
    assert len(shapes) == 0
    assert synthetic_costs(0).shape == (0, 2)
    shapes = synthetic_shapes(10)
    assert isinstance(shapes, SampleShapes)
    for name in ("encoder_units", "tokens_per_unit", "llm_visual_tokens", "text_tokens"):
        assert getattr(shapes, name).dtype == np.int64


def test_synthetic_is_fast():
    synthetic_costs(1000)
    start = time.perf_counter()
    costs = synthetic_costs(65_536, seed=1)
    elapsed_s = time.perf_counter() - start
    assert costs.shape == (65_536, 2)
    # ~20-40 ms on an idle core; generous bound for loaded CI machines.
    assert elapsed_s < 1.0


# ----------------------------------------------------------------------------- costs


@pytest.mark.parametrize("encoder", sorted(ENCODER_PRESETS))
@pytest.mark.parametrize("llm", sorted(LLM_PRESETS))
def test_costs_are_finite_and_non_negative(encoder, llm):
    costs = synthetic_costs(2000, seed=4, encoder=encoder, llm=llm)
    assert costs.shape == (2000, 2) and costs.dtype == np.float64
    assert np.all(np.isfinite(costs)) and np.all(costs >= 0)
    assert np.all(costs[:, 1] > 0)


def test_llm_attention_term_is_quadratic():
    llm = LLM_PRESETS["llm-7b"]
    seq = np.array([1000.0, 2000.0, 4000.0, 8000.0])
    linear, attention = llm.forward_flops_parts(seq)
    np.testing.assert_allclose(attention[1:] / attention[:-1], 4.0)
    np.testing.assert_allclose(linear[1:] / linear[:-1], 2.0)
    total = llm.forward_flops(seq)
    assert np.all(total[1:] > 2.0 * total[:-1])
    # Packed samples: one 8k sample costs more than two 4k samples.
    assert llm.forward_flops(8000.0) > 2 * llm.forward_flops(4000.0)


def test_llm_flops_match_parameter_count():
    # ~2 FLOPs per parameter per token (forward) for the GEMMs of a 7B / 72B model.
    assert 6.5e9 < LLM_PRESETS["llm-7b"].linear_flops_per_token / 2 < 7.8e9
    assert 68e9 < LLM_PRESETS["llm-72b"].linear_flops_per_token / 2 < 75e9


def test_encoder_cost_scales_with_units_and_tile_attention():
    model = AnalyticCostModel("siglip-400m", "llm-7b")
    shapes = SampleShapes(
        encoder_units=np.array([1, 2, 10]),
        tokens_per_unit=np.array([729, 729, 729]),
        llm_visual_tokens=np.array([0, 0, 0]),
        text_tokens=np.array([10, 10, 10]),
        modality=np.array([1, 1, 1], dtype=np.int8),
    )
    flops = model.flops(shapes)
    # Attention is within each tile: cost is linear in the number of tiles.
    np.testing.assert_allclose(flops[1, 0], 2 * flops[0, 0])
    np.testing.assert_allclose(flops[2, 0], 10 * flops[0, 0])
    costs = model.costs(shapes)
    np.testing.assert_allclose(costs[:, 0], flops[:, 0] / (312e12 * 0.4))
    assert model.microbatch_constant_s.shape == (2,)
    np.testing.assert_allclose(
        model.microbatch_time_s(shapes), costs.sum(axis=0) + model.microbatch_constant_s
    )


def test_heavy_encoder_dominates_with_internvl():
    costs = synthetic_costs(4000, seed=0, encoder="vit-6b", llm="llm-8b")
    assert costs[:, 0].sum() > costs[:, 1].sum()
    costs = synthetic_costs(4000, seed=0, encoder="siglip-400m", llm="llm-72b")
    assert costs[:, 0].sum() < 0.05 * costs[:, 1].sum()


# ----------------------------------------------------------------------------- errors


def test_get_family():
    assert get_family("llava-ov").tile_px == 384
    assert get_family("internvl").llm_tokens_per_tile == 256
    spec = get_family("internvl")
    assert get_family(spec) is spec
    with pytest.raises(ValueError, match=r"unknown family 'qwen-vl'.*internvl, llava-ov"):
        get_family("qwen-vl")
    with pytest.raises(ValueError, match="known families"):
        synthetic_shapes(10, family="nope")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"video": -0.1, "single_image": 0.85}, "MixSpec.video"),
        ({"text": float("nan")}, "MixSpec.text"),
        ({"single_image": 0.5}, "sum to 0.85"),
    ],
)
def test_mixspec_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MixSpec(**kwargs)


def test_mix_mapping_errors():
    with pytest.raises(ValueError, match="unknown field.*images"):
        synthetic_shapes(10, mix={"images": 1.0})
    with pytest.raises(TypeError, match="mix"):
        synthetic_shapes(10, mix=[0.25] * 4)


def test_synthetic_argument_errors():
    with pytest.raises(ValueError, match="num_samples"):
        synthetic_shapes(-1)
    with pytest.raises(TypeError, match="num_samples"):
        synthetic_shapes(10.5)
    with pytest.raises(TypeError, match="seed"):
        synthetic_shapes(10, seed="x")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="EncoderConfig.num_heads"):
        EncoderConfig("bad", 1000, 2, 4000, 7, 729)
    with pytest.raises(ValueError, match="EncoderConfig.num_layers"):
        EncoderConfig("bad", 1024, 0, 4096, 16, 729)
    with pytest.raises(ValueError, match="LLMConfig.num_kv_heads"):
        LLMConfig("bad", 4096, 32, 14336, 32, 5, 32000)
    with pytest.raises(TypeError, match="LLMConfig.vocab_size"):
        LLMConfig("bad", 4096, 32, 14336, 32, 8, 32000.0)
    with pytest.raises(ValueError, match="FamilySpec.tiling"):
        FamilySpec("x", "grid", 384, 729, 729)
    with pytest.raises(ValueError, match="FamilySpec.max_frames"):
        FamilySpec("x", "anyres", 384, 729, 729, max_frames=0)
    with pytest.raises(ValueError, match="mfu"):
        AnalyticCostModel(mfu=1.5)
    with pytest.raises(ValueError, match="gpu_flops"):
        AnalyticCostModel(gpu_flops=math.inf)
    with pytest.raises(ValueError, match="unknown llm preset 'llm-9b'.*llm-72b"):
        AnalyticCostModel(llm="llm-9b")
    with pytest.raises(TypeError, match="shapes"):
        AnalyticCostModel().costs(np.zeros((3, 2)))


def test_descriptor_errors_name_the_argument_and_index():
    with pytest.raises(ValueError, match=r"width_px\[1\]=0.0"):
        image_shapes("llava-ov", [640, 0], [480, 480])
    with pytest.raises(ValueError, match=r"image_height_px\[0\]=nan"):
        shapes_from_descriptors(
            "llava-ov",
            modality=[Modality.IMAGE],
            text_tokens=[1],
            image_sample_index=[0],
            image_width_px=[10],
            image_height_px=[float("nan")],
        )
    with pytest.raises(ValueError, match=r"image_sample_index\[0\]=5 is out of range"):
        shapes_from_descriptors(
            "llava-ov",
            modality=[Modality.IMAGE],
            text_tokens=[1],
            image_sample_index=[5],
            image_width_px=[10],
            image_height_px=[10],
        )
    with pytest.raises(ValueError, match=r"num_frames\[0\]"):
        video_shapes("llava-ov", [0])
    with pytest.raises(ValueError, match=r"sample 1 \(image\) owns 2 images"):
        shapes_from_descriptors(
            "llava-ov",
            modality=[Modality.TEXT, Modality.IMAGE],
            text_tokens=[1, 1],
            image_sample_index=[1, 1],
            image_width_px=[10, 10],
            image_height_px=[10, 10],
        )
    with pytest.raises(ValueError, match=r"video_num_frames\[1\]"):
        shapes_from_descriptors(
            "llava-ov",
            modality=[Modality.VIDEO, Modality.VIDEO],
            text_tokens=[1, 1],
            video_num_frames=[3, 0],
        )
    with pytest.raises(ValueError, match=r"modality\[0\]"):
        shapes_from_descriptors("llava-ov", modality=[7], text_tokens=[1])
    with pytest.raises(ValueError, match=r"text_tokens\[0\]"):
        shapes_from_descriptors("llava-ov", modality=[0], text_tokens=[-3])
