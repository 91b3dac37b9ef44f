"""``dflop train --trainable``: frozen parts over real processes. The frozen weights come
out of training bit-identical, a stage with nothing trainable keeps no optimizer state,
and the parts that train change."""

from __future__ import annotations

import json

import pytest
from cli_harness import run_cli
from conftest import DATA_DIR

torch = pytest.importorskip("torch")

from dflop.models import model_spec  # noqa: E402
from dflop.models.spec import StageSlice  # noqa: E402
from dflop.models.trainable import TrainableParts  # noqa: E402

# Encoder pp=2 (the first stage is all tower: frozen under frozen-vision; the second
# holds the projector) and one LLM stage: 3 processes.
LAYOUT = "enc_dp=1,enc_pp=2,llm_dp=1,llm_pp=1,m=2"


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory, quick_perf):
    """``hf_base(family, seed)``: (a tiny Hugging Face folder of ``family``, its quick
    performance model), made once per module (the tests read it, never write it)."""
    from dflop.models.hf.tiny import save_tiny

    made: dict[tuple[str, int], tuple[str, str]] = {}

    def base(family: str, seed: int = 0) -> tuple[str, str]:
        if (family, seed) not in made:
            folder = save_tiny(str(tmp_path_factory.mktemp(family)), family, seed=seed)
            made[family, seed] = (folder, quick_perf(f"hf:{folder}"))
        return made[family, seed]

    return base


def _initial_stage(module: str, layers: tuple[int, int], first: bool, last: bool):
    spec = model_spec("tiny")
    stage = spec.build_stage(StageSlice(module, layers, first, last), seed=0)
    return {name: p.detach().clone() for name, p in stage.state_dict().items()}


