"""The README's main-job command and CLI errors, as real subprocesses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys


def run_cli(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    executable = shutil.which("dflop")
    command = [executable] if executable else [sys.executable, "-m", "dflop.cli"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def test_scheduler_only_demo_runs() -> None:
    result = run_cli("demo", "--scheduler-only", "--steps", "3")
    assert result.returncode == 0, result.stderr
    assert "total" in result.stdout
    assert "dflop max s" in result.stdout


def test_demo_json_dflop_beats_blind() -> None:
    result = run_cli("demo", "--scheduler-only", "--steps", "4", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert len(report["steps"]) == 4
    for step in report["steps"]:
        assert step["dflop_max_load_s"] >= step["lower_bound_s"] * (1 - 1e-12)
        assert step["dflop_max_load_s"] <= step["blind_max_load_s"]
        assert step["dflop_ratio"] < 1.02


def test_demo_bad_argument_is_a_clear_error() -> None:
    result = run_cli("demo", "--scheduler-only", "--dp-size", "0")
    assert result.returncode == 2
    assert "dp_size" in result.stderr
    assert "Traceback" not in result.stderr


def test_profile_data_and_inspect(tmp_path) -> None:
    from pathlib import Path

    recipe = Path(__file__).parent / "data" / "llava_mini" / "recipe.yaml"
    shapes = tmp_path / "shapes.json"
    png = tmp_path / "shapes.png"
    result = run_cli("profile-data", str(recipe), "-o", str(shapes), "--plot", str(png))
    assert result.returncode == 0, result.stderr
    assert shapes.exists() and png.stat().st_size > 0
    assert "skipped" in result.stdout.lower()
    result = run_cli("inspect", str(shapes))
    assert result.returncode == 0, result.stderr
    assert "ShapeDistribution" in result.stdout


def test_profile_data_errors_are_clear(tmp_path) -> None:
    result = run_cli("profile-data", str(tmp_path / "missing.json"), "-o", "x.json")
    assert result.returncode == 2 and "missing.json" in result.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    result = run_cli("profile-data", str(bad), "--family", "nope", "-o", "x.json")
    assert result.returncode == 2 and "nope" in result.stderr and "llava-ov" in result.stderr
    result = run_cli("inspect", str(bad))
    assert result.returncode == 2 and "bad.json" in result.stderr


def test_profile_model_and_inspect(tmp_path) -> None:
    perf = tmp_path / "perf.json"
    result = run_cli(
        "profile-model", "--encoder", "tiny", "--llm", "tiny", "--repeats", "1", "-o", str(perf)
    )
    assert result.returncode == 0, result.stderr
    assert perf.exists()
    result = run_cli("inspect", str(perf))
    assert result.returncode == 0, result.stderr
    assert "us/token" in result.stdout or "ms/token" in result.stdout


def test_profile_model_errors_are_clear(tmp_path) -> None:
    result = run_cli("profile-model", "--llm", "nope", "-o", str(tmp_path / "p.json"))
    assert result.returncode == 2 and "nope" in result.stderr
    result = run_cli("profile-model", "--device", "cuda", "-o", str(tmp_path / "p.json"))
    if "no CUDA device" in result.stderr:
        assert result.returncode == 2


def test_inspect_plan(tmp_path) -> None:
    plan = tmp_path / "plan.json"
    result = run_cli(
        "plan", "--gpus", "8", "--gpus-per-node", "8", "--global-batch", "64", "-o", str(plan)
    )
    assert result.returncode == 0, result.stderr
    result = run_cli("inspect", str(plan))
    assert result.returncode == 0, result.stderr
    assert "samples/s" in result.stdout
