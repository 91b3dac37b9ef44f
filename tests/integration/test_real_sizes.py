"""What a user brings, through the CLI: tiny LLaVA-OneVision and Qwen2-VL models at the real
vocabulary (151,936, every Qwen2-based VLM's) on a generated LLaVA-format dataset of real
files whose samples reach 18k tokens (anyres images, multi-image, 40-frame videos, text
only, long documents). ``dflop train --model hf:DIR --data RECIPE --nproc 2`` with no
layout, memory or length flag trains it; every rank's measured peak memory is near the
memory model's; the length policy and the memory budget name what they refuse."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("transformers")
from cli_harness import run_cli  # noqa: E402
from dflop.models import model_spec  # noqa: E402
from dflop.models.hf.tiny import save_tiny_llava_onevision, save_tiny_qwen_vl  # noqa: E402
from dflop.train.data import StepShapes, length_policy, load_distribution  # noqa: E402
from real_sizes import make_dataset  # noqa: E402

VOCAB = 151_936
STEPS, BATCH, SEED = 2, 8, 0


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_sizes")
    recipe = make_dataset(str(root / "data"))
    models = {
        "llava_onevision": save_tiny_llava_onevision(str(root / "ov"), vocab_size=VOCAB),
        "qwen2_vl": save_tiny_qwen_vl(str(root / "qwen"), vocab_size=VOCAB),
    }
    return root, recipe, models


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_vl"])
def test_trains_at_real_sizes_with_no_flags(world, family):
    root, recipe, models = world
    model = f"hf:{models[family]}"
    out = root / f"{family}.json"
    result = run_cli(
        "train", "--model", model, "--data", recipe, "--nproc", "2", "--steps", str(STEPS),
        "--global-batch", str(BATCH), "--seed", str(SEED), "--memory-report",
        "--json", str(out), timeout_s=1500,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    losses = [m["loss"] for m in report["steps"]]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.1)  # a fresh head: uniform
    # The steps trained the dataset's longest samples, uncut (Qwen2's 32k positions).
    spec = model_spec(model)
    records = load_distribution(recipe, model=spec, length=length_policy(spec))
    steps = StepShapes(spec, BATCH, seed=SEED, distribution=records)
    longest = max(int(steps.shapes(k).seq_len.max()) for k in range(STEPS))
    assert longest >= 17_000, longest
    # The quick profile priced the LM head on the target tokens (its own term).
    assert report["performance_model"]["llm"]["per_target_token_s"] > 0
    # Every rank's peak memory, measured, is near the memory model's for those steps.
    memory = report["memory"]
    assert sorted(m["rank"] for m in memory) == [0, 1]
    for m in memory:
        error = abs(m["predicted_bytes"] - m["measured_bytes"]) / m["measured_bytes"]
        assert error < 0.25, memory
    assert "memory, peak per rank" in result.stdout


def test_over_long_samples_are_named_skipped_or_cut(world):
    """``--deterministic`` (no profile: the analytic model) keeps these runs short."""
    root, recipe, models = world
    model = f"hf:{models['llava_onevision']}"
    common = ("train", "--model", model, "--data", recipe, "--nproc", "2", "--steps", "1",
              "--global-batch", "4", "--deterministic", "--max-seq-len", "4096")  # fmt: skip
    error = run_cli(*common, "--too-long", "error", timeout_s=600)
    assert error.returncode != 0
    assert "records.json: sample" in error.stderr and "exceed max_seq_len=4096" in error.stderr
    assert "TrainConfig.max_seq_len" in error.stderr and "skip leaves it out" in error.stderr
    skipped = run_cli(*common, "--too-long", "skip", timeout_s=600)
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert "too_long:" in skipped.stdout and "exceed max_seq_len=4096" in skipped.stdout


def test_a_budget_too_small_names_the_samples_and_the_settings(world):
    root, recipe, models = world
    model = f"hf:{models['qwen2_vl']}"
    result = run_cli(
        "train", "--model", model, "--data", recipe, "--nproc", "2", "--steps", "1",
        "--global-batch", "4", "--deterministic", "--memory-gb", "0.6", timeout_s=600,
    )  # fmt: skip
    assert result.returncode != 0
    message = result.stderr
    assert "0.6 GB per process (--memory-gb 0.6)" in message
    # The head's chunk of logits (1,024 x 151,936 floats) is the first thing to shrink ...
    assert "0.62 GB of logits at a vocabulary of 151,936: --loss-chunk-tokens 64" in message
    # ... else the samples too long for it, by name, and the longest length that fits.
    assert "too long for it: " in message and "records.json: sample" in message
    limit = int(message.split("Layouts fit samples of up to ")[1].split()[0])
    assert f"--max-seq-len {limit} with --too-long truncate" in message
    # Either advice trains within the same budget.
    for advice in (("--loss-chunk-tokens", "64"), ("--max-seq-len", str(limit))):
        fixed = run_cli(
            "train", "--model", model, "--data", recipe, "--nproc", "2", "--steps", "1",
            "--global-batch", "4", "--deterministic", "--memory-gb", "0.6", *advice,
            timeout_s=600,
        )  # fmt: skip
        assert fixed.returncode == 0, (advice, fixed.stderr[-3000:])
        assert np.isfinite(float(fixed.stdout.split("loss ")[1].split()[0]))
