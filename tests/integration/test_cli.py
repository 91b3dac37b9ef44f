"""The README's main-job command and CLI errors, as real subprocesses."""

from __future__ import annotations

import json

import cli_harness
from conftest import DATA_DIR


def run_cli(*args: str, timeout_s: float = 300):
    return cli_harness.run_cli(*args, timeout_s=timeout_s)  # the demo needs longer


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
    assert result.stderr.strip() == (
        "dflop demo: error: argument --dp-size: 0 must be >= 1 (see dflop demo --help)"
    )


def test_profile_data_and_inspect(tmp_path) -> None:

    recipe = DATA_DIR / "llava_mini" / "recipe.yaml"
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
    # No output over an input: the dataset itself (however the path is written), or a
    # recipe's dataset file; the file is left as it was.
    data = tmp_path / "data.json"
    data.write_text('[{"conversations": [{"from": "human", "value": "hi"}]}]')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("datasets:\n  - json_path: data.json\n")
    for dataset, output in (
        (data, data),
        (data, tmp_path / "." / "data.json"),
        (recipe, data),
    ):
        result = run_cli("profile-data", str(dataset), "-o", str(output))
        assert result.returncode == 2, result.stdout + result.stderr
        assert "is a file this command reads (the dataset)" in result.stderr
    assert data.read_text().startswith('[{"conversations"')


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


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI's entry point in this process (the subprocess tests above run the same
    function through the installed script)."""
    from dflop.cli import main

    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's errors
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _bad_inputs(root) -> list[tuple[list[str], str]]:
    """(arguments, text the one error line holds), for files under ``root``."""
    folder = root / "d.json"
    folder.mkdir()
    (root / "README.md").write_text("mine")
    (root / "nums.json").write_text("[1, 2, 3]")
    (root / "bad.jsonl").write_text('{"a": 1\n{{{\n')
    (root / "empty_plan.json").write_text(
        json.dumps({"format": "dflop.plan", "version": 1, "layouts": []})
    )
    f = str
    return [
        (["inspect", f(folder)], "is a folder; give a file written by dflop"),
        (["simulate", f(folder)], "is a folder; give a plan JSON"),
        (["plan", "--local", "2", "--shapes", f(folder)], "--shapes is the data of --gpus"),
        (["plan", "--gpus", "8", "-o", f(root)], "is a folder; give a file path"),
        (  # --gpus plans the --shapes; --data would be silently ignored
            ["plan", "--gpus", "8", "--data", f(root / "README.md")],
            "--data is a setting of --local N planning; for --gpus give the data's shapes",
        ),
        (["plan", "--gpus", "8", "--family", "qwen2-vl"], "--family is a setting of --local N"),
        (["train", "--data", f(folder)], "is a folder; give a dataset file"),
        (["profile-data", f(folder), "-o", f(root / "s.json")], "is a folder; give a .json"),
        (["profile-model", "-o", f(root / "p.json"), "--device", "tpu"], "cpu or cuda[:N]"),
        (["profile-model", "-o", f(root / "p.json"), "--dtype", "int64"], "invalid choice"),
        (
            ["profile-model", "-o", f(root / "p.json"), "--encoder", "os:getcwd"],
            "the factory returned str, not a torch.nn.Module",
        ),
        (["profile-model", "-o", f(folder)], "is a folder; give a file path"),
        (["profile-model", "-o", f(root / "p.json"), "--max-units", "0"], "0 must be >= 1"),
        (["inspect", f(root / "empty_plan.json")], "the plan holds no layout"),
        (["simulate", f(root / "empty_plan.json")], "the plan holds no layout"),
        (["demo", "--out", f(root / "README.md")], "is a file; give a folder"),
        (["demo", "--steps", "0"], "argument --steps: 0 must be >= 1"),
        (["demo", "--global-batch", "0"], "argument --global-batch: 0 must be >= 1"),
        (["plan", "--gpus", "8", "--global-batch", "0"], "0 must be >= 1"),
        (["profile-data", f(root / "nums.json"), "-o", f(root / "s.json")], "not_an_object x3"),
        (["profile-data", f(root / "bad.jsonl"), "-o", f(root / "s.json")], "invalid_json x2"),
        (
            ["train", "--scaler", '{"unit_divisor": "x"}', "--layout", "enc_dp=1,llm_dp=1,m=1"],
            "TrainConfig.scaler['unit_divisor'] must be an integer, got str 'x'",
        ),
        (
            ["profile-data", f(root / "nums.json"), "-o", f(root / "s.json"), "--max-samples", "0"],
            "argument --max-samples: 0 must be >= 1",
        ),
    ]


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    """Each bad invocation: exit code 2, one line on stderr naming the problem, nothing
    written, before any work (no profile, plan or training output)."""
    for args, message in _bad_inputs(tmp_path):
        before = sorted(p.name for p in tmp_path.iterdir())
        code, out, err = _main(capsys, *args)
        assert code == 2, (args, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, err)
        assert lines[0].startswith(f"dflop {args[0]}: error: "), lines[0]
        assert out == "", (args, out)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, args
        assert (tmp_path / "README.md").read_text() == "mine"


def test_a_bug_keeps_its_traceback(monkeypatch, capsys) -> None:
    """Only validation errors become one line: a TypeError from a bug propagates (Python
    prints its traceback and exits 1) instead of being shown as bad input."""
    import dflop.commands.demo as demo
    import pytest
    from dflop.cli import main
    from dflop.errors import InputTypeError

    def buggy(args):
        return "a" < 1

    monkeypatch.setattr(demo, "run", buggy)
    with pytest.raises(TypeError, match="not supported between"):
        main(["demo"])

    def validating(args):
        raise InputTypeError("steps must be an integer, got str 'x'")

    monkeypatch.setattr(demo, "run", validating)
    assert main(["demo"]) == 2
    assert capsys.readouterr().err == "dflop demo: error: steps must be an integer, got str 'x'\n"


def test_the_launcher_of_a_cpu_run_never_imports_torch(tmp_path) -> None:
    """``dflop train`` on a CPU-only torch plans, starts its ranks (rank 0 serves the
    rendezvous on the launcher's socket) and reads their report without importing torch:
    its fork server imports torch once, while the launcher plans, instead of both."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from dflop.cli import main\n"
        f"code = main(['train', '--nproc', '2', '--steps', '1', '--deterministic', "
        f"'--output-dir', {str(tmp_path)!r}])\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step    1/1" in done.stdout
    assert done.stdout.strip().endswith("torch imported: False"), done.stdout[-2000:]


def test_a_cluster_plan_trains_only_with_settings_the_runtime_runs(tmp_path) -> None:
    """A --gpus plan prices bf16 and ZeRO-1 by default; dflop train executes neither yet,
    so it refuses the plan in one line naming both and the flags that price what runs;
    planned with them, the plan trains."""
    common = ["plan", "--model", "tiny", "--gpus", "2", "--gpus-per-node", "2",
              "--global-batch", "8", "--batches", "1"]  # fmt: skip
    default, fp32 = tmp_path / "bf16.json", tmp_path / "fp32.json"
    assert run_cli(*common, "-o", str(default)).returncode == 0
    made = run_cli(*common, "--precision", "fp32", "--no-zero1", "-o", str(fp32))
    assert made.returncode == 0, made.stderr
    inputs = json.loads(fp32.read_text())["inputs"]
    assert (inputs["element_bytes"], inputs["zero1"]) == (4, False)
    assert json.loads(default.read_text())["inputs"]["zero1"] is True
    train = ["train", "--model", "tiny", "--steps", "1", "--deterministic"]
    refused = run_cli(*train, "--plan", str(default), "--output-dir", str(tmp_path / "a"))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    for said in ("inputs.element_bytes=2", "inputs.zero1", "--precision fp32 --no-zero1"):
        assert said in refused.stderr
    trained = run_cli(*train, "--plan", str(fp32), "--output-dir", str(tmp_path / "b"))
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "step    1/1" in trained.stdout
    local = run_cli("plan", "--local", "2", "--precision", "fp32")
    assert local.returncode == 2 and "--precision is a setting of --gpus planning" in (local.stderr)
