"""The length policy (dflop.data.length): one rule for the profile and the runtime, visual
tokens never cut, over-long samples truncated, skipped (counted) or refused by name; and
the memory budget a local run plans with."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from dflop.data.length import LengthPolicy, TooLongError  # noqa: E402
from dflop.data.shapes import SampleShapes  # noqa: E402
from dflop.data.text_tokens import make_text_counter  # noqa: E402
from dflop.models.decoder import IGNORE_INDEX  # noqa: E402
from dflop.runtime.processed_batch import ProcessedSample, truncate_sample  # noqa: E402
from dflop.train.data import StepShapes, length_policy, load_distribution  # noqa: E402
from dflop.train.planning import memory_budget, profiled_tokens  # noqa: E402
from real_sizes import make_dataset  # noqa: E402


def _shapes(visual, text, targets):
    n = len(text)
    z = np.zeros(n, dtype=np.int64)
    return SampleShapes(
        z,
        z.copy(),
        np.asarray(visual, dtype=np.int64),
        np.asarray(text, dtype=np.int64),
        np.zeros(n, dtype=np.int8),
        target_tokens=np.asarray(targets, dtype=np.int64),
    )


def test_the_policy_cuts_text_never_visual_tokens():
    shapes = _shapes([0, 90, 120, 10], [50, 30, 10, 200], [20, 10, 5, 100])
    keep, cut = LengthPolicy(100, "truncate").outcome(shapes)
    # fits; text cut to 10; visual alone over the limit: left out; text cut to 90
    assert keep.tolist() == [True, True, False, True]
    assert cut.tolist() == [False, True, False, True]
    keep, cut = LengthPolicy(100, "skip").outcome(shapes)
    assert keep.tolist() == [True, False, False, False] and not cut.any()
    line = LengthPolicy(100, "error", "the test").describe("f.json: sample 2", shapes, 2)
    assert "f.json: sample 2: 130 tokens (120 visual, 10 text) exceed max_seq_len=100" in line
    assert "its visual tokens alone exceed the limit" in line and "skip" in line
    with pytest.raises(ValueError, match="too_long='cut'"):
        LengthPolicy(100, "cut")
    with pytest.raises(ValueError, match="max_seq_len=1"):
        LengthPolicy(1)


def test_targets_left_in_a_cut_conversation():
    counter = make_text_counter(lambda text: len(text))  # one token per character
    turns = [("human", "q" * 10), ("gpt", "a" * 6), ("human", "r" * 4), ("gpt", "b" * 8)]
    text, targets = counter.count_turns(turns)
    assert (text, targets) == (11 + 10 + 6 + 4 + 8 + 5 * 4, 6 + 8 + 2 * 2)
    # 11 system, 3 header, 10 question, 2 end, 3 header, then the answer's 6 + its 2 ends
    assert counter.targets_in_prefix(turns, 11 + 3 + 10 + 2 + 3) == 0
    assert counter.targets_in_prefix(turns, 11 + 3 + 10 + 2 + 3 + 4) == 4
    assert counter.targets_in_prefix(turns, 11 + 3 + 10 + 2 + 3 + 6 + 2) == 8
    assert counter.targets_in_prefix(turns, text) == targets


def test_a_cut_sample_keeps_every_visual_token_and_its_first_text():
    ids = torch.tensor([5, 6, 99, 99, 99, 7, 8, 9, 10, 11])
    labels = torch.tensor([-100, -100, -100, -100, -100, 7, 8, 9, 10, 11])
    sample = ProcessedSample(ids, labels, None, (), (99,))
    cut = truncate_sample(sample, 7)
    assert cut.input_ids.tolist() == [5, 6, 99, 99, 99, 7, 8]
    assert cut.labels.tolist() == [-100, -100, -100, -100, -100, 7, 8]
    assert truncate_sample(sample, 10) is sample
    with pytest.raises(ValueError, match="3 visual tokens exceed max_seq_len=2"):
        truncate_sample(sample, 2)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The real-size dataset and a tiny LLaVA-OneVision at the real vocabulary."""
    from dflop.models.hf.tiny import save_tiny_llava_onevision

    root = tmp_path_factory.mktemp("real")
    recipe = make_dataset(str(root / "data"), num_records=30)
    model = save_tiny_llava_onevision(str(root / "ov"), vocab_size=151_936, weights=False)
    return recipe, f"hf:{model}"