@pytest.mark.parametrize("trainable", ["frozen-vision", "projector"])
def test_frozen_parts_stay_bit_identical_and_hold_no_optimizer_state(tmp_path, trainable):
    ckpt = tmp_path / "ckpt"
    metrics = tmp_path / "m.json"
    result = run_cli(
        "train", "--scheduler", "blind", "--layout", LAYOUT, "--global-batch", "8",
        "--steps", "2", "--lr", "1e-2", "--trainable", trainable, "--quiet",
        "--checkpoint-dir", str(ckpt), "--json", str(metrics),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(s["loss"] > 0 for s in json.loads(metrics.read_text())["steps"])
    step = ckpt / (ckpt / "latest").read_text().strip()
    parts = TrainableParts.parse(trainable)
    spec = model_spec("tiny")
    enc, llm = spec.num_layers("encoder"), spec.num_layers("llm")
    half = enc // 2
    stages = [  # (rank, module, layers, first, last)
        (0, "encoder", (0, half), True, False),
        (1, "encoder", (half, enc), False, True),
        (2, "llm", (0, llm), True, True),
    ]
    for rank, module, layers, first, last in stages:
        saved = torch.load(step / f"rank-{rank:05d}.pt", weights_only=True)
        initial = _initial_stage(module, layers, first, last)
        assert set(saved["stage"]) == set(initial)
        for name, value in saved["stage"].items():
            part = spec.parameter_part(module, name)
            same = torch.equal(value, initial[name])
            assert same != parts.trains(part), f"rank {rank} {name} ({part})"
        trains_here = any(parts.trains(spec.parameter_part(module, n)) for n in saved["stage"])
        optimizer_state = saved["optimizer"]["state"]
        assert bool(optimizer_state) == trains_here, f"rank {rank}"
        if trains_here:  # Adam state only for the parameters that train
            trained = [n for n in saved["stage"] if parts.trains(spec.parameter_part(module, n))]
            assert len(optimizer_state) == len(trained)


def test_a_bad_regime_is_named_in_one_line():
    result = run_cli("train", "--trainable", "vision=frozen", "--steps", "1")
    assert result.returncode == 2
    assert "'vision' is not a part; parts: encoder, projector, llm" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_plan_records_its_regime_and_training_names_a_mismatch(tmp_path):
    plan = tmp_path / "plan.json"
    result = run_cli(
        "plan", "--local", "3", "--layout", LAYOUT, "--global-batch", "8",
        "--trainable", "frozen-vision", "-o", str(plan),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(plan.read_text())["inputs"]["trainable"] == "frozen-vision"
    assert "priced for training frozen-vision" in result.stdout
    # The command it suggests trains what was planned: the plan carries its regime.
    assert f"train it with: dflop train --plan {plan}\n" in result.stdout
    same = run_cli("train", "--plan", str(plan), "--steps", "1", "--quiet")
    assert same.returncode == 0, same.stdout + same.stderr
    assert f"training what {plan} was planned for: --trainable frozen-vision" in same.stdout
    assert "note:" not in same.stdout + same.stderr
    other = run_cli("train", "--plan", str(plan), "--steps", "1", "--quiet", "--trainable", "full")
    assert other.returncode == 0, other.stdout + other.stderr
    assert "was planned to train frozen-vision, this run trains full" in other.stdout + other.stderr


def test_lora_adapters_train_and_round_trip_through_peft(tmp_path, hf_base):
    """``--trainable lora`` on a Hugging Face LLaVA-OneVision folder (the LLM's linear
    layers get PEFT adapters, the tower is frozen, the projector trains): the base weights
    stay bit-identical, only adapters and the projector hold optimizer state, and
    ``--save-hf`` writes the merged model plus a PEFT adapter folder that, loaded onto the
    starting model with ``PeftModel.from_pretrained`` and merged, is that same model."""
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base, perf = hf_base("llava_onevision")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    result = run_cli(*_lora_train_args(base, perf, "enc_dp=1,llm_pp=1,m=2", 2), "--lr", "1e-2",
                     "--lora-rank", "4", "--quiet", "--checkpoint-dir", str(ckpt),
                     "--save-hf", str(out))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # The LLM rank's checkpoint: base weights as built, adapters trained, Adam state for
    # the adapters only.
    step = ckpt / (ckpt / "latest").read_text().strip()
    saved = torch.load(step / "rank-00001.pt", weights_only=True)
    initial = transformers.AutoModelForImageTextToText.from_pretrained(base).state_dict()
    adapters = [n for n in saved["stage"] if ".lora_" in n]
    assert adapters and all(".lora_A.default." in n or ".lora_B.default." in n for n in adapters)
    for name, value in saved["stage"].items():
        if ".lora_" not in name:
            assert torch.equal(value, initial[name.replace(".base_layer.", ".")]), name
    assert len(saved["optimizer"]["state"]) == len(adapters)
    assert any(saved["stage"][n].abs().max() > 0 for n in adapters if ".lora_B." in n)
    _assert_adapter_round_trips(base, out)
    # Another LoRA rank cannot resume this checkpoint.
    again = run_cli(*_lora_train_args(base, perf, "enc_dp=1,llm_pp=1,m=2", 3), "--lora-rank", "8",
                    "--checkpoint-dir", str(ckpt))  # fmt: skip
    assert again.returncode != 0
    assert "lora_rank=8, the checkpoint's 4" in again.stderr


def _lora_train_args(base, perf: str, layout: str, steps: int) -> tuple[str, ...]:
    data = DATA_DIR / "llava_mini"
    return (
        "train", "--model", f"hf:{base}", "--data", str(data / "llava_mini.json"),
        "--image-folder", str(data / "images"), "--video-folder", str(data / "videos"),
        "--layout", layout, "--global-batch", "4", "--steps", str(steps),
        "--trainable", "lora", "--perf", perf,
    )  # fmt: skip


def _assert_adapter_round_trips(base, out) -> None:
    """``out/lora-adapter``, loaded onto the starting model ``base`` with PEFT and merged,
    is the merged model ``out``; the projector and the LLM moved, the tower did not."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    load = transformers.AutoModelForImageTextToText.from_pretrained
    initial = load(base).state_dict()
    merged = peft.PeftModel.from_pretrained(load(base), out / "lora-adapter").merge_and_unload()
    ours = load(out).state_dict()
    theirs = merged.state_dict()
    assert set(ours) == set(theirs)
    for name in theirs:
        assert torch.allclose(ours[name], theirs[name], rtol=1e-6, atol=1e-7), name
    trained = [n for n in theirs if not torch.equal(theirs[n], initial[n])]
    assert any("multi_modal_projector" in n for n in trained)
    assert any("language_model" in n for n in trained)  # the LLM's merged updates
    assert not any("vision_tower" in n for n in trained)  # frozen


def test_lora_under_tensor_parallelism_trains_resumes_and_round_trips(tmp_path, hf_base):
    """LoRA on tensor-parallel modules (encoder tp 2, LLM tp 2: the adapters sharded like
    the layers they adapt): the run trains, stops, resumes its checkpoint, and its
    ``--save-hf`` adapter folder round-trips through PEFT; LoRA dropout under tensor
    parallelism is refused in one line before any process starts."""
    pytest.importorskip("peft")
    base, perf = hf_base("llava_onevision")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    layout = "enc_tp=2,llm_tp=2,m=2"
    first = run_cli(*_lora_train_args(base, perf, layout, 1), "--lr", "1e-2", "--quiet",
                    "--checkpoint-dir", str(ckpt))  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr
    resumed = run_cli(*_lora_train_args(base, perf, layout, 2), "--lr", "1e-2", "--quiet",
                      "--checkpoint-dir", str(ckpt), "--save-hf", str(out))  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resum" in resumed.stdout + resumed.stderr
    _assert_adapter_round_trips(base, out)
    refused = run_cli(*_lora_train_args(base, perf, layout, 1), "--lora-dropout", "0.1")
    assert refused.returncode != 0
    assert "LoRA dropout on a tensor-parallel llm (llm tp=2)" in refused.stderr


# Per family: the vision tower's and the projector's parameter prefixes in the saved
# Hugging Face folder.
FAMILY_PARTS = {
    "llava_onevision": ("model.vision_tower.", "model.multi_modal_projector."),
    "qwen2_vl": ("model.visual.blocks.", "model.visual.merger."),
    "internvl": ("model.vision_tower.", "model.multi_modal_projector."),
}


# Each preset on each family once (the whole 3 x 3 matrix passed too, in 6 minutes: too
# long for every run; the engine-level equivalence tests cover every pair).
PRESET_CASES = [
    ("llava_onevision", "frozen-vision"),
    ("qwen2_vl", "lora"),
    ("internvl", "projector"),
]


@pytest.mark.parametrize(("family", "trainable"), PRESET_CASES)
def test_presets_train_every_family_on_real_records(tmp_path, family, trainable, hf_base):
    """``dflop train --model hf:DIR --trainable PRESET`` on the shipped real-format records
    (images, multi-image, video, text-only): what the preset freezes comes out of
    ``--save-hf`` as it went in, what it trains moved (LoRA: merged into the LLM's
    weights)."""
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base, perf = hf_base(family, seed=3)
    out = tmp_path / "out"
    data = DATA_DIR / "llava_mini"
    result = run_cli(
        "train", "--model", f"hf:{base}", "--data", str(data / "llava_mini.json"),
        "--image-folder", str(data / "images"), "--video-folder", str(data / "videos"),
        "--layout", "enc_dp=1,llm_pp=1,m=2", "--global-batch", "4", "--steps", "2",
        "--lr", "1e-2", "--trainable", trainable, "--quiet", "--save-hf", str(out),
        "--perf", perf,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    load = transformers.AutoModelForImageTextToText.from_pretrained
    before, after = load(base).state_dict(), load(out).state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    tower, projector = FAMILY_PARTS[family]
    assert not any(k.startswith(tower) for k in moved), trainable  # frozen in every preset
    assert any(k.startswith(projector) for k in moved)
    llm_moved = any("language_model" in k or k == "lm_head.weight" for k in moved)
    assert llm_moved == (trainable != "projector")
    if trainable == "lora":
        assert (out / "lora-adapter" / "adapter_model.safetensors").is_file()
