"""Training survives damaged, missing and hostile checkpoints and stops on a non-finite
step; every test runs the real 'dflop train' command with real processes."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cli_harness import run_cli  # noqa: E402
from conftest import DATA_DIR  # noqa: E402
from dflop.train.checkpoint import verify_checkpoint  # noqa: E402

LAYOUT = "enc_dp=1,enc_pp=1,llm_dp=1,llm_pp=1,m=2"


def _train(tmp_path: Path, *extra: str, env: dict | None = None):
    metrics = tmp_path / f"m-{len(list(tmp_path.iterdir()))}.json"
    result = run_cli(
        "train",
        "--scheduler",
        "blind",  # no cost model: no timing in the loss
        "--layout",
        LAYOUT,
        "--global-batch",
        "8",
        "--quiet",
        "--json",
        str(metrics),
        *extra,
        env=env,
    )
    report = json.loads(metrics.read_text()) if metrics.exists() else None
    return result, report


def _losses(report) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in report["steps"]}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """6 uninterrupted steps: what every resumed run must reproduce."""
    result, report = _train(tmp_path_factory.mktemp("full"), "--steps", "6")
    assert result.returncode == 0, result.stderr
    return _losses(report)


@pytest.fixture(scope="module")
def trained_checkpoints(tmp_path_factory):
    """The checkpoint folders of one run per step count (checkpointed every step), made
    once for the module: each test resumes, damages or crafts its own copy."""
    made: dict[int, Path] = {}

    def make(steps: int) -> Path:
        if steps not in made:
            folder = tmp_path_factory.mktemp(f"ckpt{steps}")
            ckpt = folder / "ckpt"
            result, _ = _train(
                folder, "--steps", str(steps), "--checkpoint-dir", str(ckpt),
                "--checkpoint-every", "1",
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            # Named for the steps done, as the progress line counts them.
            assert (ckpt / "latest").read_text().strip() == f"step-{steps:06d}"
            made[steps] = ckpt
        return made[steps]

    return make


def _checkpointed(tmp_path: Path, trained_checkpoints, steps: int = 4) -> Path:
    """A copy, in ``tmp_path``, of the module's checkpoint folder of ``steps`` steps."""
    import shutil

    return Path(shutil.copytree(trained_checkpoints(steps), tmp_path / "ckpt"))


def test_a_damaged_checkpoint_is_detected_and_the_previous_one_used(
    tmp_path, full_run, trained_checkpoints
):
    """64 random bytes in a rank's file of the latest step: the resume says so and
    continues from the step before, reproducing the uninterrupted run."""
    ckpt = _checkpointed(tmp_path, trained_checkpoints)
    victim = ckpt / "step-000004" / "rank-00001.pt"
    data = bytearray(victim.read_bytes())
    offset = len(data) // 2
    data[offset : offset + 64] = np.random.default_rng(0).bytes(64)
    victim.write_bytes(bytes(data))
    assert "damaged" in verify_checkpoint(ckpt / "step-000004", 2)
    result, report = _train(tmp_path, "--steps", "6", "--checkpoint-dir", str(ckpt))
    assert result.returncode == 0, result.stderr
    assert "does not match its checksum" in result.stdout
    assert "resuming from step-000003" in result.stdout
    losses = _losses(report)
    assert sorted(losses) == [3, 4, 5]
    for step, loss in losses.items():
        assert loss == pytest.approx(full_run[step], rel=1e-5)


def test_latest_naming_a_missing_step_is_said_and_the_newest_intact_one_used(
    tmp_path, trained_checkpoints
):
    ckpt = _checkpointed(tmp_path, trained_checkpoints)
    for path in (ckpt / "step-000004").iterdir():
        path.unlink()
    (ckpt / "step-000004").rmdir()
    result, report = _train(tmp_path, "--steps", "5", "--checkpoint-dir", str(ckpt))
    assert result.returncode == 0, result.stderr
    assert "'latest' names step-000004" in result.stdout and "does not exist" in result.stdout
    assert sorted(_losses(report)) == [3, 4]


