"""The chunked LM head and loss (dflop.models.loss): equal to the unchunked computation in
loss and every gradient (reference model, the Hugging Face families, tied and untied
heads, a vocabulary-parallel head over gloo ranks), with logits memory that does not grow
with the number of target tokens."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from dflop.models import model_config  # noqa: E402
from dflop.models.decoder import IGNORE_INDEX, DecoderStage, next_token_targets  # noqa: E402
from dflop.models.loss import DEFAULT_LOSS_CHUNK_TOKENS, chunked_lm_loss  # noqa: E402
from dflop.planner.model import DEFAULT_LOSS_CHUNK_TOKENS as PLANNER_CHUNK  # noqa: E402
from dflop.profiling.memory import measure_peak_bytes  # noqa: E402
from dflop.runtime import spawn_local  # noqa: E402
from dflop.train.config import TrainConfig  # noqa: E402

SPAWN_TIMEOUT_S = 120


def test_one_default_chunk_everywhere():
    assert DEFAULT_LOSS_CHUNK_TOKENS == PLANNER_CHUNK == TrainConfig().loss_chunk_tokens


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_cross_entropy_in_loss_and_gradients(bias, dtype):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 101, bias=bias, dtype=dtype)
    x = torch.randn(37, 16, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 101, (37,))
    ref = F.cross_entropy(head(x).float(), targets, reduction="sum")
    ref.backward()
    expected = [p.grad.clone() for p in (x, *head.parameters())]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for chunk in (1, 5, 37, 1000):
        x.grad = None
        head.zero_grad()
        loss = chunked_lm_loss(x, head, targets, chunk)
        assert loss.dtype == torch.float32
        assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=tol)
        (loss * 0.5).backward()  # the upstream gradient scales every gradient
        for got, want in zip((x, *head.parameters()), expected):
            torch.testing.assert_close(got.grad, 0.5 * want, rtol=tol, atol=tol)


def test_no_targets_is_a_zero_that_still_reaches_the_inputs():
    head = torch.nn.Linear(8, 11)
    x = torch.randn(0, 8, requires_grad=True)
    loss = chunked_lm_loss(x, head, torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(head.weight.grad.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_lm_loss(x, head, torch.zeros(0, dtype=torch.long), 0)


def test_a_tied_head_sums_both_gradients():
    """The head's weight is the embedding's (one parameter): the loss's gradient adds to the
    embedding's, as with the unchunked loss."""
    torch.manual_seed(1)
    emb = torch.nn.Embedding(50, 12)
    head = torch.nn.Linear(12, 50, bias=False)
    head.weight = emb.weight
    ids = torch.randint(0, 50, (20,))
    targets = torch.randint(0, 50, (20,))
    grads = []
    for chunked in (False, True):
        emb.zero_grad()
        h = torch.tanh(emb(ids))
        loss = (
            chunked_lm_loss(h, head, targets, 3)
            if chunked
            else F.cross_entropy(head(h), targets, reduction="sum")
        )
        loss.backward()
        grads.append(emb.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def _reference_stage(vocab: int) -> DecoderStage:
    config = model_config("tiny").decoder
    from dataclasses import replace

    stage = DecoderStage(replace(config, vocab_size=vocab))
    stage.init_weights(3)
    return stage


def _packed(vocab: int, lens=(30, 9, 45), hidden=None, seed=2):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    x = (torch.randn(total, hidden, generator=g) * 0.5).requires_grad_(True)
    labels = torch.randint(0, vocab, (total,), generator=g)
    labels[torch.rand(total, generator=g) < 0.4] = IGNORE_INDEX  # prompts
    cu = torch.tensor([0, *np.cumsum(lens)])
    return x, cu, labels


def _unchunked(stage, x, cu, labels, **extra):
    hidden = stage.hidden_states(x, cu, **extra) if extra else stage.hidden_states(x, cu)
    targets = next_token_targets(labels, cu)
    keep = targets != IGNORE_INDEX
    norm = stage.norm if hasattr(stage, "norm") else stage.get_submodule(f"{stage.text_root}.norm")
    head = stage.lm_head
    return F.cross_entropy(head(norm(hidden[keep])).float(), targets[keep], reduction="sum")


def _grads(stage, x):
    grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    return {"input": x.grad.clone(), **grads}


def _compare(stage, x, cu, labels, **extra):
    """Chunked (several chunk sizes) against unchunked: loss and every gradient."""
    stage.zero_grad()
    ref = _unchunked(stage, x, cu, labels, **extra)
    ref.backward()
    expected = _grads(stage, x)
    for chunk in (1, 4, 10_000):
        stage.zero_grad()
        x.grad = None
        loss, count = stage.loss(x, cu, labels, chunk_tokens=chunk, **extra)
        assert int(count) == int((next_token_targets(labels, cu) != IGNORE_INDEX).sum())
        assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
        loss.backward()
        got = _grads(stage, x)
        assert got.keys() == expected.keys()
        for name, grad in got.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_reference_decoder_loss_is_the_unchunked_one():
    stage = _reference_stage(vocab=512)
    x, cu, labels = _packed(512, hidden=stage.config.hidden)
    _compare(stage, x, cu, labels)


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_vl", "qwen2_5_vl", "tied"])
def test_hugging_face_stage_loss_is_the_unchunked_one(family):
    pytest.importorskip("transformers")
    from dflop.models.hf import spec_from_config
    from dflop.models.hf.tiny import (
        tiny_llava_onevision_config,
        tiny_qwen2_5_vl_config,
        tiny_qwen2_vl_config,
    )
    from dflop.runtime.topology import RuntimeLayout, rank_info

    make = {
        "llava_onevision": tiny_llava_onevision_config,
        "tied": tiny_llava_onevision_config,
        "qwen2_vl": tiny_qwen2_vl_config,
        "qwen2_5_vl": tiny_qwen2_5_vl_config,
    }[family]
    config = make()
    if family == "tied":
        config.tie_word_embeddings = True
        config.text_config.tie_word_embeddings = True
    spec = spec_from_config(config)
    layout = RuntimeLayout.simple(
        encoder_layers=spec.encoder_layers,
        llm_layers=spec.llm_layers,
        num_microbatches=1,
        global_batch=1,
    )
    stage = spec.build_stage(rank_info(layout, 1), seed=4)
    vocab = config.text_config.vocab_size
    x, cu, labels = _packed(vocab, hidden=config.text_config.hidden_size)
    extra = {}
    if hasattr(stage, "position_ids"):  # Qwen-VL's mRoPE: text positions (3 equal rows)
        positions = torch.cat([torch.arange(n) for n in (30, 9, 45)])
        extra["position_ids"] = positions.expand(3, -1)
    if family == "tied":
        assert stage.lm_head.weight is stage.get_submodule(f"{stage.text_root}.embed_tokens").weight
    _compare(stage, x, cu, labels, **extra)


def _vocab_parallel_rank(rank: int, world_size: int, vocab: int) -> dict:
    """A decoder stage sharded over 2 TP ranks (the head vocabulary-parallel, an uneven
    vocabulary): its chunked loss and gathered gradients."""
    import torch.distributed as dist
    from dflop.runtime.tensor_parallel import apply_tensor_parallel, full_tensor

    torch.set_num_threads(1)
    stage = _reference_stage(vocab)
    apply_tensor_parallel(stage, dist.group.WORLD, tp_size=world_size)
    x, cu, labels = _packed(vocab, hidden=stage.config.hidden)
    loss, _ = stage.loss(x, cu, labels, chunk_tokens=7)
    loss.backward()
    grads = {
        n: full_tensor(p.grad).detach().numpy()
        for n, p in stage.named_parameters()
        if p.grad is not None
    }
    local_rows = stage.lm_head.weight.to_local().shape[0]
    return {
        "loss": float(loss.detach()),
        "grads": grads,
        "input": x.grad.numpy(),
        "rows": local_rows,
    }


def test_a_vocabulary_parallel_head_gives_the_whole_loss_and_gradients():
    vocab = 515  # not a multiple of 2: 258 + 257 rows
    results = spawn_local(_vocab_parallel_rank, 2, args=(vocab,), timeout_s=SPAWN_TIMEOUT_S)
    assert sorted(r["rows"] for r in results) == [257, 258]
    stage = _reference_stage(vocab)
    x, cu, labels = _packed(vocab, hidden=stage.config.hidden)
    ref = _unchunked(stage, x, cu, labels)
    ref.backward()
    for r in results:
        assert r["loss"] == pytest.approx(float(ref.detach()), rel=1e-5)
        np.testing.assert_allclose(r["input"], x.grad.numpy(), rtol=1e-4, atol=1e-6)
        for name, p in stage.named_parameters():
            if p.grad is None:  # the embedding: the inputs are given as embeddings
                assert name not in r["grads"]
                continue
            np.testing.assert_allclose(
                r["grads"][name], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name
            )


def test_logits_memory_does_not_grow_with_the_targets():
    """At a real vocabulary (151,936), one chunk's logits: the peak for 4,096 targets is
    the peak for 512 (plus their hidden states), where the unchunked loss grows 8x."""
    torch.manual_seed(0)
    vocab, hidden, chunk = 151_936, 32, 256
    head = torch.nn.Linear(hidden, vocab, bias=False)

    def peak(rows: int, chunk_tokens: int | None) -> int:
        x = torch.randn(rows, hidden, requires_grad=True)
        targets = torch.randint(0, vocab, (rows,))

        def step() -> None:
            if chunk_tokens is None:
                loss = F.cross_entropy(head(x).float(), targets, reduction="sum")
            else:
                loss = chunked_lm_loss(x, head, targets, chunk_tokens)
            loss.backward()

        head.zero_grad()
        return measure_peak_bytes(step).added_bytes

    logits = chunk * vocab * 4
    small, large = peak(512, chunk), peak(4096, chunk)
    # 8x the targets: at most a fraction of one chunk more (hidden states, their gradient,
    # the allocator's order), where the unchunked loss would hold 3,584 rows more.
    assert large - small < 0.25 * logits, (small, large)
    assert logits <= small < 1.5 * logits + 2 * vocab * hidden * 4, small
    full_small = peak(512, None)
    assert full_small > 2 * small  # 512 rows of logits, their softmax and gradient
