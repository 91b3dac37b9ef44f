"""The architecture descriptions of released models (tests/data/hf_configs: LLaVA-OneVision
0.5B / 7B / 72B, Qwen2-VL 2B / 7B / 72B) are the models' own, feed the planner and the
analytic cost model, and agree with dflop's named presets."""

from __future__ import annotations

import json
import os

import pytest
from conftest import DATA_DIR

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cli_harness import run_cli  # noqa: E402
from dflop.data.costs import ENCODER_PRESETS, LLM_PRESETS, AnalyticCostModel  # noqa: E402
from dflop.data.synthetic import synthetic_shapes  # noqa: E402
from dflop.models import model_spec  # noqa: E402
from dflop.planner.model import planner_modules  # noqa: E402

CONFIGS = os.path.join(DATA_DIR, "hf_configs")
# Published parameter counts (model cards), in billions.
PUBLISHED_B = {
    "llava-onevision-qwen2-0.5b-ov": 0.894,
    "llava-onevision-qwen2-7b-ov": 8.03,
    "llava-onevision-qwen2-72b-ov": 73.2,
    "qwen2-vl-2b-instruct": 2.21,
    "qwen2-vl-7b-instruct": 8.29,
    "qwen2-vl-72b-instruct": 73.4,
}


def _spec(name):
    return model_spec(f"hf:{os.path.join(CONFIGS, name)}")


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_architecture_is_the_models(name):
    """The config builds the published model (parameter count), and the planner's
    parameter counts from the spec's architecture equal the model's (a tied head is
    counted on the last stage too: what a pipeline with the head on another stage holds)."""
    spec = _spec(name)
    with torch.device("meta"):
        model = spec.model_class(spec.config)
    actual = sum(p.numel() for p in model.parameters())
    assert actual / 1e9 == pytest.approx(PUBLISHED_B[name], rel=0.005)
    encoder, llm = spec.architecture()
    enc, dec = planner_modules(encoder, llm)
    planned = sum(
        m.num_layers * m.params_per_layer + m.first_stage_params + m.last_stage_params
        for m in (enc, dec)
    )
    tied = bool(spec.config.tie_word_embeddings)
    assert planned - tied * llm.vocab_size * llm.hidden_size == pytest.approx(actual, rel=0.002)
    costs = AnalyticCostModel(encoder, llm).costs(synthetic_shapes(64, seed=0))
    assert costs.shape == (64, 2) and (costs >= 0).all() and costs[:, 1].min() > 0


def test_presets_are_the_same_descriptions():
    """dflop's named presets are these models' architectures, not separate numbers."""
    ov_encoder, ov_7b = _spec("llava-onevision-qwen2-7b-ov").architecture()
    siglip = ENCODER_PRESETS["siglip-400m"]
    for field in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "patch_px"):
        assert getattr(siglip, field) == getattr(ov_encoder, field), field
    assert siglip.tokens_per_unit == ov_encoder.tokens_per_unit == 729
    for preset, name in (
        ("qwen2-0.5b", "llava-onevision-qwen2-0.5b-ov"),
        ("llm-7b", "qwen2-vl-7b-instruct"),
        ("llm-72b", "qwen2-vl-72b-instruct"),
    ):
        _, llm = _spec(name).architecture()
        ours = LLM_PRESETS[preset]
        for field in (
            "hidden_size",
            "num_layers",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "vocab_size",
        ):
            assert getattr(ours, field) == getattr(llm, field), (preset, field)


@pytest.mark.parametrize("name", ["llava-onevision-qwen2-7b-ov", "qwen2-vl-72b-instruct"])
def test_plan_a_released_model(tmp_path, name):
    """dflop plan --model hf:<config folder> plans the real size (analytic costs)."""
    out = tmp_path / "plan.json"
    result = run_cli(
        "plan",
        "--model",
        f"hf:{os.path.join(CONFIGS, name)}",
        "--gpus",
        "64",
        "--global-batch",
        "128",
        "--batches",
        "1",
        "-o",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(out.read_text())
    _, llm = _spec(name).architecture()
    assert plan["inputs"]["llm"]["num_layers"] == llm.num_layers
    assert plan["layouts"], "no layout fits"
