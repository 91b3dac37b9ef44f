"""Activation recompute (dflop.runtime.recompute): a stage's blocks run their forward
again in the backward, the gradients are the plain stage's, the module is unchanged."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dflop.errors import InputTypeError  # noqa: E402
from dflop.models.registry import model_spec  # noqa: E402
from dflop.models.spec import StageSlice  # noqa: E402
from dflop.runtime.recompute import apply_recompute, is_recomputed  # noqa: E402
from torch import nn  # noqa: E402

SPEC = model_spec("tiny")


def _counted(stage) -> list[int]:
    """Counts every run of each block's own forward (the recomputed ones included)."""
    calls = [0]
    for block in stage.recompute_blocks():
        forward = block.forward

        def counting(*args, _forward=forward, **kwargs):
            calls[0] += 1
            return _forward(*args, **kwargs)

        block.forward = counting
    return calls


def _step(stage, module: str):
    torch.manual_seed(1)
    if module == "llm":
        lens = [5, 9]
        cu = torch.tensor([0, 5, 14])
        x = torch.randn(sum(lens), SPEC.config.decoder.hidden, requires_grad=True)
        out = stage(x, cu)
    else:
        v = SPEC.config.vision
        x = torch.randn(3, v.channels, v.image_size_px, v.image_size_px, requires_grad=True)
        out = stage(x)
    (out.float().pow(2).mean()).backward()
    grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    assert grads
    return x.grad.clone(), grads


@pytest.mark.parametrize("module", ["llm", "encoder"])
def test_recomputed_blocks_run_twice_and_give_the_plain_gradients(module: str) -> None:
    layers = SPEC.llm_layers if module == "llm" else SPEC.encoder_layers
    where = StageSlice(module, (0, layers))
    plain, recomputed = (SPEC.build_stage(where, seed=3) for _ in range(2))
    keys = list(recomputed.state_dict())
    plain_calls = _counted(plain)
    recomputed_calls = _counted(recomputed)
    assert apply_recompute(recomputed) is recomputed and is_recomputed(recomputed)
    assert not is_recomputed(plain)
    apply_recompute(recomputed)  # idempotent: the blocks are not wrapped twice
    want_x, want = _step(plain, module)
    got_x, got = _step(recomputed, module)
    # Each block's forward ran once in the plain stage, twice under recompute.
    assert plain_calls[0] == layers and recomputed_calls[0] == 2 * layers
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=0)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert list(recomputed.state_dict()) == keys  # same parameters, same names
    with torch.no_grad():  # a forward-only pass keeps nothing, recomputes nothing
        recomputed_calls[0] = 0
        recomputed(*(_inputs_for(module)))
        assert recomputed_calls[0] == layers


def _inputs_for(module: str):
    if module == "llm":
        return torch.randn(6, SPEC.config.decoder.hidden), torch.tensor([0, 6])
    v = SPEC.config.vision
    return (torch.randn(1, v.channels, v.image_size_px, v.image_size_px),)


def test_a_stage_that_does_not_name_its_blocks_is_refused() -> None:
    with pytest.raises(InputTypeError, match=r"Linear does not name its transformer blocks"):
        apply_recompute(nn.Linear(2, 2))