def test_a_non_finite_step_stops_the_run_before_the_update(tmp_path):
    """--lr 1e12 --grad-clip 0 diverges: the run stops with a clear message and a
    non-zero exit, and the last checkpoint holds the finite weights of the step before."""
    ckpt = tmp_path / "ckpt"
    result, _ = _train(
        tmp_path,
        "--steps",
        "8",
        "--lr",
        "1e12",
        "--grad-clip",
        "0",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "1",
    )
    assert result.returncode != 0
    assert "is not finite; stopped before the update" in result.stderr
    latest = ckpt / (ckpt / "latest").read_text().strip()
    assert verify_checkpoint(latest, 2) is None
    for rank in (0, 1):
        state = torch.load(latest / f"rank-{rank:05d}.pt", weights_only=True)
        assert all(torch.isfinite(t).all() for t in state["stage"].values())


class _Payload:
    """Unpickling this runs code: what a hostile checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, trained_checkpoints):
    """A rank file crafted to run code when unpickled (with a matching checksum): the
    resume refuses to load it and the code never runs."""
    import hashlib

    ckpt = _checkpointed(tmp_path, trained_checkpoints, steps=2)
    marker = tmp_path / "pwned"
    for rank in (0, 1):
        path = ckpt / "step-000002" / f"rank-{rank:05d}.pt"
        state = {"step": 1, "stage": _Payload(str(marker))}
        torch.save(state, path, pickle_module=pickle)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        path.with_name(path.name + ".sha256").write_text(digest)
    result, _ = _train(tmp_path, "--steps", "3", "--checkpoint-dir", str(ckpt))
    assert result.returncode != 0
    assert "refusing to load it" in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "999"], "exceed this machine's limit"),
        (["--layout", "enc_dp=1,llm_pp=1000,m=2"], "llm_pp=1000 pipeline stages"),
        (["--layout", "enc_dp=64,llm_dp=64,m=1", "--global-batch", "64"], "128 local processes"),
        (["--json", "nodir/m.json"], "does not exist"),
        (["--checkpoint-dir", __file__], "is a file; give a folder"),
        (["--trace", os.path.dirname(__file__)], "is a folder; give a file path"),
        (["--timeout-s", "1e-300"], "timeout_s=1e-300 must be a number of seconds from 1"),
        (["--layout", "enc_dp=1000000,m=2"], "1000001 local processes exceed"),
        (["--global-batch", "10000000"], "TrainConfig.global_batch=10,000,000 is more than"),
        (["--metrics-jsonl", os.path.dirname(__file__)], "metrics_jsonl="),
        (["--metrics-jsonl", os.path.join(__file__, "m.jsonl")], "is a file; give a folder"),
    ],
    ids=[
        "nproc",
        "stages",
        "layout_procs",
        "json",
        "checkpoint_dir",
        "trace",
        "timeout",
        "million_ranks",
        "huge_batch",
        "metrics_jsonl_folder",
        "metrics_jsonl_under_a_file",
    ],
)
def test_bad_runs_are_refused_before_any_process_starts(tmp_path, args, message):
    """One line, exit code 2, nothing started or written (a few seconds at most)."""
    result = run_cli("train", "--scheduler", "blind", "--steps", "40", *args, timeout_s=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "step" not in result.stdout


def _default_sigint() -> None:
    """A child started from a background job inherits SIGINT ignored (bash without job
    control), and Python then installs no KeyboardInterrupt handler: restore Ctrl-C's
    default so the tests see what a terminal user sees."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_long_run(tmp_path: Path, ckpt: Path):
    import shutil
    import subprocess
    import sys

    executable = shutil.which("dflop")
    command = [executable] if executable else [sys.executable, "-m", "dflop.cli"]
    args = ["train", "--scheduler", "blind", "--layout", LAYOUT, "--global-batch", "8"]
    args += ["--steps", "100000", "--quiet", "--checkpoint-dir", str(ckpt)]
    args += ["--checkpoint-every", "20"]
    proc = subprocess.Popen(
        [*command, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
        start_new_session=True,  # its own process group: a terminal's Ctrl-C reaches all
    )
    import time

    deadline = time.monotonic() + 120
    while not (ckpt / "latest").exists():  # training is under way
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.2)
    return proc


