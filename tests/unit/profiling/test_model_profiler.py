"""Model profiler on small torch modules (and dflop's tiny reference model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from dflop.profiling import (  # noqa: E402
    CostModel,
    PerformanceModel,
    ProfileResult,
    default_seq_len_mixes,
    default_unit_counts,
    fit_performance_model,
    profile_model,
)
from torch import nn  # noqa: E402


class ToyVision(nn.Module):
    """[U, 3, 8, 8] -> [U * 4, 16]: 4 tokens per unit."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * 4 * 4, 16)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        u = pixel_values.shape[0]
        patches = pixel_values.reshape(u, 3, 2, 4, 2, 4).permute(0, 2, 4, 1, 3, 5)
        return torch.relu(self.proj(patches.reshape(u * 4, 48)))


class ToyDecoder(nn.Module):
    """embed / forward(input_embeds, cu_seqlens) with per-sequence causal attention."""

    def __init__(self, hidden: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.head = nn.Linear(hidden, vocab)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(token_ids)

    def forward(self, input_embeds: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(input_embeds).chunk(3, dim=-1)
        bounds = cu_seqlens.tolist()
        parts = [
            torch.nn.functional.scaled_dot_product_attention(
                q[None, a:b], k[None, a:b], v[None, a:b], is_causal=True
            )[0]
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        return self.head(torch.cat(parts) + input_embeds)


SMALL_MIXES = [(64,), (32, 32), (48, 16), (128,), (64, 64), (96, 32), (32, 32, 32, 32)]


def test_profile_toy_modules_and_fit() -> None:
    result = profile_model(
        ToyVision(),
        ToyDecoder(),
        unit_counts=[1, 2, 4, 8],
        seq_len_mixes=SMALL_MIXES,
        image_shape=(3, 8, 8),
        warmup=1,
        repeats=3,
        num_threads=1,
    )
    assert [m.num_units for m in result.encoder] == [1, 2, 4, 8]
    assert [m.seq_lens for m in result.decoder] == SMALL_MIXES
    assert result.tokens_per_unit == 4 and result.tensor_parallel_size == 1
    for m in result.encoder + result.decoder:
        assert len(m.times_s) == 3 and m.time_s == pytest.approx(float(np.median(m.times_s)))
        assert m.time_s > 0 and m.peak_bytes > 0
    # memory grows with the work
    assert result.encoder[-1].peak_bytes > result.encoder[0].peak_bytes
    assert result.decoder[3].peak_bytes > result.decoder[0].peak_bytes
    meta = result.metadata
    assert meta["device_type"] == "cpu" and meta["torch_version"] == torch.__version__
    assert meta["decoder"]["vocab_size"] == 32 and meta["vision"]["tokens_per_unit"] == 4
    assert "saved tensors" in meta["memory_method"]

    model = fit_performance_model(result, holdout_fraction=0.25)
    assert model.encoder_fit.num_holdout_points == 1
    assert model.llm_fit.num_holdout_points == 1
    assert math.isfinite(model.llm_fit.holdout_median_abs_rel_error)
    assert model.encoder.per_unit_s > 0 or model.encoder.constant_s > 0
    assert model.metadata["device_type"] == "cpu"
    assert model.tokens_per_unit == 4
    costs = CostModel(model).costs  # plugs in
    assert callable(costs)


def test_profile_result_roundtrip(tmp_path) -> None:
    result = profile_model(
        None,
        ToyDecoder(),
        seq_len_mixes=SMALL_MIXES[:4],
        warmup=0,
        repeats=1,
        measure_memory=False,
        vocab_size=32,
    )
    assert result.encoder == [] and all(math.isnan(m.peak_bytes) for m in result.decoder)
    path = tmp_path / "profile.json"
    result.save(path)
    loaded = ProfileResult.load(path)
    assert [(m.seq_lens, m.time_s, m.times_s) for m in loaded.decoder] == [
        (m.seq_lens, m.time_s, m.times_s) for m in result.decoder
    ]
    assert all(math.isnan(m.peak_bytes) for m in loaded.decoder)
    assert "NaN" not in path.read_text()  # strict JSON
    model = fit_performance_model(loaded, holdout_fraction=0.0)
    assert model.encoder.per_unit_s == 0.0 and model.llm_memory.per_item_bytes == 0.0
    assert isinstance(model, PerformanceModel)
    # Memory that was not measured is said to be so, not printed as 0 MiB.
    assert "memory:  encoder not measured; llm not measured" in model.summary()
    assert model.metadata["memory_measured"] == {"encoder": False, "llm": False}


def test_reference_tiny_model_profiles() -> None:
    models = pytest.importorskip("dflop.models")
    model = models.build_model("tiny", seed=0)
    result = profile_model(
        model.vision,
        model.decoder,
        unit_counts=[1, 2, 4],
        seq_len_mixes=[(64,), (32, 32), (128,), (64, 64), (96, 32), (48, 16)],
        warmup=1,
        repeats=1,
        num_threads=1,
    )
    assert result.tokens_per_unit == models.VISION_PRESETS["tiny"].tokens_per_unit
    assert result.metadata["decoder"]["loss"] == "decoder.loss"
    assert "decoder_config" in result.metadata["decoder"] or "config" in result.metadata["decoder"]
    perf = fit_performance_model(result, holdout_fraction=0.25)
    assert perf.llm_fit.num_holdout_points == 1


def test_default_grids_identify_the_terms() -> None:
    units = default_unit_counts(16)
    assert units[0] == 1 and units[-1] == 16 and len(units) >= 6
    mixes = default_seq_len_mixes(2048)
    totals = {sum(m) for m in mixes}
    assert totals == {2048, 1024, 512, 256}
    for total in totals:  # same total, several sum(seq^2): the quadratic term is separable
        sq = {sum(s * s for s in m) for m in mixes if sum(m) == total}
        assert len(sq) >= 3
    features = np.array([[sum(m), sum(s * s for s in m), 1] for m in mixes], float)
    assert np.linalg.matrix_rank(features / features.max(axis=0)) == 3


def test_profile_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        profile_model(ToyVision(), None, image_shape=(3, 8, 8), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="image_shape"):
        profile_model(ToyVision(), None, unit_counts=[1])
    with pytest.raises(ValueError, match=r"unit_counts\[1\]"):
        profile_model(ToyVision(), None, unit_counts=[1, 0], image_shape=(3, 8, 8))
    with pytest.raises(ValueError, match=r"seq_len_mixes\[0\]\[1\]"):
        profile_model(None, ToyDecoder(), seq_len_mixes=[(4, -1)])
    with pytest.raises(ValueError, match="repeats"):
        profile_model(None, ToyDecoder(), repeats=0)
    with pytest.raises(ValueError, match="nothing to profile"):
        profile_model(None, None)
    with pytest.raises(TypeError, match="decoder must be a torch.nn.Module"):
        profile_model(None, object())
    with pytest.raises(TypeError, match="result must be a ProfileResult"):
        fit_performance_model({})  # type: ignore[arg-type]


def test_thread_clock_option() -> None:
    result = profile_model(
        None,
        ToyDecoder(),
        seq_len_mixes=SMALL_MIXES[:3],
        warmup=0,
        repeats=2,
        num_threads=1,
        cpu_clock="thread",
        measure_memory=False,
    )
    assert result.metadata["timer"] == "time.thread_time"
    assert all(m.time_s > 0 for m in result.decoder)
    with pytest.raises(ValueError, match="cpu_clock='thread' needs num_threads=1"):
        profile_model(None, ToyDecoder(), num_threads=2, cpu_clock="thread")
    with pytest.raises(ValueError, match="cpu_clock must be"):
        profile_model(None, ToyDecoder(), cpu_clock="monotonic")


def _frozen_flags(module: nn.Module) -> list[bool]:
    return [p.requires_grad for p in module.parameters()]


def test_frozen_variants_on_the_tiny_reference_model() -> None:
    """Forward alone and the pass-through step are measured for both modules; the shares
    fitted from them are in range; the modules' flags and gradients are left as found."""
    models = pytest.importorskip("dflop.models")
    model = models.build_model("tiny", seed=0)
    vision, decoder = model.vision, model.decoder
    first = next(iter(decoder.parameters()))
    first.requires_grad_(False)  # a user's partly frozen module: flags restored as they were
    flags = (_frozen_flags(vision), _frozen_flags(decoder))
    mixes = [(64,), (32, 32), (128,), (64, 64), (96, 32), (48, 16)]
    result = profile_model(
        vision,
        decoder,
        unit_counts=[1, 2, 4],
        seq_len_mixes=mixes,
        warmup=1,
        repeats=3,
        num_threads=1,
        frozen_shapes=None,
    )
    assert (_frozen_flags(vision), _frozen_flags(decoder)) == flags
    assert all(p.grad is None for p in [*vision.parameters(), *decoder.parameters()])
    for m in result.encoder + result.decoder:
        assert m.forward_time_s > 0 and m.passthrough_time_s > 0
        assert m.saved_bytes > 0 and m.passthrough_saved_bytes >= 0
        assert m.passthrough_saved_bytes <= m.saved_bytes
    for m in result.decoder:  # frozen linear layers keep their weight, not their input
        assert m.passthrough_saved_bytes < m.saved_bytes
    assert result.metadata["decoder"]["frozen"] == {
        "forward_shapes": len(mixes),
        "passthrough_shapes": len(mixes),
        "note": None,
    }

    perf = fit_performance_model(result, holdout_fraction=0.25)
    for name in ("forward_fraction", "passthrough_backward_factor"):
        encoder_share, llm_share = getattr(perf, name)
        assert 0.0 < encoder_share <= 1.0 and 0.0 < llm_share <= 1.0, name
    encoder_share, llm_share = perf.passthrough_activation_fraction
    assert 0.0 <= encoder_share <= 1.0 and 0.0 < llm_share < 1.0
    factors = CostModel(perf).passthrough_factors
    assert factors["backward"] == perf.passthrough_backward_factor
    assert "frozen:  forward" in perf.summary()
    # survives the profile's and the model's JSON
    again = fit_performance_model(ProfileResult.from_dict(result.to_dict()), holdout_fraction=0.25)
    assert again.passthrough_activation_fraction == perf.passthrough_activation_fraction
    assert again.forward_fraction == perf.forward_fraction
    loaded = PerformanceModel.from_dict(perf.to_dict())
    assert loaded.passthrough_backward_factor == perf.passthrough_backward_factor


def test_frozen_variants_on_a_subset_or_none() -> None:
    result = profile_model(
        ToyVision(),
        ToyDecoder(),
        unit_counts=[1, 2, 4, 8],
        seq_len_mixes=SMALL_MIXES,
        image_shape=(3, 8, 8),
        warmup=0,
        repeats=1,
        num_threads=1,
        frozen_shapes=2,
    )
    # the first and last shape of each grid
    assert [m.forward_time_s is not None for m in result.encoder] == [True, False, False, True]
    assert [m.passthrough_time_s is not None for m in result.decoder] == [True] + [False] * 5 + [
        True
    ]
    assert all(m.saved_bytes > 0 for m in result.encoder + result.decoder)  # every shape
    assert result.metadata["frozen_shapes"] == 2
    perf = fit_performance_model(result, holdout_fraction=0.0)
    assert perf.forward_fraction is not None and perf.passthrough_activation_fraction is not None

    none = profile_model(
        ToyVision(),
        ToyDecoder(),
        unit_counts=[1, 2],
        seq_len_mixes=SMALL_MIXES[:4],
        image_shape=(3, 8, 8),
        warmup=0,
        repeats=1,
        frozen_shapes=0,
        measure_memory=False,
    )
    assert all(m.forward_time_s is None for m in none.encoder + none.decoder)
    perf = fit_performance_model(none, holdout_fraction=0.0)
    assert perf.forward_fraction is None and perf.passthrough_backward_factor is None
    assert CostModel(perf).passthrough_factors is None
    assert "frozen:" not in perf.summary()
    # one module only: the shares are (encoder, llm) pairs, so there are none
    decoder_only = profile_model(
        None, ToyDecoder(), seq_len_mixes=SMALL_MIXES[:4], warmup=0, repeats=1, vocab_size=32
    )
    assert decoder_only.decoder[0].forward_time_s is not None
    assert fit_performance_model(decoder_only, holdout_fraction=0.0).forward_fraction is None
    with pytest.raises(ValueError, match="frozen_shapes"):
        profile_model(None, ToyDecoder(), frozen_shapes=-1)


class DetachedVision(ToyVision):
    """Its output does not depend on its input's gradient: no pass-through to time."""

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return super().forward(pixel_values.detach())


def test_pass_through_skipped_when_the_input_gets_no_gradient() -> None:
    vision = DetachedVision()
    result = profile_model(
        vision,
        ToyDecoder(),
        unit_counts=[1, 2],
        seq_len_mixes=SMALL_MIXES[:4],
        image_shape=(3, 8, 8),
        warmup=0,
        repeats=1,
        measure_memory=False,
    )
    assert all(p.requires_grad for p in vision.parameters())
    assert all(m.forward_time_s is not None for m in result.encoder)
    assert all(m.passthrough_time_s is None for m in result.encoder)
    assert "pass-through not measured" in result.metadata["vision"]["frozen"]["note"]
    perf = fit_performance_model(result, holdout_fraction=0.0)
    assert perf.forward_fraction is not None
    assert perf.passthrough_backward_factor is None
    assert perf.passthrough_activation_fraction is None  # memory not measured
    assert CostModel(perf).passthrough_factors == {
        "forward_fraction": perf.forward_fraction,
        "backward": None,
        "activations": None,
    }


def test_old_profile_without_frozen_fields_loads() -> None:
    result = profile_model(
        None, ToyDecoder(), seq_len_mixes=SMALL_MIXES[:4], warmup=0, repeats=1, vocab_size=32
    )
    data = result.to_dict()
    for m in data["decoder"]:
        for name in ("forward_time_s", "passthrough_time_s", "saved_bytes"):
            del m[name]
        del m["passthrough_saved_bytes"]
    old = ProfileResult.from_dict(data)
    assert all(m.forward_time_s is None and m.saved_bytes is None for m in old.decoder)
    assert fit_performance_model(old, holdout_fraction=0.0).forward_fraction is None


def test_profiles_of_shares_of_a_grid_merge_in_grid_order() -> None:
    """merge_profiles: parts measured on shares of one grid (in separate processes, as a
    parallel quick profile does) come back as one profile in grid order, the frozen shape
    counts summed, and fit as one; orders that do not match their parts are refused."""
    from dflop.profiling import merge_profiles

    mixes = SMALL_MIXES
    common = dict(warmup=0, repeats=1, seed=0, num_threads=1)
    # Part 0: the encoder's unit counts 1 and 4, mixes 0, 2, ...; part 1: the rest.
    first = profile_model(
        ToyVision(), ToyDecoder(), image_shape=(3, 8, 8), unit_counts=[1, 4],
        seq_len_mixes=mixes[::2], frozen_shapes=2, **common,
    )  # fmt: skip
    second = profile_model(
        ToyVision(), ToyDecoder(), image_shape=(3, 8, 8), unit_counts=[2, 3],
        seq_len_mixes=mixes[1::2], frozen_shapes=2, **common,
    )  # fmt: skip
    evens, odds = list(range(0, len(mixes), 2)), list(range(1, len(mixes), 2))
    merged = merge_profiles([first, second], [[0, 3], [1, 2]], [evens, odds])
    assert [m.num_units for m in merged.encoder] == [1, 2, 3, 4]
    assert [m.seq_lens for m in merged.decoder] == [tuple(mix) for mix in mixes]
    assert merged.metadata["processes"] == 2
    frozen = merged.metadata["decoder"]["frozen"]
    assert frozen["forward_shapes"] == 4 and frozen["passthrough_shapes"] == 4
    assert merged.tokens_per_unit == first.tokens_per_unit == 4
    fit_performance_model(merged)  # one profile: the fit takes it as any other
    with pytest.raises(ValueError, match="one encoder and one decoder order per part"):
        merge_profiles([first, second], [[0, 3]], [evens, odds])
    with pytest.raises(ValueError, match="length differs"):
        merge_profiles([first, second], [[0], [1, 2]], [evens, odds])
