"""Hugging Face models through dflop's commands: ``dflop train --model hf:PATH`` on the
shipped real-format records (real processes, real files), ``dflop profile-model`` and
``dflop plan`` on the model's own architecture, and the one architecture description
checked against the model's real parameter counts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA_DIR

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cli_harness import run_cli  # noqa: E402
from dflop.models import model_spec  # noqa: E402
from dflop.models.hf.tiny import save_tiny_llava_onevision, save_tiny_qwen_vl  # noqa: E402

DATA = os.path.join(DATA_DIR, "llava_mini")
TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return save_tiny_llava_onevision(str(tmp_path_factory.mktemp("tiny_ov")), seed=3)


@pytest.fixture(scope="module")
def tiny_deep_folder(tmp_path_factory) -> str:
    """LLaVA-OneVision with 4 text layers: enough for 2 stages x 2 interleaved chunks."""
    return save_tiny_llava_onevision(
        str(tmp_path_factory.mktemp("tiny_ov_deep")), seed=3, text_layers=4
    )


@pytest.fixture(scope="module")
def tiny_qwen_folder(tmp_path_factory) -> str:
    return save_tiny_qwen_vl(str(tmp_path_factory.mktemp("tiny_qwen")), seed=3)


# Per family: the model class, a tensor that never reaches the loss (kept as saved), or
# None, and tensors that must train (the encoder's first layer, the projector, the head).
FAMILIES = {
    "llava_onevision": (
        "LlavaOnevisionForConditionalGeneration",
        "model.vision_tower.post_layernorm.weight",
        ("model.vision_tower.encoder.layers.0.", "model.multi_modal_projector.linear_1.weight"),
    ),
    "qwen2_vl": (
        "Qwen2VLForConditionalGeneration",
        None,
        ("model.visual.blocks.0.", "model.visual.merger.mlp.0.weight"),
    ),
}


def _state(folder: str, family: str) -> dict:
    cls = getattr(transformers, FAMILIES[family][0])
    return cls.from_pretrained(folder).state_dict()


@pytest.mark.parametrize(
    "family,folder,layout,replace",
    [
        ("llava_onevision", "tiny_folder", "enc_dp=1,llm_pp=2,m=2", True),
        ("qwen2_vl", "tiny_qwen_folder", "enc_dp=1,llm_pp=2,m=2", False),
        ("llava_onevision", "tiny_deep_folder", "enc_dp=1,llm_pp=2,llm_v=2,m=2", False),
        ("llava_onevision", "tiny_folder", "colocated,llm_pp=2,m=2", False),
        ("qwen2_vl", "tiny_qwen_folder", "colocated,llm_dp=2,m=2", False),
    ],
    ids=[
        "llava_onevision-replacing",
        "qwen2_vl",
        "llava_onevision-interleaved",
        "llava_onevision-colocated",
        "qwen2_vl-colocated",
    ],
)
def test_train_cli_on_real_records(tmp_path, family, folder, layout, replace, request, quick_perf):
    """A tiny model of each family trains under 'dflop train' on the real-format records
    (LLaVA-OneVision: anyres images up to 2480 x 3508, multi-image, video frames,
    text-only; Qwen2-VL: images of any size as native patch grids, frame pairs of the
    videos) with the encoder and an LLM pipeline of 2 stages (also interleaved: 2 chunks
    per stage; and colocated: the encoder inside the first LLM stage, under a pipeline of
    2 stages or 2 replicas); the loss falls, and the
    saved Hugging Face folder loads with from_pretrained: trained tensors moved, untrained
    ones kept. ``replace``: the folder held a model already (the input's own files, a
    single model.safetensors), and --save-hf-replace replaced it whole: from_pretrained
    loads the trained model, not the old file beside a new index."""
    tiny_folder = request.getfixturevalue(folder)
    out, metrics = tmp_path / "trained", tmp_path / "metrics.json"
    if replace:
        shutil.copytree(tiny_folder, out)
        (out / "notes.txt").write_text("the old folder's")
        assert (out / "model.safetensors").is_file()
    result = run_cli(
        "train",
        "--model",
        f"hf:{tiny_folder}",
        "--data",
        os.path.join(DATA, "llava_mini.json"),
        "--image-folder",
        os.path.join(DATA, "images"),
        "--video-folder",
        os.path.join(DATA, "videos"),
        "--layout",
        layout,
        "--steps",
        "8",
        "--global-batch",
        "6",
        "--lr",
        "3e-3",
        "--save-hf",
        str(out),
        "--json",
        str(metrics),
        "--quiet",
        "--perf",
        quick_perf(f"hf:{tiny_folder}"),
        *(["--save-hf-replace"] if replace else []),
        timeout_s=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "usable" in result.stdout  # the dataset account
    losses = [step["loss"] for step in json.loads(metrics.read_text())["steps"]]
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < 0.85 * np.mean(losses[:2]), losses
    before, after = _state(tiny_folder, family), _state(str(out), family)
    assert before.keys() == after.keys()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    _, untrained, trained = FAMILIES[family]
    assert untrained is None or untrained not in moved  # never reaches the loss
    assert "lm_head.weight" in moved and trained[1] in moved
    assert any(k.startswith(trained[0]) for k in moved)
    # The folder loads as the input did: its processor files came along.
    written = {"config.json", "model.safetensors.index.json"}
    inputs = {p.name for p in Path(tiny_folder).iterdir()}
    extra = {n for n in inputs if not n.endswith(".safetensors") and n not in written}
    assert "preprocessor_config.json" in extra and extra <= {p.name for p in out.iterdir()}
    transformers = pytest.importorskip("transformers")
    transformers.AutoImageProcessor.from_pretrained(out)
    assert not (out / "model-untrained.safetensors").exists()
    # Replaced whole: nothing of the old folder is left, nothing staged beside it.
    assert not (out / "model.safetensors").exists() and not (out / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "trained"]


def test_save_hf_never_mixes_models_or_writes_into_the_input(tmp_path, tiny_folder):
    """Refused in one line before any process starts: the input model's folder (or one in
    it), and a folder holding files without --save-hf-replace (left untouched)."""
    data = os.path.join(DATA, "llava_mini.json")
    train = ["train", "--model", f"hf:{tiny_folder}", "--data", data, "--steps", "1"]
    for target, says in (
        (tiny_folder, "is the input model's folder"),
        (os.path.join(tiny_folder, "trained"), "is inside the input model's folder"),
        (os.path.dirname(tiny_folder), "holds the input model's folder"),
    ):
        result = run_cli(*train, "--save-hf", target, "--save-hf-replace")
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    filled = tmp_path / "filled"
    filled.mkdir()
    (filled / "model.safetensors").write_bytes(b"an older model")
    result = run_cli(*train, "--save-hf", str(filled))
    assert result.returncode == 2, result.stderr
    assert "is not empty ('model.safetensors')" in result.stderr
    assert "--save-hf-replace" in result.stderr
    assert (filled / "model.safetensors").read_bytes() == b"an older model"
    assert not os.path.exists(os.path.join(tiny_folder, "trained"))


def test_train_rejects_synthetic_data_and_scaler(tiny_folder):
    result = run_cli("train", "--model", f"hf:{tiny_folder}", "--steps", "1")
    assert result.returncode != 0
    assert "trains on a LLaVA-style dataset" in result.stderr
    result = run_cli("train", "--model", "hf:/no/such/folder", "--steps", "1")
    assert result.returncode != 0 and "no config.json" in result.stderr


def test_profile_and_plan_the_model(tmp_path, tiny_folder):
    """profile-model times the model's own whole encoder and LLM; plan --model plans its
    architecture (from config.json) with the measured model."""
    perf = tmp_path / "perf.json"
    result = run_cli(
        "profile-model",
        "--model",
        f"hf:{tiny_folder}",
        "--max-units",
        "4",
        "--max-tokens",
        "256",
        "--repeats",
        "2",
        "-o",
        str(perf),
        timeout_s=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(perf.read_text())
    assert data["metadata"]["vision"]["tokens_per_unit"] == 16
    plan_path = tmp_path / "plan.json"
    result = run_cli(
        "plan",
        "--model",
        f"hf:{tiny_folder}",
        "--gpus",
        "4",
        "--perf",
        str(perf),
        "--global-batch",
        "16",
        "--batches",
        "1",
        "-o",
        str(plan_path),
        timeout_s=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    inputs = json.loads(plan_path.read_text())["inputs"]
    encoder, llm = model_spec(f"hf:{tiny_folder}").architecture()
    assert inputs["encoder"]["num_layers"] == encoder.num_layers == 2
    assert inputs["llm"]["hidden_size"] == llm.hidden_size == 64


@pytest.mark.parametrize("feature_layer", [-1, -2])
def test_architecture_matches_the_model(tmp_path, feature_layer):
    """The planner's parameter counts from the spec's architecture equal the model's
    (within the biases and norms the planner rounds away), for the layers that run."""
    from dflop.models.hf import spec_from_config
    from dflop.models.hf.tiny import tiny_llava_onevision_config
    from dflop.planner.model import planner_modules

    config = tiny_llava_onevision_config(vision_layers=3)
    config.vision_feature_layer = feature_layer
    spec = spec_from_config(config)
    encoder, llm = spec.architecture()
    enc, dec = planner_modules(encoder, llm)
    model = transformers.LlavaOnevisionForConditionalGeneration(config)

    def count(prefixes):
        return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefixes))

    used = tuple(f"model.vision_tower.encoder.layers.{i}." for i in range(spec.encoder_layers))
    assert spec.encoder_layers == 3 + 1 + feature_layer
    vision = count(("model.vision_tower.embeddings", "model.multi_modal_projector", *used))
    planned = enc.num_layers * enc.params_per_layer + enc.first_stage_params
    planned += enc.last_stage_params
    assert planned == pytest.approx(vision, rel=0.03)
    text = count(("model.language_model", "lm_head"))
    planned = dec.num_layers * dec.params_per_layer + dec.first_stage_params
    planned += dec.last_stage_params
    assert planned == pytest.approx(text, rel=0.03)


def test_qwen_vl_architecture_matches_the_model():
    """The same for Qwen2-VL's vision tower: 3D patches (2 frames), rotary positions (no
    learned table), the 2x2 merger as the projector."""
    from dflop.models.hf import spec_from_config
    from dflop.models.hf.tiny import tiny_qwen2_vl_config
    from dflop.planner.model import planner_modules

    config = tiny_qwen2_vl_config()
    spec = spec_from_config(config)
    encoder, _ = spec.architecture()
    assert encoder.frames_per_patch == 2 and not encoder.learned_positions
    enc, _ = planner_modules(*spec.architecture())
    model = transformers.Qwen2VLForConditionalGeneration(config)
    vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    planned = enc.num_layers * enc.params_per_layer + enc.first_stage_params
    planned += enc.last_stage_params
    assert planned == pytest.approx(vision, rel=0.03)
