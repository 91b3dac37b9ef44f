"""Target (loss) tokens as a sample shape: counted by the data profiler from the answer
turns, carried through profiles, the synthetic mix and the scaler, and laid out by every
batch source exactly as the shapes say."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dflop.data import ShapeDistribution, make_text_counter
from dflop.data.profiler import profile_dataset
from dflop.data.shapes import TARGET_SHARE_ESTIMATE, SampleShapes, estimate_target_tokens
from dflop.data.synthetic import synthetic_shapes
from dflop.models import model_config
from dflop.models.decoder import IGNORE_INDEX, next_token_targets
from dflop.runtime.synthetic_batch import ShapeScaler, SyntheticBatch

CONFIG = model_config("tiny")


def _shapes(text, targets=None):
    n = len(text)
    z = np.zeros(n, dtype=np.int64)
    return SampleShapes(
        z,
        z.copy(),
        z.copy(),
        np.asarray(text, dtype=np.int64),
        np.zeros(n, dtype=np.int8),
        target_tokens=None if targets is None else np.asarray(targets, dtype=np.int64),
    )


def test_targets_are_validated_and_an_omitted_count_is_a_flagged_estimate():
    counted = _shapes([10, 20], [3, 20])
    assert not counted.targets_estimated
    assert counted.take([1]).target_tokens.tolist() == [20]
    estimated = _shapes([10, 1, 0])
    assert estimated.targets_estimated
    assert estimated.target_tokens.tolist() == [round(TARGET_SHARE_ESTIMATE * 10), 0, 0]
    both = SampleShapes.concat([counted, estimated])
    assert both.targets_estimated and both.target_tokens.tolist()[:2] == [3, 20]
    with pytest.raises(ValueError, match=r"target_tokens\[1\]=21 must be in \[0, text_tokens"):
        _shapes([10, 20], [3, 21])
    with pytest.raises(ValueError, match=r"target_tokens\[0\]=-1"):
        _shapes([10], [-1])
    with pytest.raises(ValueError, match="target_tokens has length 1, expected 2"):
        _shapes([10, 20], [3])
    assert (estimate_target_tokens(np.arange(50)) <= np.arange(50)).all()


def test_the_profiler_counts_the_answer_turns(tmp_path):
    """The answers' text (piece by piece around placeholders) plus 2 end-of-turn tokens
    per answer; prompts, system turns and headers are not targets."""
    records = [
        {
            "conversations": [
                {"from": "system", "value": "x" * 40},
                {"from": "human", "value": "<image>\n" + "q" * 12},
                {"from": "gpt", "value": "a" * 20},
                {"from": "human", "value": "q" * 4},
                {"from": "GPT", "value": "b" * 9},
            ]
        },
        {"conversations": [{"from": "human", "value": "hello there"}]},
    ]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records))
    dist = profile_dataset(path, progress=False)
    assert dist.samples.target_tokens.tolist() == [(5 + 2) + (3 + 2), 0]
    counter = make_text_counter()
    turns = [(t["from"], t["value"]) for t in records[0]["conversations"]]
    text, targets = counter.count_turns(turns)
    assert dist.samples.text_tokens.tolist()[0] == text
    assert targets == 12 and not dist.samples.targets_estimated
    assert "target tokens: counted" in dist.summary()


@pytest.mark.parametrize("suffix", [".json", ".parquet"])
def test_profiles_keep_targets_and_old_ones_load_with_the_flagged_estimate(tmp_path, suffix):
    dist = ShapeDistribution.from_synthetic(200, seed=3)
    path = tmp_path / f"shapes{suffix}"
    dist.save(path)
    again = ShapeDistribution.load(path)
    np.testing.assert_array_equal(again.samples.target_tokens, dist.samples.target_tokens)
    assert not again.samples.targets_estimated
    if suffix == ".json":  # a profile written before targets were counted
        doc = json.loads(path.read_text())
        del doc["columns"]["target_tokens"]
        path.write_text(json.dumps(doc))
        old = ShapeDistribution.load(path)
        assert old.samples.targets_estimated
        np.testing.assert_array_equal(
            old.samples.target_tokens, estimate_target_tokens(old.samples.text_tokens)
        )
        assert "estimated (this profile predates target counts" in old.summary()
        doc["columns"]["target_tokens"] = [10**6] * 200
        path.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=r"shapes.json: SampleShapes.target_tokens\[0\]"):
            ShapeDistribution.load(path)


def test_synthetic_targets_are_a_share_of_the_text_that_leaves_a_prompt():
    shapes = synthetic_shapes(20_000, seed=1)
    text, targets = shapes.text_tokens, shapes.target_tokens
    assert (targets >= 1).all() and (targets <= text - 1).all()
    share = targets.sum() / text.sum()
    assert 0.45 < share < 0.65, share
    # Deterministic, and the other fields do not depend on the target draw.
    again = synthetic_shapes(20_000, seed=1)
    np.testing.assert_array_equal(again.target_tokens, targets)
    assert not np.array_equal(synthetic_shapes(20_000, seed=2).target_tokens[:100], targets[:100])


def test_the_scaler_keeps_the_targets_share_and_synthetic_batches_lay_them_out():
    raw = synthetic_shapes(300, seed=4)
    scaler = ShapeScaler.for_model(CONFIG)
    scaled = scaler.scale(raw)
    assert (scaled.target_tokens >= 1).all()
    assert (scaled.target_tokens <= scaled.text_tokens - 1).all()
    share_raw = raw.target_tokens / raw.text_tokens
    share = scaled.target_tokens / scaled.text_tokens
    big = scaled.text_tokens >= 16  # rounding dominates tiny budgets
    assert np.abs(share - share_raw)[big].max() <= 1 / 16 + 1e-9
    batch = SyntheticBatch(scaled, CONFIG, seed=0)
    np.testing.assert_array_equal(batch.target_tokens(), scaled.target_tokens)
    for i in range(0, 300, 37):
        text = batch.text_inputs([i])
        counted = next_token_targets(text.labels, text.cu_seqlens) != IGNORE_INDEX
        assert int(counted.sum()) == scaled.target_tokens[i]
