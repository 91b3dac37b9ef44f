"""Tests of dflop.runtime.tensor_parallel (torch's tensor-parallel API on dflop's stages).

Pure parts (the sharding plan, validation) run in-process. The numerical check runs real
gloo processes: a 4-rank world laid out as encoder tp=2 (ranks 0, 1) + LLM tp=2 (ranks 2,
3) through ``Topology.create``; each TP pair shards its stage over ``topology.tp_group``
and compares outputs, loss and all-gathered gradients with an unsharded tp=1 copy of the
same stage (same seed) run in the same process.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from dflop.models import DecoderStage, VisionStage, model_config  # noqa: E402
from dflop.models.decoder import IGNORE_INDEX  # noqa: E402
from dflop.runtime import RuntimeLayout, Topology, spawn_local  # noqa: E402
from dflop.runtime.tensor_parallel import (  # noqa: E402
    apply_tensor_parallel,
    check_tensor_parallel,
    full_tensor,
    grad_sq_sum,
    local_tensor,
    optimizer_param_groups,
    tensor_parallel_plan,
)

SEED = 5
SPAWN_TIMEOUT_S = 180.0
# Float32 on CPU; the sharded matmuls sum in a different order than the full ones.
ATOL, RTOL = 2e-5, 1e-4


def _config():
    """The tiny preset with every TP-split width divisible by 2 and 4 (vision heads 4,
    decoder heads 4 / kv_heads 2 already are; asserted so a preset change is noticed)."""
    config = model_config("tiny")
    for value in (config.vision.heads, config.decoder.heads, config.decoder.kv_heads):
        assert value % 2 == 0
    return config


def _decoder(first=0, end=None, *, has_embed=True, has_head=True, config=None):
    config = config or _config().decoder
    stage = DecoderStage(config, first, end, has_embed=has_embed, has_head=has_head)
    stage.init_weights(SEED)
    return stage


def _vision(first=0, end=None, *, has_embed=True, has_head=True):
    config = _config()
    end = config.vision.layers if end is None else end
    stage = VisionStage(
        config.vision, config.projector, first, end, has_embed=has_embed, has_head=has_head
    )
    stage.init_weights(SEED)
    return stage


# ---------------------------------------------------------------------------- pure parts


def test_decoder_plan_shards_attention_and_mlp_of_every_block():
    stage = _decoder(1, 2, has_embed=False, has_head=True)
    plan = tensor_parallel_plan(stage)
    assert plan == {
        "layers.1.self_attn.q_proj": "colwise",
        "layers.1.self_attn.k_proj": "colwise",
        "layers.1.self_attn.v_proj": "colwise",
        "layers.1.self_attn.o_proj": "rowwise",
        "layers.1.mlp.gate_proj": "colwise",
        "layers.1.mlp.up_proj": "colwise",
        "layers.1.mlp.down_proj": "rowwise",
        "lm_head": "vocab",  # the head's vocabulary rows over the ranks
    }
    # Every planned name is a real nn.Linear of the stage; embeddings and norms stay
    # replicated.
    modules = dict(stage.named_modules())
    assert all(isinstance(modules[name], torch.nn.Linear) for name in plan)
    assert "norm" not in plan


def test_vision_plan_includes_the_projector_only_on_the_head_stage():
    head = tensor_parallel_plan(_vision(1, 2, has_embed=False, has_head=True))
    assert head["encoder.blocks.1.self_attn.q_proj"] == "colwise"
    assert head["encoder.blocks.1.self_attn.out_proj"] == "rowwise"
    assert head["encoder.blocks.1.mlp.fc1"] == "colwise"
    assert head["encoder.blocks.1.mlp.fc2"] == "rowwise"
    assert head["projector.linear_1"] == "colwise"
    assert head["projector.linear_2"] == "rowwise"
    assert "encoder.blocks.0.mlp.fc1" not in head
    first = tensor_parallel_plan(_vision(0, 1, has_embed=True, has_head=False))
    assert not any(name.startswith("projector") for name in first)
    assert not any("embeddings" in name for name in first)
    # An empty stage (no blocks, no head) has nothing to shard.
    assert tensor_parallel_plan(_vision(2, 2, has_embed=False, has_head=False)) == {}


@pytest.mark.parametrize(
    ("tp", "field"),
    [(4, "DecoderConfig.kv_heads=2"), (3, "DecoderConfig.heads=4")],
)
def test_decoder_validation_names_the_field(tp, field):
    with pytest.raises(ValueError, match=field):
        check_tensor_parallel(_decoder(), tp)
    with pytest.raises(ValueError, match=field):
        apply_tensor_parallel(_decoder(), None, tp_size=tp)


def test_decoder_validation_checks_the_mlp_width():
    config = dataclasses.replace(_config().decoder, mlp_hidden=129)
    with pytest.raises(ValueError, match="DecoderConfig.mlp_hidden=129"):
        check_tensor_parallel(_decoder(config=config), 2)


def test_vision_validation_names_the_field():
    with pytest.raises(ValueError, match="VisionConfig.heads=4"):
        check_tensor_parallel(_vision(), 3)
    check_tensor_parallel(_vision(), 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_tp_size(bad):
    with pytest.raises(ValueError, match="tp_size"):
        check_tensor_parallel(_decoder(), bad)


def test_tp1_is_a_no_op_without_a_group():
    stage = _decoder()
    before = {k: v.clone() for k, v in stage.state_dict().items()}
    assert apply_tensor_parallel(stage, None, tp_size=1) is stage
    after = stage.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_wrong_stage_type():
    with pytest.raises(TypeError, match="declares no tensor-parallel plan"):
        tensor_parallel_plan(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------- gloo processes


def _max_diffs(got: dict, want: dict) -> dict[str, float]:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return {k: float((got[k] - want[k]).abs().max()) for k in want}


def _grads(stage) -> dict:
    """Full (all-gathered) gradients by parameter name; call on every TP rank."""
    return {name: full_tensor(p.grad).detach().clone() for name, p in stage.named_parameters()}


def _decoder_check(tp_group) -> dict:
    config = _config().decoder
    gen = torch.Generator().manual_seed(11)
    lens = [5, 9, 1, 7]
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    tokens = int(cu_seqlens[-1])
    token_ids = torch.randint(config.vocab_size, (tokens,), generator=gen)
    labels = torch.randint(config.vocab_size, (tokens,), generator=gen)
    labels[torch.rand(tokens, generator=gen) < 0.3] = IGNORE_INDEX
    hidden_in = torch.randn(tokens, config.hidden, generator=gen)
    out_grad = torch.randn(tokens, config.hidden, generator=gen)

    def run(stage):
        # Whole decoder: embedding -> blocks -> head, loss and logits.
        x = stage.embed(token_ids)
        sum_loss, num_targets = stage.loss(x, cu_seqlens, labels)
        sum_loss.backward()
        logits = stage(stage.embed(token_ids), cu_seqlens).detach()
        return sum_loss.detach(), int(num_targets), logits, _grads(stage)

    def run_middle(stage):
        # A middle pipeline stage: hidden states in, hidden states out, upstream gradient.
        x = hidden_in.clone().requires_grad_(True)
        out = stage.hidden_states(x, cu_seqlens)
        out.backward(out_grad)
        return out.detach(), x.grad.clone(), _grads(stage)

    ref_stage = _decoder()
    ref_loss, ref_n, ref_logits, ref_grads = run(ref_stage)
    tp_stage = apply_tensor_parallel(_decoder(), tp_group, tp_size=2)
    # Local head counts and a local q_proj shard.
    attn = tp_stage.layers["0"].self_attn
    shapes = (attn.heads, attn.kv_heads, tuple(local_tensor(attn.q_proj.weight).shape))
    loss, n, logits, grads = run(tp_stage)

    # Gradient norm: the TP ranks' shares sum to the unsharded stage's squared norm.
    share = grad_sq_sum(tp_stage, include_replicated=dist.get_rank(tp_group) == 0)
    dist.all_reduce(share, group=tp_group)
    ref_sq = sum(float(p.grad.double().pow(2).sum()) for p in ref_stage.parameters())
    # One foreach AdamW step over the two parameter groups gives the same weights (eps=1:
    # the update is Lipschitz in the gradient, so float noise stays float noise).
    torch.optim.AdamW(ref_stage.parameters(), lr=1e-2, eps=1.0, foreach=True).step()
    torch.optim.AdamW(optimizer_param_groups(tp_stage), lr=1e-2, eps=1.0, foreach=True).step()
    ref_params = {k: p.detach() for k, p in ref_stage.named_parameters()}
    tp_params = {k: full_tensor(p.detach()) for k, p in tp_stage.named_parameters()}

    mid_ref = run_middle(_decoder(1, 2, has_embed=False, has_head=False))
    mid_tp = run_middle(
        apply_tensor_parallel(_decoder(1, 2, has_embed=False, has_head=False), tp_group, tp_size=2)
    )
    return {
        "shapes": shapes,
        "loss": (float(loss), float(ref_loss)),
        "grad_sq": (float(share), ref_sq),
        "num_groups": len(optimizer_param_groups(tp_stage)),
        "params_after_step": _max_diffs(tp_params, ref_params),
        "targets": (n, ref_n),
        "logits": float((logits - ref_logits).abs().max()),
        "grads": _max_diffs(grads, ref_grads),
        "mid_out": float((mid_tp[0] - mid_ref[0]).abs().max()),
        "mid_input_grad": float((mid_tp[1] - mid_ref[1]).abs().max()),
        "mid_grads": _max_diffs(mid_tp[2], mid_ref[2]),
    }


def _vision_check(tp_group) -> dict:
    vision = _config().vision
    gen = torch.Generator().manual_seed(13)
    pixels = torch.randn(
        3, vision.channels, vision.image_size_px, vision.image_size_px, generator=gen
    )
    rows = 3 * vision.tokens_per_unit
    out_grad = torch.randn(rows, _config().projector.hidden, generator=gen)

    def run(stage):
        out = stage(pixels)
        out.backward(out_grad)
        return out.detach(), _grads(stage)

    ref_out, ref_grads = run(_vision())
    tp_stage = apply_tensor_parallel(_vision(), tp_group, tp_size=2)
    attn = tp_stage.encoder.blocks["0"].self_attn
    out, grads = run(tp_stage)
    return {
        "same_module": type(attn).__name__ == "VisionAttention",
        "heads": attn.heads,
        "names": sorted(n for n, _ in tp_stage.named_parameters()) == sorted(ref_grads),
        "out": float((out - ref_out).abs().max()),
        "out_sum": float(out.double().sum()),
        "grads": _max_diffs(grads, ref_grads),
    }


def _local_tensor_aliases(tp_group) -> bool:
    """``local_tensor`` of a sharded gradient is the DTensor's storage (for a flat DP
    all-reduce that copies back in place)."""
    stage = apply_tensor_parallel(_decoder(), tp_group, tp_size=2)
    weight = stage.layers["0"].mlp.down_proj.weight
    weight.grad = torch.zeros_like(weight)
    local_tensor(weight.grad).fill_(1.0)
    return bool((full_tensor(weight.grad) == 1.0).all())


def _tp_worker(rank: int, world_size: int) -> dict:
    config = _config()
    layout = RuntimeLayout.simple(
        encoder_layers=config.vision.layers,
        llm_layers=config.decoder.layers,
        num_microbatches=1,
        global_batch=1,
        encoder_tp=2,
        llm_tp=2,
    )
    topology = Topology.create(layout, timeout_s=SPAWN_TIMEOUT_S)
    assert len(topology.tp_ranks) == 2
    if topology.info.module == "encoder":
        return {"module": "encoder", **_vision_check(topology.tp_group)}
    result = {"module": "llm", **_decoder_check(topology.tp_group)}
    result["alias"] = _local_tensor_aliases(topology.tp_group)
    return result


@pytest.fixture(scope="module")
def tp_results():
    return spawn_local(_tp_worker, 4, timeout_s=SPAWN_TIMEOUT_S, backend="gloo")


def _assert_close(diffs: dict[str, float], scale: float = 1.0) -> None:
    bad = {k: v for k, v in diffs.items() if not v <= ATOL * scale}
    assert not bad, f"differences above tolerance: {bad}"


def test_decoder_tp2_matches_tp1(tp_results):
    config = _config().decoder
    for result in tp_results[2:]:
        assert result["module"] == "llm"
        heads, kv_heads, q_shape = result["shapes"]
        assert (heads, kv_heads) == (config.heads // 2, config.kv_heads // 2)
        assert q_shape == (config.heads * config.head_dim // 2, config.hidden)
        loss, ref_loss = result["loss"]
        assert loss == pytest.approx(ref_loss, rel=RTOL)
        assert result["targets"][0] == result["targets"][1]
        _assert_close({"logits": result["logits"]}, scale=5)
        grad_sq, ref_sq = result["grad_sq"]
        assert grad_sq == pytest.approx(ref_sq, rel=RTOL)
        assert result["num_groups"] == 2
        _assert_close(result["params_after_step"])
        _assert_close(result["grads"])
        _assert_close({"out": result["mid_out"], "input_grad": result["mid_input_grad"]})
        _assert_close(result["mid_grads"])
        assert result["alias"]


def test_vision_tp2_matches_tp1(tp_results):
    for result in tp_results[:2]:
        assert result["module"] == "encoder"
        assert result["same_module"] and result["heads"] == _config().vision.heads // 2
        assert result["names"], "sharding changed the parameter names"
        _assert_close({"out": result["out"]})
        _assert_close(result["grads"])


def test_tp_ranks_agree(tp_results):
    """Replicated outputs and losses are the same on both TP ranks of a module."""
    enc0, enc1, llm0, llm1 = tp_results
    assert enc0["out_sum"] == enc1["out_sum"]
    assert llm0["loss"] == llm1["loss"]
    assert llm0["grad_sq"] == llm1["grad_sq"]