def _users_files(ckpt: Path) -> list[Path]:
    """Files in a checkpoint folder that dflop did not write, named like temporaries: a
    user's notes, and another run's checkpoint (with an in-flight temporary) nested in it."""
    paths = [
        ckpt / "thesis.tmp",
        ckpt / "notes" / "draft.tmp-3",
        ckpt / "latest.tmp",  # not write_file's pattern (no writer's process id)
        ckpt / "other-run" / "step-000001" / "rank-00000.pt.tmp-123",
        ckpt / "other-run" / "latest.tmp-123",
    ]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"theirs")
    return paths


def _settled(ckpt: Path, wait_s: float = 3.0) -> str:
    """``latest`` after ``wait_s`` more seconds, asserting it did not move meanwhile (no
    rank is left training and checkpointing)."""
    import time

    before = (ckpt / "latest").read_text()
    steps = sorted(p.name for p in ckpt.glob("step-*"))
    time.sleep(wait_s)
    assert (ckpt / "latest").read_text() == before
    assert sorted(p.name for p in ckpt.glob("step-*")) == steps
    return before.strip()


def test_sigterm_stops_cleanly_with_a_final_checkpoint(tmp_path):
    """A scheduler's SIGTERM to the launcher: the ranks stop after the same step, save a
    verified checkpoint there, exit; the launcher exits 143; resuming continues."""
    import signal

    ckpt = tmp_path / "ckpt"
    proc = _start_long_run(tmp_path, ckpt)
    proc.send_signal(signal.SIGTERM)
    _assert_stopped_with_checkpoint(tmp_path, proc, ckpt, "SIGTERM", 143)


def _assert_stopped_with_checkpoint(tmp_path, proc, ckpt, reason: str, code: int) -> None:
    """The run stopped after a step with a verified checkpoint named for it, said so in
    one line, exited ``code``; rerunning resumes at the next step."""
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert f"{reason}: stopping after the current step" in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"dflop train: stopped by {reason} after step "), err
    done = int(line.split("after step ")[1].split(" of ")[0])  # steps done, from 1
    latest = _settled(ckpt)
    assert f"checkpoint {ckpt / latest} (rerun the same command to resume)" in line
    assert latest == f"step-{done:06d}" and verify_checkpoint(ckpt / latest, 2) is None
    assert "Traceback" not in err
    result, report = _train(tmp_path, "--steps", str(done + 2), "--checkpoint-dir", str(ckpt))
    assert result.returncode == 0, result.stderr
    assert f"(after step {done}; step {done + 1} of {done + 2} next)" in result.stdout
    assert sorted(_losses(report)) == [done, done + 1]  # the report's 0-based step indices


def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path):
    """SIGKILL to the launcher (no handler can run): the ranks notice and exit at once;
    nothing keeps training or moving the checkpoint."""
    ckpt = tmp_path / "ckpt"
    proc = _start_long_run(tmp_path, ckpt)
    proc.kill()
    proc.communicate(timeout=30)
    import time

    time.sleep(2.0)  # the ranks poll their launcher twice a second
    _settled(ckpt)


def test_a_resumed_run_keeps_the_layout_and_cost_model_it_chose(tmp_path):
    """Planned from a timing profile (no --layout): the resume takes the layout and cost
    model saved with the checkpoints instead of profiling and planning again."""
    ckpt = tmp_path / "ckpt"
    args = ["train", "--nproc", "2", "--global-batch", "8", "--quiet"]
    args += ["--checkpoint-dir", str(ckpt)]
    first = run_cli(*args, "--steps", "2")
    assert first.returncode == 0, first.stderr
    assert "profiling" in first.stdout and (ckpt / "run.json").is_file()
    saved = json.loads((ckpt / "run.json").read_text())
    second = run_cli(*args, "--steps", "4")
    assert second.returncode == 0, second.stderr
    assert "profiling" not in second.stdout
    assert "resuming: the layout and cost model the run chose" in second.stdout
    assert "resumed from" in second.stdout
    assert json.loads((ckpt / "run.json").read_text()) == saved


