"""``dflop train --trainable``: frozen parts over real processes. The frozen weights come
out of training bit-identical, a stage with nothing trainable keeps no optimizer state,
and the parts that train change."""

from __future__ import annotations

import json

import pytest
from cli_harness import run_cli

torch = pytest.importorskip("torch")

from dflop.models import model_spec  # noqa: E402
from dflop.models.spec import StageSlice  # noqa: E402
from dflop.models.trainable import TrainableParts  # noqa: E402

# Encoder pp=2 (the first stage is all tower: frozen under frozen-vision; the second
# holds the projector) and one LLM stage: 3 processes.
LAYOUT = "enc_dp=1,enc_pp=2,llm_dp=1,llm_pp=1,m=2"


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
    # The command it suggests trains what was planned.
    assert f"dflop train --plan {plan} --trainable frozen-vision" in result.stdout
    other = run_cli("train", "--plan", str(plan), "--steps", "1", "--quiet")
    assert other.returncode == 0, other.stdout + other.stderr
    assert "was planned to train frozen-vision, this run trains full" in other.stdout + other.stderr
