"""``dflop train``, the full demo and the DDP example, as real subprocesses with timeouts.

Each run spawns real gloo processes; every subprocess has a timeout, so a hang fails the
test instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_harness import TIMEOUT_S, run_cli
from conftest import DATA_DIR, REPO_DIR

pytest.importorskip("torch")

from dflop.runtime import RuntimeLayout  # noqa: E402
from dflop.train import TrainConfig  # noqa: E402
from dflop.train.planning import LOCAL_PLAN_BATCHES, core_layout, parse_layout  # noqa: E402

REPO = REPO_DIR
LAYOUT = "enc_dp=1,enc_pp=1,llm_dp=1,llm_pp=1,m=2"


def _train(tmp_path: Path, perf: str, *extra: str, env: dict | None = None):
    metrics = tmp_path / f"metrics-{len(list(tmp_path.iterdir()))}.json"
    perf_args = ["--perf", perf] if perf else []
    args = ["train", *perf_args, "--global-batch", "8", "--json", str(metrics), *extra]
    result = run_cli(*args, env=env)
    report = json.loads(metrics.read_text()) if metrics.exists() else None
    return result, report


def test_train_end_to_end_writes_trace_and_png(tmp_path, perf_json) -> None:
    """Planned for 2 local processes (--placement disaggregated: an encoder stage and an
    LLM stage), 3 steps."""
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    result, report = _train(
        tmp_path,
        perf_json,
        "--nproc", "2", "--num-microbatches", "2", "--steps", "3",
        "--trace", str(trace), "--png", str(png), "--placement", "disaggregated",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "planned for 2 local processes: enc 1 processes" in result.stdout
    assert "step    3/3 [dflop]" in result.stdout and "samples/s" in result.stdout
    assert png.stat().st_size > 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"][0] for e in events if e.get("ph") == "X"} == {"F", "B"}
    assert {e["tid"] for e in events if e.get("ph") == "X"} == {0, 1}  # tid = global stage
    assert len(report["steps"]) == 3
    assert all(0 <= s["idle_share"] < 1 for s in report["steps"])


def test_train_on_a_real_format_dataset(tmp_path, perf_json) -> None:
    """A LLaVA-style recipe: images, frames and text are loaded from the files."""
    recipe = DATA_DIR / "llava_mini" / "recipe.yaml"
    result, report = _train(
        tmp_path,
        perf_json,
        "--nproc", "2", "--num-microbatches", "2", "--steps", "2",
        "--data", str(recipe), "--layout", "enc_dp=1,llm_pp=1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(report["steps"]) == 2
    assert all(np.isfinite(s["loss"]) for s in report["steps"])


def test_a_dataset_json_with_image_folders_is_used_whole_and_skips_are_reported(
    tmp_path, perf_json
) -> None:
    """llava_mini.json keeps its files in images/ and videos/: without the folders almost
    every sample is skipped (said, with the fix); with them, the encoder gets work."""
    data = DATA_DIR / "llava_mini"
    common = ["--nproc", "2", "--steps", "2", "--layout", "enc_dp=1,m=2", "--quiet"]
    result, _ = _train(tmp_path, perf_json, *common, "--data", str(data / "llava_mini.json"))
    assert result.returncode == 0, result.stderr
    assert "read 28, usable 2 (0 with images or video), skipped 26" in result.stdout
    assert "missing_image: 19" in result.stdout and "--image-folder" in result.stdout
    assert "warning: most of the dataset is unusable" in result.stdout
    result, report = _train(
        tmp_path,
        perf_json,
        *common,
        "--data", str(data / "llava_mini.json"),
        "--image-folder", str(data / "images"),
        "--video-folder", str(data / "videos"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "usable 19 (17 with images or video)" in result.stdout
    assert "warning" not in result.stdout
    assert report["summary"]["dflop"]["busy_share"][0] > 0.05  # the encoder computes


def test_local_plan_forced_layout_calibrated_then_trained(tmp_path, perf_json) -> None:
    """dflop plan --local scores a forced layout (encoder dp 2) after a calibration run;
    dflop train --plan uses its layout, cost model and cluster, and compares."""
    plan_path = tmp_path / "plan.json"
    result = run_cli(
        "plan", "--local", "3", "--layout", "enc_dp=2,m=4", "--global-batch", "8",
        "--perf", perf_json, "--calibrate-steps", "3", "-o", str(plan_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "calibrating: 3 steps" in result.stderr
    assert "calibrated on steps of" in result.stderr and "per-transfer latency" in result.stderr
    from dflop.planner import Plan

    plan = Plan.load(plan_path)
    best = plan.best
    assert (best.encoder.dp, best.llm.dp, best.num_microbatches) == (2, 1, 4)
    assert plan.inputs["local"] and plan.inputs["performance_model"]
    assert plan.cluster.link_latency_s != 1e-4  # calibrated
    assert len(plan.inputs["forward_fraction"]) == 2  # the trainer starts from them
    assert len(best.steps) == LOCAL_PLAN_BATCHES
    assert any(s.pieces["replica"].max() == 1 for s in best.steps)
    result, report = _train(tmp_path, "", "--plan", str(plan_path), "--steps", "3", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "profiling" not in result.stdout  # the plan's performance model is reused
    assert f"the plan's mean over its batches: {best.prediction.step_time_s:.3f} s" in (
        result.stdout
    )
    assert "plan vs measured (dflop): the plan's model predicted" in result.stdout
    # A plan for another model preset is refused.
    bad = run_cli("train", "--plan", str(plan_path), "--preset", "small", "--steps", "1")
    assert bad.returncode == 2 and "--model tiny" in bad.stderr


def test_a_local_plan_predicts_the_steps_the_run_trains(tmp_path, perf_json) -> None:
    """One world: a local plan is scored on the run's own first steps (real-format data,
    encoder dp 2), and a deterministic run of that plan schedules and predicts each of
    those steps exactly as the plan did: the trainer's per-step prediction (its scheduler's
    schedule, the runtime's encoder split, its predictor) equals the plan's record of the
    same step."""
    data = DATA_DIR / "llava_mini"
    dataset = [
        "--data", str(data / "llava_mini.json"),
        "--image-folder", str(data / "images"), "--video-folder", str(data / "videos"),
    ]  # fmt: skip
    plan_path = tmp_path / "plan.json"
    result = run_cli(
        "plan", "--local", "3", "--layout", "enc_dp=2,m=4", "--global-batch", "8",
        "--perf", perf_json, "-o", str(plan_path), *dataset,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    from dflop.planner import Plan

    planned = [s.step_time_s for s in Plan.load(plan_path).best.steps]
    assert len(planned) == LOCAL_PLAN_BATCHES and len(set(planned)) > 1
    # The plan carries its data: the command 'dflop plan' suggests trains on it.
    assert f"train it with: dflop train --plan {plan_path}\n" in result.stdout
    result, report = _train(
        tmp_path, "", "--plan", str(plan_path), "--steps", "4", "--deterministic", "--quiet"
    )
    assert result.returncode == 0, result.stderr
    assert f"training what {plan_path} was planned for: --data {dataset[1]}" in result.stdout
    assert "note:" not in result.stdout + result.stderr
    steps = [s for s in report["steps"] if s["mode"] == "dflop"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    for s in steps:
        assert s["predicted_step_time_s"] == pytest.approx(planned[s["step"]], rel=1e-9)
        assert s["plan_model_step_time_s"] == pytest.approx(planned[s["step"]], rel=1e-9)
    summary = report["summary"]["dflop"]
    assert summary["plan_model_step_time_s"] == pytest.approx(np.mean(planned[1:4]), rel=1e-9)


# The second layout shards both modules over 2 tensor-parallel ranks (DTensor parameters
# and AdamW state in the checkpoint).
@pytest.mark.parametrize("layout", [LAYOUT, "enc_tp=2,llm_tp=2,m=2", "colocated,llm_dp=2,m=2"])
def test_checkpoint_resume_matches_uninterrupted_run(tmp_path, perf_json, layout) -> None:
    common = ["--layout", layout, "--steps", "4", "--quiet"]
    result, full = _train(tmp_path, perf_json, *common)
    assert result.returncode == 0, result.stderr
    ckpt = tmp_path / "ckpt"
    result, _ = _train(
        tmp_path, perf_json, "--layout", layout, "--steps", "2", "--quiet",
        "--checkpoint-dir", str(ckpt),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (ckpt / "latest").read_text().strip() == "step-000002"
    # A resume may turn activation recompute on (memory for time, the same math): the
    # colocated run resumes with the LLM's and its encoder's blocks recomputed.
    again = [layout + ",llm_rc" if layout.startswith("colocated") else layout, *common[2:]]
    result, resumed = _train(tmp_path, perf_json, "--layout", *again, "--checkpoint-dir", str(ckpt))
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    assert ("dp=2 rc (rc: activation recompute)" in result.stdout) == ("rc" in again[0])
    assert [s["step"] for s in resumed["steps"]] == [2, 3]
    for got, want in zip(resumed["steps"], full["steps"][2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_gradient_norm_and_clipping_do_not_depend_on_the_layout(tmp_path, perf_json) -> None:
    # Same weights and batches: the global gradient norm (each parameter counted once over
    # encoder replicas, LLM stages and TP shards) must be the layout's invariant, and so
    # must the loss after a clipped update (a limit far below the norm forces clipping).
    runs = {}
    for layout in (LAYOUT, "enc_dp=2,llm_pp=2,m=2", "enc_tp=2,llm_tp=2,m=2"):
        result, report = _train(
            tmp_path, perf_json, "--layout", layout, "--steps", "2", "--quiet",
            "--grad-clip", "0.05",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        runs[layout] = report["steps"]
    reference = runs[LAYOUT]
    assert reference[0]["grad_norm"] > 0.05  # so the first update was clipped
    for steps in runs.values():
        for got, want in zip(steps, reference):
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_interleaved_pipeline_trains_like_the_plain_one(tmp_path) -> None:
    # The same 4-layer LLM over 2 stages, plain 1F1B and interleaved (2 chunks per stage,
    # the last stage's chunk 0 feeding the first stage's chunk 1): the same weights and
    # batches give the same gradient norms and losses (deterministic mode: fixed costs).
    runs = {}
    for layout in ("llm_pp=2,m=4", "llm_pp=2,llm_v=2,m=4"):
        result, report = _train(
            tmp_path, "", "--model", "small", "--deterministic", "--layout", layout,
            "--steps", "2", "--quiet", "--grad-clip", "0.05",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        runs[layout] = report["steps"]
    assert "interleaved-1f1b" in result.stdout
    plain, interleaved = runs.values()
    for got, want in zip(interleaved, plain):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_zero_bubble_trains_like_1f1b(tmp_path) -> None:
    # --pipeline-order zb-h1 splits every backward into I and W on every rank: the same
    # weights and batches give 1F1B's gradient norms and losses, over 3 steps (no message
    # of one step left for the next); the scheduler simulates the order it runs.
    runs = {}
    for order in ("1f1b", "zb-h1"):
        result, report = _train(
            tmp_path, "", "--model", "small", "--deterministic", "--layout", "llm_pp=2,m=4",
            "--pipeline-order", order, "--steps", "3", "--quiet", "--grad-clip", "0.05",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert f"pipeline {order}" in result.stdout
        runs[order] = report["steps"]
        assert all(s["predicted_step_time_s"] > 0 for s in report["steps"])
    for got, want in zip(runs["zb-h1"], runs["1f1b"]):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    # An order the layout cannot run is refused in one line, naming the flag.
    result, _ = _train(
        tmp_path, "", "--model", "small", "--layout", "llm_pp=2,llm_v=2", "--steps", "1",
        "--pipeline-order", "zb-h1",
    )  # fmt: skip
    assert result.returncode == 2
    assert "--pipeline-order zb-h1: RuntimeLayout.order='zb-h1': shape.chunks[1]=2: zb-h1 " in (
        result.stderr
    )


def test_colocated_layout_trains_like_the_disaggregated_one(tmp_path) -> None:
    # The encoder inside the first LLM stage (its gradients by the stage's own autograd,
    # summed over the LLM's replicas) or on a rank of its own (over the bridge): the same
    # weights and batches give the same gradient norms and losses; a tensor-parallel
    # colocated stage shards the encoder over the LLM's TP group.
    runs = {}
    for layout in ("llm_pp=2,m=4", "colocated,llm_pp=2,m=4", "colocated,llm_dp=2,llm_tp=2,m=2"):
        result, report = _train(
            tmp_path, "", "--model", "small", "--deterministic", "--layout", layout,
            "--steps", "2", "--quiet", "--grad-clip", "0.05",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        runs[layout] = report["steps"]
        assert all(s["predicted_step_time_s"] > 0 for s in report["steps"])
    assert "encoder colocated in the first LLM stage" in result.stdout
    reference, *colocated = runs.values()
    for steps in colocated:
        for got, want in zip(steps, reference):
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_a_colocated_local_plan_is_trained_as_planned(tmp_path, perf_json) -> None:
    """dflop plan --local --placement colocated plans the encoder inside the first LLM
    stage; dflop train --plan runs that layout and compares with the plan; the
    disaggregated placement keeps the encoder on ranks of its own."""
    from dflop.planner import Plan

    plans = {}
    for placement in ("colocated", "disaggregated"):
        plans[placement] = tmp_path / f"{placement}.json"
        result = run_cli(
            "plan", "--local", "2", "--placement", placement, "--global-batch", "8",
            "--perf", perf_json, "--calibrate-steps", "0", "-o", str(plans[placement]),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    best = Plan.load(plans["colocated"]).best
    assert best.colocated and best.llm.num_gpus == 2
    assert not Plan.load(plans["disaggregated"]).best.colocated
    result, report = _train(
        tmp_path, "", "--plan", str(plans["colocated"]), "--steps", "3", "--deterministic",
        "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "encoder colocated in the first LLM stage" in result.stdout
    planned = [s.step_time_s for s in best.steps]
    for s in report["steps"]:  # the trainer schedules and predicts each step as planned
        assert s["plan_model_step_time_s"] == pytest.approx(planned[s["step"]], rel=1e-9)


def test_max_growth_bounds_the_refined_schedule(tmp_path, perf_json) -> None:
    # Steps 0 and 1 are scheduled before any measurement, from the same costs in every run:
    # the refinement may grow microbatches past the balanced makespan only as far as
    # --max-growth lets it (the ratio is makespan / the same lower bound).
    ratios = {}
    for name, extra in (
        ("balanced", ["--no-pipeline-schedule"]),
        ("growth 1.0", ["--max-growth", "1.0"]),
        ("growth 1.5", ["--max-growth", "1.5"]),
    ):
        result, report = _train(
            tmp_path, perf_json, "--layout", "enc_dp=1,llm_pp=1,m=4", "--steps", "2", "--quiet",
            *extra,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        ratios[name] = [s["schedule_ratio"] for s in report["steps"]]
    for balanced, tight, loose in zip(
        ratios["balanced"], ratios["growth 1.0"], ratios["growth 1.5"]
    ):
        assert tight <= balanced * (1 + 1e-9)
        assert loose <= 1.5 * balanced * (1 + 1e-9)


def test_failing_rank_exits_nonzero_with_a_clear_message(tmp_path, perf_json) -> None:
    result, _ = _train(
        tmp_path, perf_json, "--layout", LAYOUT, "--steps", "3", "--timeout", "30",
        env={"DFLOP_FAULT_INJECT": "1:1"},
    )  # fmt: skip
    assert result.returncode == 1
    assert "rank 1 of 2 failed" in result.stderr
    assert "injected failure on rank 1 at step 1" in result.stderr


def test_threads_train_like_processes_and_share_checkpoints(tmp_path) -> None:
    # Ranks as threads of one process (how ranks that share one GPU run): the same weights,
    # batches and plans (deterministic mode) give the same losses and gradient norms as
    # gloo processes, and a checkpoint the threads wrote resumes under processes.
    layout = "enc_dp=2,llm_pp=2,m=2"
    common = ["--deterministic", "--layout", layout, "--quiet", "--grad-clip", "0.05"]
    result, processes = _train(tmp_path, "", *common, "--steps", "4", "--launch", "processes")
    assert result.returncode == 0, result.stderr
    ckpt = tmp_path / "ckpt"
    result, threads = _train(
        tmp_path, "", *common, "--steps", "2", "--launch", "threads",
        "--checkpoint-dir", str(ckpt),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "4 threads on cpu" in result.stdout
    result, resumed = _train(
        tmp_path, "", *common, "--steps", "4", "--launch", "processes",
        "--checkpoint-dir", str(ckpt),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    assert [len(threads["steps"]), len(resumed["steps"]), len(processes["steps"])] == [2, 2, 4]
    for got, want in zip(threads["steps"] + resumed["steps"], processes["steps"]):
        assert got["step"] == want["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


def test_profile_trace_is_written_and_measured(tmp_path) -> None:
    # One trace for a thread world (the profiler sees the whole process), one per rank
    # for processes; on CPU there are no GPU transfers to measure, and the report says so.
    # The memory report reads the same traces (a profiler exports once).
    for launch, files in (
        ("threads", ["run.json"]),
        ("processes", ["run.rank0.json", "run.rank1.json"]),
    ):
        folder = tmp_path / launch
        result, report = _train(
            tmp_path, "", "--deterministic", "--layout", LAYOUT, "--steps", "2", "--launch",
            launch, "--profile-trace", str(folder / "run.json"), "--memory-report",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in folder.iterdir()) == files
        assert [Path(path).name for path, _ in report["transfer_overlap"]] == files
        for path, numbers in report["transfer_overlap"]:
            assert numbers["num_transfers"] == 0 and numbers["num_kernels"] == 0
            assert any(
                e.get("cat") == "cpu_op" for e in json.loads(Path(path).read_text())["traceEvents"]
            )
        assert "the trace holds no GPU work (a CPU run)" in result.stdout
        assert len(report["memory"]) == (1 if launch == "threads" else 2)
        assert all(row["measured_bytes"] > 0 for row in report["memory"])


def test_threads_failing_rank_and_refused_layouts(tmp_path) -> None:
    result, _ = _train(
        tmp_path, "", "--deterministic", "--layout", LAYOUT, "--steps", "3", "--timeout", "30",
        "--launch", "threads", env={"DFLOP_FAULT_INJECT": "1:1"},
    )  # fmt: skip
    assert result.returncode == 1
    assert "rank 1 of 2 failed" in result.stderr
    assert "injected failure on rank 1 at step 1" in result.stderr
    result, _ = _train(
        tmp_path, "", "--deterministic", "--layout", "enc_tp=2,llm_tp=2,m=2", "--launch", "threads"
    )
    assert result.returncode != 0
    assert "launch='threads' runs tp=1 layouts only" in result.stderr


def test_full_demo_runs(tmp_path) -> None:
    out = tmp_path / "demo"
    result = run_cli(
        "demo", "--steps", "3", "--global-batch", "8", "--num-microbatches", "2",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dflop vs data-blind on the same steps" in result.stdout
    # The paired verdict after the 2 warm-up steps, and the figure of its median step.
    assert "dflop vs data-blind over 1 paired steps (same weights and batch)" in result.stdout
    assert "dflop-vs-blind.png: step 3 (the median one)" in result.stdout
    for name in ("perf.json", "plan.json", "summary.json", "dflop-vs-blind.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["summary"]) == {"dflop", "blind"}
    assert summary["paired_steps"]["steps"] == [3]


@pytest.mark.parametrize("wrapper", [[], ["--fsdp"]], ids=["ddp", "fsdp2"])
def test_ddp_example_runs(wrapper) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "ddp_balance.py"), "--steps", "2",
         "--global-batch", "16", *wrapper],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "step 1:" in result.stdout and "equal split" in result.stdout
    assert "find_unused_parameters" not in result.stderr  # no per-step graph walk


# ---------------------------------------------------------------- no processes


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="TrainConfig.steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="TrainConfig.scheduler"):
        TrainConfig(scheduler="fast")
    with pytest.raises(ValueError, match="TrainConfig.scaler has unknown field 'cap'"):
        TrainConfig(scaler={"cap": 3})
    with pytest.raises(FileNotFoundError, match="TrainConfig.data"):
        TrainConfig(data="/nonexistent.json")
    with pytest.raises(ValueError, match="TrainConfig.max_growth=0.9 must be a number >= 1"):
        TrainConfig(max_growth=0.9)
    with pytest.raises(ValueError, match="TrainConfig.grad_clip_norm=0 must be None or"):
        TrainConfig(grad_clip_norm=0)


def test_parse_layout() -> None:
    from dflop.models import model_config

    layout = parse_layout("enc_dp=2,llm_pp=2,m=3", model_config("tiny"), 12)
    assert (layout.encoder.dp, layout.llm.pp, layout.num_microbatches) == (2, 2, 3)
    assert layout.world_size == 4
    with pytest.raises(ValueError, match="enc_dpp"):
        parse_layout("enc_dpp=2", model_config("tiny"), 12)
    interleaved = parse_layout("llm_pp=2,llm_v=2", model_config("small"), 12)
    assert (interleaved.llm.virtual_stages, interleaved.num_microbatches) == (2, 4)
    assert interleaved.pipeline_order == "interleaved-1f1b"
    with pytest.raises(ValueError, match="llm_pp x llm_v = 4 model chunks for an LLM of 2"):
        parse_layout("llm_pp=2,llm_v=2", model_config("tiny"), 12)
    with pytest.raises(ValueError, match="multiple of llm.pp=2"):
        parse_layout("llm_pp=2,llm_v=2,m=3", model_config("small"), 12)
    colocated = parse_layout("colocated,llm_dp=2,m=3", model_config("tiny"), 12)
    assert colocated.colocated and colocated.world_size == 2
    assert (colocated.encoder.tp, colocated.encoder.pp, colocated.encoder.dp) == (1, 1, 2)
    with pytest.raises(ValueError, match="enc_dp with 'colocated': a colocated encoder runs"):
        parse_layout("colocated,enc_dp=2", model_config("tiny"), 12)
    # Activation recompute per module; a colocated encoder's follows the LLM's.
    rc = parse_layout("enc_rc,llm_pp=2,llm_rc", model_config("tiny"), 12)
    assert rc.encoder.recompute and rc.llm.recompute
    assert RuntimeLayout.from_dict(rc.to_dict()) == rc
    assert core_layout(rc)["llm"]["recompute"] and core_layout(rc)["encoder"]["recompute"]
    llm_only = parse_layout("llm_rc", model_config("tiny"), 12)
    assert (llm_only.encoder.recompute, llm_only.llm.recompute) == (False, True)
    colocated_rc = parse_layout("colocated,llm_dp=2,llm_rc", model_config("tiny"), 12)
    assert colocated_rc.encoder.recompute and colocated_rc.llm.recompute
    with pytest.raises(ValueError, match="enc_rc with 'colocated'"):
        parse_layout("colocated,enc_rc", model_config("tiny"), 12)
    with pytest.raises(ValueError, match="'llm_rc=1' is not 'colocated', 'enc_rc', 'llm_rc'"):
        parse_layout("llm_rc=1", model_config("tiny"), 12)


def test_a_quick_profile_in_two_processes_measures_what_one_measures():
    """quick_profile(processes=2), as 'dflop train' profiles for 2 local processes: each
    process measures its share of the grid, and the merged profile fits as the serial one
    does: the same shapes (fit and held-out counts), as many frozen variants, identical
    memory coefficients (byte counts do not depend on timing) and activation shares."""
    from dflop.train.planning import quick_profile

    options = dict(repeats=1, max_units=4, max_tokens=256)
    serial = quick_profile("tiny", **options).to_dict()
    parallel = quick_profile("tiny", processes=2, **options).to_dict()
    assert parallel["metadata"]["processes"] == 2 and "processes" not in serial["metadata"]
    for module in ("encoder_fit", "llm_fit"):
        for count in ("num_fit_points", "num_holdout_points"):
            assert parallel[module][count] == serial[module][count]
    for module in ("vision", "decoder"):
        assert parallel["metadata"][module]["frozen"] == serial["metadata"][module]["frozen"]
    for key in ("encoder_memory", "llm_memory"):
        assert parallel[key] == pytest.approx(serial[key], rel=1e-9), key
    # A median of per-shape ratios over the frozen subset, which each process spreads over
    # its own share: other shapes, the same share within a rounding.
    assert parallel["passthrough_activation_fraction"] == pytest.approx(
        serial["passthrough_activation_fraction"], rel=1e-3
    )
    assert parallel["llm"]["per_token_s"] > 0 and parallel["encoder"]["per_unit_s"] > 0


def test_a_local_plan_trains_from_another_folder(tmp_path, perf_json):
    """The plan records its data by absolute path: made with relative paths in one folder,
    it trains from another (they used to be read relative to wherever 'train' ran)."""
    plan_path = tmp_path / "plans" / "plan.json"
    plan_path.parent.mkdir()
    result = run_cli(
        "plan", "--local", "2", "--layout", "enc_dp=1,m=2", "--global-batch", "8",
        "--perf", perf_json, "--data", "llava_mini/llava_mini.json",
        "--image-folder", "llava_mini/images", "--video-folder", "llava_mini/videos",
        "-o", str(plan_path), cwd=str(DATA_DIR),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    inputs = json.loads(plan_path.read_text())["inputs"]
    assert inputs["data"] == str(DATA_DIR / "llava_mini" / "llava_mini.json")
    result = run_cli(
        "train", "--plan", os.path.join("plans", "plan.json"), "--steps", "1", "--quiet",
        cwd=str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "usable 19" in result.stdout and "note:" not in result.stdout


def test_a_hugging_face_model_is_one_model_however_its_path_is_written(tmp_path):
    from dflop.train.planning import resolved_model

    folder = tmp_path / "tiny-ov"
    folder.mkdir()
    names = {resolved_model(f"hf:{p}", str(tmp_path)) for p in ("tiny-ov", "./tiny-ov/")}
    assert names == {f"hf:{folder}"} == {resolved_model(f"hf:{folder}")}
    assert resolved_model("tiny") == "tiny"