def test_ctrl_c_stops_after_the_step_with_a_checkpoint(tmp_path):
    """Ctrl-C in a terminal (SIGINT to the whole process group: launcher and ranks): every
    rank stops after the same step and saves it, one line, exit 130; rerunning the same
    command resumes at the next step."""
    import signal

    ckpt = tmp_path / "ckpt"
    proc = _start_long_run(tmp_path, ckpt)
    os.killpg(proc.pid, signal.SIGINT)
    _assert_stopped_with_checkpoint(tmp_path, proc, ckpt, "Ctrl-C", 130)


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    """Two Ctrl-C: the ranks are killed at once, one line, exit 130, and no rank keeps
    training."""
    import signal
    import time

    ckpt = tmp_path / "ckpt"
    proc = _start_long_run(tmp_path, ckpt)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "dflop train: interrupted"
    assert "Traceback" not in err
    _settled(ckpt)


def test_checkpoints_by_time_metrics_per_step_and_a_first_run_says_it_starts_fresh(tmp_path):
    """--checkpoint-every-min saves whenever that much time passed since the last save
    (here: after every step, without --checkpoint-every); a run that finds no checkpoint
    says so in one line."""
    ckpt = tmp_path / "ckpt"
    theirs = _users_files(ckpt)  # in the folder before any run: never dflop's to remove
    args = ("--steps", "3", "--checkpoint-dir", str(ckpt), "--checkpoint-every-min", "1e-6")
    result, _ = _train(tmp_path, *args, "--peak-tflops", "0.5")
    assert result.returncode == 0, result.stderr
    assert f"checkpoint: none in {ckpt} yet; starting from step 1" in result.stdout
    assert all(p.read_bytes() == b"theirs" for p in theirs) and "removed" not in result.stdout
    # Rotation keeps the newest two: step 2's exists only if a save came after step 2.
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-000002", "step-000003"]
    # The per-step metrics beside the checkpoints (steps counted as the progress line
    # does), appended by a resumed run; MFU only against a stated or known peak.
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["tflops_per_s"] > 0 and r["tokens_per_s"] > 0 and r["loss"] > 0
        assert r["mfu"] == pytest.approx(r["tflops_per_s"] / (0.5 * 2))  # 2 processes
    result, _ = _train(tmp_path, "--steps", "4", "--checkpoint-dir", str(ckpt))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["mfu"] is None  # CPU
    # Run again with every step done (as when re-running only to export): said as such.
    result, _ = _train(tmp_path, "--steps", "4", "--checkpoint-dir", str(ckpt))
    assert result.returncode == 0, result.stderr
    assert "(after step 4; all 4 steps done: nothing left to train)" in result.stdout


