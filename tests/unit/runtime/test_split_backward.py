"""The split backward (dflop.runtime.split_backward): I then W give a full backward's
gradients on graphs with shared weights, weight-only branches, frozen parameters and
inputs the output ignores, and compute every product once over the two halves."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dflop.models.loss import chunked_lm_loss  # noqa: E402
from dflop.runtime.split_backward import backward_input, backward_weight  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


class _Tangled(nn.Module):
    """An embedding added to the input (a weight-only branch), linears, a layer norm, one
    weight applied twice (a boundary node below another of its group) and a parameter
    that reaches the output both through the input path and directly."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)
        self.shared = nn.Linear(16, 16, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x, ids, extra=None):  # noqa: ARG002 (extra: an input left unused)
        h = x + self.emb(ids)
        h = self.l2(torch.relu(self.l1(h)))
        h = self.shared(self.shared(self.norm(h))) * self.scale
        return h.sum(-1).pow(2).sum() + self.scale.sum()


def _full(model, make_inputs):
    model.zero_grad(set_to_none=True)
    inputs = make_inputs()
    model(*inputs).backward()
    return [t.grad for t in inputs if t.requires_grad], {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _split(model, make_inputs):
    model.zero_grad(set_to_none=True)
    inputs = make_inputs()
    output = model(*inputs)
    differentiable = [t for t in inputs if t.requires_grad]
    work = backward_input(output, None, differentiable, list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # weights wait for W
    input_grads = [t.grad for t in differentiable]
    backward_weight(work)
    return input_grads, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("frozen", ["", "l1.weight", "shared.weight"])
def test_split_backward_equals_the_full_backward(frozen):
    torch.manual_seed(0)
    model = _Tangled()
    for name, p in model.named_parameters():
        p.requires_grad_(name != frozen)
    x, ids = torch.randn(8, 16), torch.randint(0, 50, (8,))
    ignored = torch.randn(3)  # an input the output does not depend on

    def make_inputs():
        return x.clone().requires_grad_(), ids, ignored.clone().requires_grad_()

    (ref_x, ref_ignored), ref = _full(model, make_inputs)
    (got_x, got_ignored), got = _split(model, make_inputs)
    assert ref_ignored is None and torch.equal(got_ignored, torch.zeros(3))
    torch.testing.assert_close(got_x, ref_x, rtol=1e-6, atol=1e-7)
    assert got.keys() == ref.keys() and frozen not in got
    for name, grad in ref.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_no_input_gradient_puts_the_whole_backward_in_w():
    """A first stage (its input needs no gradient): I does nothing, W all of it."""
    torch.manual_seed(1)
    model = _Tangled()
    x, ids = torch.randn(4, 16), torch.randint(0, 50, (4,))
    _, ref = _full(model, lambda: (x, ids))
    _, got = _split(model, lambda: (x, ids))
    for name, grad in ref.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7)


def test_each_product_runs_once():
    """A stack of linear layers: I computes the input gradients' products and W the
    weights', each half of a full backward's FLOPs, none repeated."""
    torch.manual_seed(2)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)])
    x = torch.randn(32, 64)
    grad = torch.randn(32, 64)
    with FlopCounterMode(display=False) as full:
        model(x.clone().requires_grad_()).backward(grad)
    xi = x.clone().requires_grad_()
    out = model(xi)
    with FlopCounterMode(display=False) as first:
        work = backward_input(out, grad, [xi], list(model.parameters()))
    with FlopCounterMode(display=False) as second:
        backward_weight(work)
    forward_flops = 2 * 32 * 64 * 64 * 6
    assert full.get_total_flops() == 3 * forward_flops  # the forward and both products
    assert first.get_total_flops() == forward_flops
    assert second.get_total_flops() == forward_flops


def test_the_chunked_head_splits_its_backward():
    """dflop's chunked LM head (a custom Function, split aware): I computes the hidden
    gradient, W the head's weight and bias gradients; together one head forward (W's
    remade logits) more than a full backward, not the whole head backward twice. The
    gradients equal a plain backward's."""
    torch.manual_seed(3)
    layer, head = nn.Linear(32, 32), nn.Linear(32, 500)
    x, targets = torch.randn(24, 32), torch.randint(0, 500, (24,))
    params = [*layer.parameters(), *head.parameters()]

    def run(split: bool):
        for p in params:
            p.grad = None
        xi = x.clone().requires_grad_()
        loss = chunked_lm_loss(layer(xi), head, targets, chunk_tokens=7)
        counters = [FlopCounterMode(display=False), FlopCounterMode(display=False)]
        if split:
            with counters[0]:
                work = backward_input(loss, None, [xi], params)
            assert all(p.grad is None for p in params)
            with counters[1]:
                backward_weight(work)
        else:
            with counters[0]:
                loss.backward()
        flops = [c.get_total_flops() for c in counters]
        return flops, xi.grad, [p.grad.clone() for p in params]

    (full_flops, _), ref_x, ref = run(False)
    (input_flops, weight_flops), got_x, got = run(True)
    head_forward = 2 * 24 * 32 * 500  # one chunked pass of logits over all rows
    # (Whether FlopCounterMode counts the in-place addmm_ of the weight gradient or not.)
    assert input_flops + weight_flops == full_flops + head_forward
    torch.testing.assert_close(got_x, ref_x, rtol=1e-6, atol=1e-7)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


def _kept_for_w(work) -> int:
    """Bytes of the gradients an I pass recorded for its W (each tensor once)."""
    kept = {}
    for group in work.groups:
        for grads in group.grads.values():
            for g in grads:
                if g is not None:
                    kept[g.untyped_storage().data_ptr()] = g.numel() * g.element_size()
    return sum(kept.values())


def test_the_planner_prices_what_i_keeps_for_w():
    """PlannerModule.weight_grad_bytes_per_token_layer (what the memory model adds per
    pending W under a zero-bubble order) is what backward_input keeps on dflop's reference
    decoder and vision blocks, per token and layer (fp32, one GPU)."""
    from dflop.models import model_config
    from dflop.models.decoder import DecoderBlock, rotary_cos_sin
    from dflop.models.vision import VisionBlock
    from dflop.planner.model import planner_modules
    from dflop.train.planning import cost_configs

    torch.manual_seed(4)
    config = model_config("small")
    encoder_module, llm_module = planner_modules(*cost_configs("small"), element_bytes=4)
    d, v = config.decoder, config.vision
    tokens = 40
    block = DecoderBlock(d)
    x = torch.randn(tokens, d.hidden, requires_grad=True)
    cos, sin = rotary_cos_sin(torch.arange(tokens), d.head_dim, d.rope_theta)
    out = block(x, cos, sin, [tokens])
    work = backward_input(out, torch.randn_like(out), [x], list(block.parameters()))
    assert _kept_for_w(work) == tokens * llm_module.weight_grad_bytes_per_token_layer
    vision = VisionBlock(v)
    y = torch.randn(2, tokens // 2, v.hidden, requires_grad=True)
    out = vision(y)
    work = backward_input(out, torch.randn_like(out), [y], list(vision.parameters()))
    assert _kept_for_w(work) == tokens * encoder_module.weight_grad_bytes_per_token_layer
