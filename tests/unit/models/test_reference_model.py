"""Tests of dflop's reference multimodal model (dflop.models)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from dflop.models import (  # noqa: E402
    DECODER_PRESETS,
    IGNORE_INDEX,
    MODEL_PRESETS,
    VISION_PRESETS,
    Decoder,
    DecoderStage,
    ModelConfig,
    ProjectorConfig,
    VisionConfig,
    VisionStage,
    build_model,
    model_config,
    next_token_targets,
    packed_positions,
)

TINY = MODEL_PRESETS["tiny"]
TPU = TINY.vision.tokens_per_unit  # 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Fast and quiet on shared cores; restored for other test modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def assert_close(actual, expected, atol: float = 1e-5) -> None:
    """Like torch.testing.assert_close (which imports sympy: seconds) for float tensors."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert diff <= atol, f"max abs difference {diff} > {atol}"


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


def _batch(units: list[int], text: list[int], seed: int = 0, config=TINY) -> dict:
    """A packed microbatch: sample i = [image placeholders of units[i] units] + text[i] tokens."""
    g = torch.Generator().manual_seed(seed)
    v = TINY.vision
    visual = [int(config.llm_visual_tokens(u)) for u in units]
    lens = [n + t for n, t in zip(visual, text)]
    token_ids, mask = [], []
    for n, t in zip(visual, text):
        token_ids.append(torch.zeros(n, dtype=torch.long))
        token_ids.append(torch.randint(1, TINY.decoder.vocab_size, (t,), generator=g))
        mask += [True] * n + [False] * t
    token_ids = torch.cat(token_ids)
    return {
        "pixel_values": torch.randn(
            sum(units), v.channels, v.image_size_px, v.image_size_px, generator=g
        ),
        "unit_counts_per_sample": torch.tensor(units),
        "token_ids": token_ids,
        "image_token_mask": torch.tensor(mask),
        "cu_seqlens": _cu(lens),
        "labels": token_ids.clone(),
    }


# ----------------------------------------------------------------------------- shapes


def test_shapes(model):
    v, d = TINY.vision, TINY.decoder
    pixels = torch.randn(3, v.channels, v.image_size_px, v.image_size_px)
    assert v.tokens_per_unit == 16
    assert model.vision.encode(pixels).shape == (3, 16, v.hidden)
    assert model.vision.projector(torch.randn(2, 5, v.hidden)).shape == (2, 5, d.hidden)
    assert model.vision(pixels).shape == (3 * 16, d.hidden)
    ids = torch.randint(0, d.vocab_size, (11,))
    embeds = model.decoder.embed(ids)
    assert embeds.shape == (11, d.hidden)
    assert model.decoder(embeds, _cu([4, 7])).shape == (11, d.vocab_size)


def test_vision_tower_flattens_in_unit_order(model):
    v = TINY.vision
    pixels = torch.randn(2, v.channels, v.image_size_px, v.image_size_px)
    with torch.no_grad():
        both = model.vision(pixels)
        second = model.vision(pixels[1:])
    assert_close(both[TPU:], second)