def test_metrics_always_and_tensorboard_and_wandb_with_the_same_values(tmp_path):
    """Without a checkpoint folder the JSON lines go to ./dflop-train-out (said in one
    line); --log tensorboard,wandb writes TensorBoard event files and an offline W&B run
    (nothing leaves the machine) in --output-dir, with the JSON lines' values."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = ("train", "--scheduler", "blind", "--layout", LAYOUT, "--global-batch", "8")
    result = run_cli(*train, "--steps", "2", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    default = tmp_path / "dflop-train-out" / "metrics.jsonl"
    assert f"one JSON line per step in {os.path.join('dflop-train-out', 'metrics.jsonl')}" in (
        result.stdout
    )
    assert [json.loads(line)["step"] for line in default.read_text().splitlines()] == [1, 2]

    out = tmp_path / "out"
    logs = ("--output-dir", str(out), "--log", "tensorboard,wandb", "--wandb-mode", "offline")
    result = run_cli(*train, "--steps", "3", *logs, cwd=str(tmp_path), env={"WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for name in ("loss", "step_time_s", "tokens_per_s", "tflops_per_s"):
        logged = [(e.step, e.value) for e in events.Scalars(f"blind/{name}")]
        assert logged == [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in rows], name
    assert "blind/mfu" not in events.Tags()["scalars"]  # no peak known on CPU: not invented
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb")), "no offline W&B run"


def test_an_unknown_logger_is_one_line_before_any_process():
    result = run_cli("train", "--log", "tensorbord", "--steps", "1")
    assert result.returncode == 2
    assert "unknown logger 'tensorbord' (did you mean 'tensorboard'?)" in result.stderr
    assert "Traceback" not in result.stderr


def test_deterministic_runs_and_resumes_give_identical_losses(tmp_path):
    """--deterministic, planned and scheduled by dflop (no --layout, no --perf): two runs
    and a run resumed half-way give bit-identical losses (the default mode's schedules
    follow measured times, so its losses differ in the last digits between runs)."""

    def losses(name: str, *extra: str) -> dict[int, float]:
        metrics = tmp_path / f"{name}.json"
        args = ["train", "--deterministic", "--nproc", "2", "--global-batch", "16", "--quiet"]
        result = run_cli(*args, "--json", str(metrics), *extra)
        assert result.returncode == 0, result.stderr
        assert "profiling" not in result.stdout  # no timing
        return _losses(json.loads(metrics.read_text()))

    first = losses("a", "--steps", "6")
    assert losses("b", "--steps", "6") == first
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    resumed = {**losses("c", "--steps", "3", *ckpt), **losses("d", "--steps", "6", *ckpt)}
    assert resumed == first


# ---- one run per checkpoint folder ---------------------------------------------------------


def test_a_second_run_on_a_held_checkpoint_folder_exits_2_naming_the_first(tmp_path):
    """Two runs on one --checkpoint-dir: the second is refused at once, in one line naming
    the first's process and host; the first trains on, unharmed, and releases the folder."""
    import signal
    import socket

    ckpt = tmp_path / "ckpt"
    first = _start_long_run(tmp_path, ckpt)
    try:
        second = run_cli("train", "--layout", LAYOUT, "--steps", "2", "--checkpoint-dir", str(ckpt))
        assert second.returncode == 2, second.stdout + second.stderr
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert f"is in use by another run: process {first.pid} on host" in second.stderr
        assert socket.gethostname() in second.stderr
        assert "resumed" not in second.stdout
        assert first.poll() is None  # still training
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 143, err
    assert not (ckpt / "dflop.lock").exists()  # released on exit
    third, _ = _train(tmp_path, "--steps", "1", "--checkpoint-dir", str(ckpt))
    assert third.returncode == 0, third.stderr  # the folder is free again


def test_a_lock_left_by_a_killed_run_is_reported_and_taken_over(tmp_path):
    """SIGKILL leaves the lock file (no handler runs): the next run says whose it was and
    that it no longer runs, removes the dead run's temporary files, and resumes."""
    ckpt = tmp_path / "ckpt"
    proc = _start_long_run(tmp_path, ckpt)
    proc.kill()
    proc.communicate(timeout=30)
    assert (ckpt / "dflop.lock").exists()
    with open(ckpt / "metrics.jsonl", "a") as f:
        f.write('{"step": 99999, "loss": 0.5, "idle_s": 0.08')  # a write cut by the kill
    leftover = ckpt / _settled(ckpt) / "rank-00000.pt.tmp-999999"
    leftover.write_bytes(b"half a checkpoint")
    theirs = _users_files(ckpt)
    latest = int((ckpt / "latest").read_text().split("-")[1])  # steps done
    result, report = _train(tmp_path, "--steps", str(latest + 2), "--checkpoint-dir", str(ckpt))
    assert result.returncode == 0, result.stderr
    assert f"was left by process {proc.pid} on host" in result.stdout
    assert "no longer running; taking the folder over" in result.stdout
    assert "removed 1 temporary file(s)" in result.stdout and not leftover.exists()
    assert all(p.read_bytes() == b"theirs" for p in theirs)  # only the dead run's own
    # metrics.jsonl: the killed run's steps after the checkpoint are cut (with the line
    # it left unfinished), so every step appears once, whole, with its run's id.
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, latest + 3))
    assert len({r["run_id"] for r in rows[latest:]}) == 1 and all(r["time"] for r in rows)
    assert "metrics: " in result.stdout and "where this run resumes" in result.stdout
    assert sorted(_losses(report)) == [latest, latest + 1]  # 0-based step indices