@pytest.mark.parametrize("too_long", ["truncate", "skip"])
def test_profile_runtime_and_planner_see_the_same_cut_samples(real, too_long):
    """Under a 4,096-token limit: the profile's shapes of the records a step draws are the
    runtime's batch shapes (its labels counted), and the planner's inputs carry them."""
    from dflop.models import model_spec
    from dflop.planner import prepare_inputs
    from dflop.profiling import CostModel
    from dflop.train.planning import analytic_performance_model, cost_configs

    recipe, model = real
    spec = model_spec(model)
    policy = length_policy(spec, 4096, too_long)
    records = load_distribution(recipe, model=spec, length=policy)
    profile = records.distribution
    longest = load_distribution(recipe, model=spec).distribution.samples.seq_len
    over = int((longest > 4096).sum())
    assert over >= 3  # the dataset's long records
    if too_long == "skip":
        assert profile.skipped["too_long"] == over and len(records) == 30 - over
        assert "exceed max_seq_len=4096" in profile.skipped_examples[-1]["message"]
    else:
        assert len(records) == 30 and profile.extra["length_policy"]["truncated"] == over
    assert profile.samples.seq_len.max() <= 4096
    steps = StepShapes(spec, 8, seed=3, distribution=records, length=policy)
    encoder, llm = cost_configs(spec)
    cost = CostModel(analytic_performance_model(spec))
    for step in range(3):
        batch = steps.batch(step, 0)
        shapes = batch.shapes
        profiled = profile.samples.take(steps.record_indices(step))
        for name in ("encoder_units", "llm_visual_tokens", "text_tokens", "target_tokens"):
            np.testing.assert_array_equal(getattr(shapes, name), getattr(profiled, name))
        counted = [int((s.labels[1:] != IGNORE_INDEX).sum()) for s in batch.samples]
        assert counted == batch.target_tokens().tolist() == shapes.target_tokens.tolist()
        assert shapes.seq_len.max() <= 4096
    inputs = prepare_inputs(cost, encoder, llm, global_batch=8, shapes=steps, num_batches=2)
    planned = np.concatenate([steps.shapes(k).target_tokens for k in range(2)])
    np.testing.assert_array_equal(inputs.samples["llm_target_tokens"], planned)


def test_the_error_policy_names_the_sample(real):
    from dflop.models import model_spec

    recipe, model = real
    spec = model_spec(model)
    with pytest.raises(TooLongError, match=r"records.json: sample \d+: \d+ tokens .* exceed"):
        load_distribution(recipe, model=spec, length=length_policy(spec, 4096, "error"))
    assert length_policy(spec).max_seq_len == 32768  # the model's positions
    assert length_policy("tiny") is None  # the reference model's shapes are scaled


def test_memory_budget_and_profiled_lengths():
    budget = memory_budget(2, "cpu", 3.5)
    assert budget.memory_bytes == 3.5e9 and "--memory-gb 3.5" in budget.describe()
    default = memory_budget(4, "cpu")
    assert default.memory_bytes < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4
    assert "80% of this host's" in default.describe()
    assert profiled_tokens([100, 200]) == (1024, 4)
    assert profiled_tokens(np.full(10, 3000)) == (4096, 3)
    assert profiled_tokens(np.full(10, 18000)) == (4096, 3)
    assert profiled_tokens([]) == (1024, 4)


def test_a_real_size_dataset_reaches_18k_tokens(real, tmp_path):
    from dflop.models import model_spec

    recipe, model = real
    dist = load_distribution(recipe, model=model_spec(model)).distribution
    assert 17_000 <= dist.samples.seq_len.max() <= 18_500
    counts = dist.modality_counts()
    assert all(counts[k] > 0 for k in ("text", "image", "multi_image", "video"))
    with open(os.path.join(os.path.dirname(recipe), "records.json")) as f:
        assert any(
            len(os.listdir(os.path.join(os.path.dirname(recipe), "videos", r["video"]))) >= 40
            for r in json.load(f)
            if "video" in r
        )