def test_bad_inputs_raise(model):
    with pytest.raises(ValueError, match="pixel_values"):
        model.vision(torch.randn(1, 3, 31, 31))
    embeds = torch.randn(5, TINY.decoder.hidden)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model.decoder(embeds, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.decoder(
            torch.randn(TINY.decoder.max_seq_len + 1, TINY.decoder.hidden),
            _cu([TINY.decoder.max_seq_len + 1]),
        )
    batch = _batch([1, 0], [3, 4])
    batch["unit_counts_per_sample"] = torch.tensor([0, 1])  # placeholders are in sample 0
    with pytest.raises(ValueError, match="sample 0 has 16 image placeholder"):
        model(**batch)


# ----------------------------------------------------------------------------- packing


def test_packed_positions_restart_per_sample():
    assert packed_positions(_cu([3, 0, 2]), 5).tolist() == [0, 1, 2, 0, 1]


def test_packed_attention_equals_separate_samples(model):
    d = model.decoder
    lens = [5, 9, 1, 7]
    embeds = torch.randn(sum(lens), TINY.decoder.hidden)
    with torch.no_grad():
        packed = d(embeds, _cu(lens))
        separate = torch.cat([d(part, _cu([len(part)])) for part in embeds.split(lens)])
    assert_close(packed, separate)


def test_no_cross_sample_leakage(model):
    d = model.decoder
    lens = [6, 8, 4]
    ids = torch.randint(0, TINY.decoder.vocab_size, (sum(lens),))
    changed = ids.clone()
    changed[6:14] = (changed[6:14] + 1) % TINY.decoder.vocab_size  # sample 1 only
    with torch.no_grad():
        a = d(d.embed(ids), _cu(lens))
        b = d(d.embed(changed), _cu(lens))
    assert_close(a[:6], b[:6], atol=0)
    assert_close(a[14:], b[14:], atol=0)
    assert not torch.allclose(a[6:14], b[6:14])


def test_causal_within_sample(model):
    d = model.decoder
    ids = torch.randint(0, TINY.decoder.vocab_size, (10,))
    changed = ids.clone()
    changed[7] = (changed[7] + 1) % TINY.decoder.vocab_size
    with torch.no_grad():
        a = d(d.embed(ids), _cu([10]))
        b = d(d.embed(changed), _cu([10]))
    assert_close(a[:7], b[:7], atol=0)
    assert not torch.allclose(a[7:], b[7:])


# ----------------------------------------------------------------------------- loss


def test_next_token_targets_shift_within_samples():
    labels = torch.tensor([10, 11, 12, 20, 21, IGNORE_INDEX, 31])
    targets = next_token_targets(labels, _cu([3, 2, 2]))
    assert targets.tolist() == [11, 12, -100, 21, -100, 31, -100]


def test_loss_counts_only_labelled_targets(model):
    d = model.decoder
    lens = [5, 4]
    ids = torch.randint(0, TINY.decoder.vocab_size, (9,))
    labels = ids.clone()
    labels[[0, 2, 6]] = IGNORE_INDEX
    embeds = d.embed(ids)
    with torch.no_grad():
        sum_loss, count = d.loss(embeds, _cu(lens), labels)
        logits = d(embeds, _cu(lens))
    # Targets: sample 0 predicts positions 1, 3, 4 (2 ignored); sample 1 predicts 7, 8
    # (6 ignored); position 5 (sample 1's first token) is never a target.
    pairs = [(0, 1), (2, 3), (3, 4), (6, 7), (7, 8)]
    expected = sum(
        torch.nn.functional.cross_entropy(logits[p], labels[t], reduction="sum") for p, t in pairs
    )
    assert count.item() == len(pairs)
    assert_close(sum_loss, expected)


def test_loss_sums_so_global_normalisation_is_exact(model):
    d = model.decoder
    lens_a, lens_b = [7, 3], [12]
    ids = torch.randint(0, TINY.decoder.vocab_size, (sum(lens_a) + sum(lens_b),))
    with torch.no_grad():
        sa, na = d.loss(d.embed(ids[:10]), _cu(lens_a), ids[:10])
        sb, nb = d.loss(d.embed(ids[10:]), _cu(lens_b), ids[10:])
        sall, nall = d.loss(d.embed(ids), _cu(lens_a + lens_b), ids)
    assert na.item() + nb.item() == nall.item() == sum(lens_a + lens_b) - 3
    # Sums of hundreds of float32 token losses: compare relative to their size.
    assert_close(sa + sb, sall, atol=1e-6 * float(sall.abs()) + 1e-5)


def test_multimodal_loss_ignores_image_positions(model):
    batch = _batch([1, 0, 2], [5, 6, 3])
    with torch.no_grad():
        sum_loss, count = model(**batch)
        other = dict(batch, token_ids=batch["token_ids"].masked_fill(batch["image_token_mask"], 7))
        other["labels"] = other["token_ids"]
        sum_loss2, count2 = model(**other)
    # A sample's text tokens after its image are all targets (the last image position
    # predicts the first text token); a text-only sample's first token is not.
    assert count.item() == 5 + (6 - 1) + 3
    assert count2.item() == count.item()
    assert_close(sum_loss, sum_loss2)


# ----------------------------------------------------------------------------- gradients


def test_gradients_reach_vision_through_scatter():
    model = build_model("tiny", seed=3)
    batch = _batch([2, 1], [4, 5])
    sum_loss, count = model(**batch)
    (sum_loss / count).backward()
    for name in (
        "encoder.embeddings.patch_embedding.weight",
        "encoder.blocks.0.self_attn.q_proj.weight",
        "projector.linear_1.weight",
    ):
        grad = model.vision.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert model.decoder.get_parameter("embed_tokens.weight").grad.abs().sum() > 0


def test_text_only_microbatch(model):
    batch = _batch([0, 0], [4, 5])
    with torch.no_grad():
        sum_loss, count = model(**batch)
    assert count.item() == 7 and torch.isfinite(sum_loss)


NEWLINE = dataclasses.replace(TINY, decoder=dataclasses.replace(TINY.decoder, image_newline=True))


def test_image_newline_follows_each_visual_sample():
    model = build_model(NEWLINE, seed=3)
    units, text = [2, 0, 1], [4, 5, 3]
    batch = _batch(units, text, config=NEWLINE)
    assert int(batch["image_token_mask"].sum()) == 3 * TPU + 2  # one newline per visual sample
    embeds = model.input_embeds(*(batch[k] for k in list(batch)[:5]))
    # The newline row sits after the sample's last unit: the end of its placeholders.
    for end in (2 * TPU, 5 + 4 + 1 * TPU + 1 + 2 * TPU):
        assert_close(embeds[end], model.decoder.image_newline.detach(), atol=0)
    # Packed equals sample by sample (each sample's features get their own newline).
    cu, first_unit = batch["cu_seqlens"].tolist(), [0, 2, 2, 3]
    with torch.no_grad():
        packed, _ = model(**batch)
        alone = 0.0
        for i, u in enumerate(units):
            t0, t1 = cu[i], cu[i + 1]
            one = {k: batch[k][t0:t1] for k in ("token_ids", "image_token_mask", "labels")}
            pixels = batch["pixel_values"][first_unit[i] : first_unit[i + 1]]
            alone += model(pixels, torch.tensor([u]), cu_seqlens=_cu([t1 - t0]), **one)[0]
    assert_close(packed, alone, atol=1e-4)
    sum_loss, count = model(**batch)
    (sum_loss / count).backward()
    assert model.decoder.image_newline.grad.abs().sum() > 0
    assert model.vision.get_parameter("projector.linear_1.weight").grad.abs().sum() > 0
    # A batch laid out without the newline is refused, naming it.
    with pytest.raises(ValueError, match=r"2 units x 16 tokens per unit \+ 1 newline = 33"):
        model(**_batch(units, text))
    meta = build_model(NEWLINE, device="meta")
    assert sum(p.numel() for p in meta.parameters()) == NEWLINE.num_parameters()
    assert NEWLINE.num_parameters() == TINY.num_parameters() + TINY.decoder.hidden
    assert ModelConfig.from_dict(NEWLINE.to_dict()) == NEWLINE
    with pytest.raises(ValueError, match="no image_newline"):
        build_model("tiny").decoder.append_visual_newlines(torch.zeros(2, 64), [2])


# ----------------------------------------------------------------------------- stages


def test_decoder_stage_split_equals_full(model):
    d = model.decoder
    first = d.stage(0, 1, has_embed=True, has_head=False)
    last = d.stage(1, 2, has_embed=False, has_head=True)
    lens = [5, 8]
    ids = torch.randint(0, TINY.decoder.vocab_size, (13,))
    with torch.no_grad():
        full = d(d.embed(ids), _cu(lens))
        split = last(first(first.embed(ids), _cu(lens)), _cu(lens))
        full_loss = d.loss(d.embed(ids), _cu(lens), ids)
        split_loss = last.loss(first(first.embed(ids), _cu(lens)), _cu(lens), ids)
    assert_close(split, full, atol=0)
    assert_close(split_loss[0], full_loss[0], atol=0)
    assert split_loss[1].item() == full_loss[1].item()
    assert set(first.state_dict()) | set(last.state_dict()) == set(d.state_dict())
    assert first.get_parameter("layers.0.mlp.up_proj.weight") is d.get_parameter(
        "layers.0.mlp.up_proj.weight"
    )


def test_vision_stage_split_equals_full(model):
    vt = model.vision
    first = vt.stage(0, 1, has_embed=True, has_head=False)
    last = vt.stage(1, 2, has_embed=False, has_head=True)
    v = TINY.vision
    pixels = torch.randn(3, v.channels, v.image_size_px, v.image_size_px)
    with torch.no_grad():
        mid = first(pixels)
        assert mid.shape == (3, TPU, v.hidden)
        assert_close(last(mid), vt(pixels), atol=0)


def test_standalone_stages_get_the_full_models_weights(model):
    stage = DecoderStage(TINY.decoder, 1, 2, has_embed=False, has_head=True)
    stage.init_weights(0)
    full = model.decoder.state_dict()
    for name, tensor in stage.state_dict().items():
        assert_close(tensor, full[name], atol=0)
    vstage = VisionStage(TINY.vision, TINY.projector, 0, 1, has_embed=True, has_head=False)
    vstage.init_weights(0)
    vfull = model.vision.state_dict()
    for name, tensor in vstage.state_dict().items():
        assert_close(tensor, vfull[name], atol=0)


def test_bad_stage_range_names_the_layers():
    with pytest.raises(ValueError, match="end_layer=3"):
        DecoderStage(TINY.decoder, 1, 3, has_embed=False, has_head=True)


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: dataclasses.replace(TINY.decoder, heads=3),
            "DecoderConfig.heads=3 must divide hidden=64",
        ),
        (
            lambda: dataclasses.replace(TINY.decoder, kv_heads=3),
            "DecoderConfig.kv_heads=3 must divide heads=4",
        ),
        (lambda: dataclasses.replace(TINY.decoder, vocab_size=0), "DecoderConfig.vocab_size=0"),
        (lambda: dataclasses.replace(TINY.decoder, hidden=60, heads=20), "odd head_dim"),
        (
            lambda: dataclasses.replace(TINY.vision, patch_size_px=64),
            "VisionConfig.patch_size_px=64",
        ),
        (
            lambda: dataclasses.replace(TINY.vision, heads=5),
            "VisionConfig.heads=5 must divide hidden=64",
        ),
        (lambda: ProjectorConfig(vision_hidden=64, hidden=-1), "ProjectorConfig.hidden=-1"),
        (
            lambda: ModelConfig(TINY.vision, ProjectorConfig(32, 64), TINY.decoder),
            "ProjectorConfig.vision_hidden=32 must equal VisionConfig.hidden=64",
        ),
        (lambda: model_config("huge"), "unknown model preset 'huge'"),
        (
            lambda: ModelConfig.from_dict(
                {**TINY.to_dict(), "decoder": {**TINY.to_dict()["decoder"], "layerz": 2}}
            ),
            "DecoderConfig has no field 'layerz'",
        ),
    ],
)
def test_config_errors_name_the_field(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_presets_and_parameter_counts():
    assert set(MODEL_PRESETS) >= {"tiny", "small", "siglip-400m+llm-0.5b", "siglip-400m+llm-7b"}
    assert VISION_PRESETS["siglip-400m"].tokens_per_unit == 729
    assert model_config("tiny+small").decoder == DECODER_PRESETS["small"]
    assert ModelConfig.from_dict(TINY.to_dict()) == TINY
    for name, config in MODEL_PRESETS.items():
        meta = build_model(name, device="meta")
        assert sum(p.numel() for p in meta.parameters()) == config.num_parameters(), name
    assert 2e6 < MODEL_PRESETS["small"].num_parameters() < 2e7
    assert 7e9 < MODEL_PRESETS["siglip-400m+llm-7b"].num_parameters() < 9e9


def test_deterministic_init():
    a, b, c = build_model("tiny", seed=5), build_model("tiny", seed=5), build_model("tiny", seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name in sa:
        assert_close(sa[name], sb[name], atol=0)
    assert not torch.equal(
        sa["decoder.layers.0.self_attn.q_proj.weight"],
        sc["decoder.layers.0.self_attn.q_proj.weight"],
    )
    # Different parameters of the same shape draw different values.
    assert not torch.equal(
        sa["decoder.layers.0.self_attn.q_proj.weight"],
        sa["decoder.layers.1.self_attn.q_proj.weight"],
    )


def test_decoder_builds_on_its_own():
    decoder = Decoder(DECODER_PRESETS["tiny"])
    decoder.init_weights(0)
    assert isinstance(decoder.stage(0, 2, has_embed=True, has_head=True), DecoderStage)
    assert (
        VisionConfig(
            image_size_px=384, patch_size_px=14, hidden=8, layers=1, heads=2, mlp_hidden=8
        ).patches_per_side
        == 27
    )