def test_a_lock_from_another_host_is_refused(tmp_path):
    """A lock file written on another host (a shared file system) cannot be checked from
    here: refused, naming that host and the file to delete once that run is gone."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    record = {"pid": 4242, "host": "node-17", "started": "2026-01-01 00:00:00"}
    (ckpt / "dflop.lock").write_text(json.dumps(record))
    result = run_cli("train", "--layout", LAYOUT, "--steps", "1", "--checkpoint-dir", str(ckpt))
    assert result.returncode == 2, result.stderr
    assert "process 4242 on host node-17" in result.stderr
    assert f"delete {str(ckpt / 'dflop.lock')!r}" in result.stderr


# ---- a resumed run's settings: honoured or refused by name ---------------------------------


def test_a_changed_learning_rate_is_honoured_on_resume(tmp_path, trained_checkpoints):
    """--lr on a resume applies from the first resumed step (it used to be the saved
    optimizer's): said in one line, the losses after it differ, the saved state has it."""
    ckpt = _checkpointed(tmp_path, trained_checkpoints, steps=2)
    same_dir, other_dir = tmp_path / "same", tmp_path / "other"
    import shutil

    shutil.copytree(ckpt, same_dir)
    shutil.copytree(ckpt, other_dir)
    same, same_report = _train(tmp_path, "--steps", "4", "--checkpoint-dir", str(same_dir))
    other, other_report = _train(
        tmp_path, "--steps", "4", "--checkpoint-dir", str(other_dir), "--lr", "3e-2"
    )
    assert same.returncode == 0 and other.returncode == 0, same.stderr + other.stderr
    assert "resuming with lr=0.03 instead of the checkpoint's 0.001" in other.stdout
    assert "resuming with" not in same.stdout
    same_losses, other_losses = _losses(same_report), _losses(other_report)
    assert same_losses[2] == other_losses[2]  # step 2's loss is before its update
    assert same_losses[3] != other_losses[3]
    saved = torch.load(other_dir / "step-000004" / "rank-00000.pt", weights_only=True)
    assert {g["lr"] for g in saved["optimizer"]["param_groups"]} == {3e-2}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seed", "3"], "seed=3, the checkpoint's 0"),
        (["--trainable", "frozen-vision"], "trainable='frozen-vision', the checkpoint's 'full'"),
        (
            ["--scaler", '{"max_text_tokens": 64}'],
            "scaler={'max_text_tokens': 64}, the checkpoint's {}",
        ),
        (["--global-batch", "16"], "with global_batch=16: its layout has global_batch=8"),
        (
            ["--layout", "enc_dp=1,enc_pp=1,llm_dp=1,llm_pp=1,m=4"],
            "num_microbatches 4 vs the checkpoint's 2",
        ),
    ],
)
def test_a_resume_refuses_a_changed_setting_by_name(tmp_path, args, message, trained_checkpoints):
    """A setting that changes what the checkpoint means: one line, exit 2, before any
    rank starts; the checkpoint is untouched."""
    ckpt = _checkpointed(tmp_path, trained_checkpoints, steps=2)
    before = (ckpt / "latest").read_text()
    extra = [] if "--layout" in args else ["--layout", LAYOUT]
    command = ["train", "--scheduler", "blind", "--global-batch", "8", *extra, *args]
    result = run_cli(*command, "--steps", "4", "--checkpoint-dir", str(ckpt))
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "resumed" not in result.stdout
    assert (ckpt / "latest").read_text() == before


def test_every_setting_is_classified_for_resume():
    """A new TrainConfig field must say what a resume does with it."""
    import dataclasses

    from dflop.train import TrainConfig
    from dflop.train.resume import HONOURED, LAYOUT_FIELDS, MUST_MATCH

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    classified = [*MUST_MATCH, *LAYOUT_FIELDS, *HONOURED]
    assert len(classified) == len(set(classified))
    assert set(classified) - {"allow_outside_paths"} == fields - {"allow_outside_paths"}


# ---- a full disk is named, and leaves no partial file --------------------------------------


def _on_small_disk(folder: Path, size: str, script: str, timeout_s: float = 300):
    """Run ``script`` (sh) with a ``size`` tmpfs mounted on ``folder``, in a private mount
    namespace (no root needed where user namespaces are allowed; skipped elsewhere)."""
    import shutil
    import subprocess

    unshare = shutil.which("unshare")
    probe = [unshare, "--user", "--map-root-user", "--mount", "true"] if unshare else None
    if probe is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("needs unshare with user namespaces to mount a small disk")
    folder.mkdir()
    body = f"mount -t tmpfs -o size={size} tmpfs {folder} || exit 99; {script}"
    return subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", body],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _dflop() -> str:
    import shlex
    import shutil
    import sys

    executable = shutil.which("dflop")
    return shlex.quote(executable) if executable else f"{shlex.quote(sys.executable)} -m dflop.cli"


def test_a_full_checkpoint_disk_is_named_and_leaves_no_temporary_file(tmp_path):
    disk = tmp_path / "disk"
    train = f"{_dflop()} train --scheduler blind --layout {LAYOUT} --global-batch 8 --quiet"
    result = _on_small_disk(
        disk,
        "1m",  # the first step's files do not fit (rank 1's is 1.7 MB)
        f"{train} --steps 2 --checkpoint-dir {disk}/ckpt; rc=$?; "
        f"echo FILES; find {disk} -type f; exit $rc",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "WriteError: could not write" in result.stderr
    assert "the disk is full" in result.stderr
    assert "enforce fail" not in result.stderr and "Traceback" not in result.stderr
    files = result.stdout.split("FILES", 1)[1].split()
    assert not [f for f in files if ".tmp" in f or f.endswith("dflop.lock")], files


def test_full_disk_outputs_are_one_line_and_no_empty_file(tmp_path):
    """--trace and --json on a full disk: one line naming the file and the full disk,
    exit 1, no empty or partial file (they used to be a traceback and a 0-byte file)."""
    disk = tmp_path / "disk"
    train = f"{_dflop()} train --scheduler blind --layout {LAYOUT} --global-batch 8 --quiet"
    result = _on_small_disk(
        disk,
        "64k",
        f"head -c 1000000 /dev/zero > {disk}/filler 2>/dev/null; "
        f"{train} --steps 2 --json {disk}/m.json --trace {disk}/t.json; rc=$?; "
        f"echo FILES; find {disk} -type f; exit $rc",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()
    assert len(last) == 1, result.stderr
    assert f"could not write {str(disk / 't.json')!r}: the disk is full" in last[0]
    assert result.stdout.split("FILES", 1)[1].split() == [str(disk / "filler")]


def test_a_resume_on_a_dataset_that_changed_is_refused_unless_asked(tmp_path):
    """A checkpoint records its dataset's records (count and content hash, in order): the
    same JSON shuffled under the same path makes the resume exit 2 naming the file, before
    any process starts; --resume-on-changed-data resumes on it and says what that means."""
    mini = DATA_DIR / "llava_mini"
    records = json.loads((mini / "llava_mini.json").read_text())
    data = tmp_path / "data.json"
    data.write_text(json.dumps(records))
    ckpt = tmp_path / "ckpt"
    dataset = ("--data", str(data), "--image-folder", str(mini / "images"),
               "--video-folder", str(mini / "videos"), "--checkpoint-dir", str(ckpt))  # fmt: skip
    result, _ = _train(tmp_path, "--steps", "2", *dataset)
    assert result.returncode == 0, result.stderr
    settings = json.loads((ckpt / "step-000002" / "settings.json").read_text())
    assert settings["data"]["records"] == 19  # the usable ones (docs: 28 read, 9 skipped)
    data.write_text(json.dumps(records[::-1]))  # the same records, another order
    refused, _ = _train(tmp_path, "--steps", "3", *dataset)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    message = refused.stderr.strip()
    assert len(message.splitlines()) == 1 and f"the dataset {data} changed" in message
    assert "the same number of usable records (19), other contents or order" in message
    assert "--resume-on-changed-data" in message and "processes on cpu" not in refused.stdout
    resumed, report = _train(tmp_path, "--steps", "3", *dataset, "--resume-on-changed-data")
    assert resumed.returncode == 0, resumed.stderr
    assert f"note: {data} changed since the checkpoint" in resumed.stdout
    assert [s["step"] for s in report["steps"]] == [2]


def test_a_failing_metrics_file_never_stops_the_training(tmp_path):
    """metrics.jsonl on a full disk (/dev/full: every write fails with ENOSPC): one
    warning naming the file, and the run trains to the end and checkpoints."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    ckpt = tmp_path / "ckpt"
    result, report = _train(
        tmp_path, "--steps", "2", "--checkpoint-dir", str(ckpt), "--metrics-jsonl", "/dev/full"
    )
    assert result.returncode == 0, result.stderr
    assert "warning: metrics: writing /dev/full failed" in result.stdout
    assert "the run goes on without it" in result.stdout
    assert [s["step"] for s in report["steps"]] == [0, 1]
    assert (ckpt / "latest").read_text().strip() == "step-000002"


def test_a_fresh_run_keeps_an_earlier_runs_metrics_and_two_runs_never_share_a_file(tmp_path):
    """A new run finding metrics.jsonl of an earlier one keeps it under another name and
    starts its own; a run whose file another run holds writes a file of its own."""
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    earlier = '{"step": 1, "loss": 1.0}\n'
    (out / "metrics.jsonl").write_text(earlier)
    result, _ = _train(tmp_path, "--steps", "1", "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    kept = list(out.glob("metrics.before-*.jsonl"))
    assert len(kept) == 1 and kept[0].read_text() == earlier
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["run_id"]
    with open(out / "metrics.jsonl") as held:  # another run writing it now
        fcntl.flock(held, fcntl.LOCK_EX)
        result, _ = _train(tmp_path, "--steps", "1", "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    assert "is being written by another run; this run writes" in result.stdout
    own = [p for p in out.glob("metrics.*.jsonl") if not p.name.startswith("metrics.before")]
    assert len(own) == 1 and json.loads(own[0].read_text())["step"] == 1
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]


def test_wandb_online_without_a_key_or_a_server_is_refused_before_any_process(tmp_path):
    """W&B online mode without an API key, or with one and no reachable server: exit 2 in
    one line before profiling or any process, naming --wandb-mode offline."""
    pytest.importorskip("wandb")
    train = ("train", "--log", "wandb", "--wandb-mode", "online", "--steps", "1")
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": "", "WANDB_MODE": ""}
    result = run_cli(*train, env=env, timeout_s=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs an API key" in result.stderr and "--wandb-mode offline" in result.stderr
    env = {**env, "WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9"}
    result = run_cli(*train, env=env, timeout_s=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot reach the W&B server 127.0.0.1:9" in result.stderr
    assert "--wandb-mode offline" in result.stderr and "profiling" not in result.stdout


@pytest.mark.parametrize(
    "text, says",
    [
        ('{"layout": {"encoder"', "line 1 column"),
        ('{"layout": {}, "forward_fraction": [NaN, 0.5]}', ""),
    ],
    ids=["truncated", "nan_share"],
)
def test_a_damaged_run_file_is_named_before_any_process(tmp_path, text, says):
    """run.json (the layout and cost model a resumed run reuses), truncated or holding a
    NaN share: one line naming the file, exit 2, before any process starts."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "run.json").write_text(text)
    result = run_cli("train", "--steps", "1", "--checkpoint-dir", str(ckpt), timeout_s=60)
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1 and f"{ckpt / 'run.json'}" in message
    assert "cannot be read" in message and says in message
    assert "processes on cpu" not in result.stdout


def test_a_hung_rank_ends_the_run_in_a_few_lines_without_a_traceback(tmp_path):
    """A rank that stops responding (injected: it sleeps at step 1) is found by its peers'
    collective timeout: the run ends with exit 1, saying what happened, no traceback."""
    result, _ = _train(
        tmp_path, "--steps", "3", "--timeout-s", "5", env={"DFLOP_FAULT_INJECT": "1:1:hang"}
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "for a peer rank that stopped responding" in result.stderr
    assert "(the collective timeout, --timeout-s)" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 3
