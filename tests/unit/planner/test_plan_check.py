"""Plan files are checked whole at load: a bad field fails there, in one line naming the
file, the field and the rule, before any work (``dflop train --plan`` starts no process,
``dflop simulate`` simulates nothing).

The files are real: a local plan of the tiny model made as ``dflop train`` plans it
(deterministic: the analytic cost model, no timing) and a cluster plan, saved, edited
as a user (or a bug) could, and loaded from disk.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import cli_harness
import pytest
from dflop.planner import Plan
from dflop.planner.plan_check import MAX_PLAN_GLOBAL_BATCH, show
from dflop.train.planning import MAX_LOCAL_GLOBAL_BATCH, layout_from_plan

MAX_MESSAGE = 700
"""No plan error is longer than this (values are cut to ~200 characters)."""


@pytest.fixture(scope="module")
def local_plan(tmp_path_factory) -> dict[str, Any]:
    """The JSON of a local plan of the tiny model for 2 processes (global batch 16), with
    encoder ranks of its own (the rules below edit them)."""
    from dflop.train import TrainConfig
    from dflop.train.run import prepare

    config = TrainConfig(
        model="tiny",
        nproc=2,
        global_batch=16,
        deterministic=True,
        calibrate_steps=0,
        placement="disaggregated",
    )
    path = tmp_path_factory.mktemp("plans") / "local.json"
    prepare(config, log=lambda _: None).plan.save(path)
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def cluster_plan(tmp_path_factory) -> dict[str, Any]:
    """The JSON of a plan for 8 GPUs (with its colocated data-blind baseline)."""
    from dflop.data.costs import ENCODER_PRESETS, LLM_PRESETS, AnalyticCostModel
    from dflop.planner import ClusterSpec, PlannerConfig, plan

    encoder, llm = ENCODER_PRESETS["siglip-400m"], LLM_PRESETS["llm-7b"]
    result = plan(
        AnalyticCostModel(encoder, llm),
        encoder,
        llm,
        ClusterSpec(num_gpus=8),
        global_batch=64,
        config=PlannerConfig(num_batches=2, top_k=2, colocated_candidates=False),
    )
    path = tmp_path_factory.mktemp("plans") / "cluster.json"
    result.save(path)
    return json.loads(path.read_text())


def _write(directory: Path, data: Any, name: str = "plan.json") -> Path:
    path = directory / name
    path.write_text(json.dumps(data))  # NaN and inf as JSON's NaN / Infinity literals
    return path


def _edited(plan: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    data = copy.deepcopy(plan)
    edit(data)
    return data


def _error_of(path: Path) -> str:
    with pytest.raises(ValueError) as caught:
        Plan.load(path)
    message = str(caught.value)
    assert "\n" not in message, message
    assert len(message) <= MAX_MESSAGE, message[:1000]
    assert message.startswith(f"{path}: ") or message.startswith(f"{path} "), message
    return message


def _set(*keys: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


def _all_global_batches(value: int, *, drop_steps: bool) -> Callable[[dict[str, Any]], None]:
    """Every global_batch field set to ``value`` (consistently); without the recorded
    steps (whose arrays have one entry per sample) when ``drop_steps``."""

    def edit(data: dict[str, Any]) -> None:
        data["global_batch"] = value
        data["inputs"]["global_batch"] = value
        for layout in data["layouts"]:
            layout["global_batch"] = value
            if drop_steps:
                layout["steps"] = []

    return edit


# (id, edit, what the message must hold): each breaks one rule of a real local plan.
LOCAL_CASES = [
    (
        "global_batch_1e7",
        _set("global_batch", value=10**7),
        "global_batch=10000000 must equal inputs.global_batch=16",
    ),
    (
        "global_batch_1e7_everywhere",
        _all_global_batches(10**7, drop_steps=False),
        "global_batch=10000000 must equal the batch size of the recorded steps (16 samples "
        "in layouts[0].steps[0].assignment)",
    ),
    (
        "global_batch_1e18",
        _set("global_batch", value=10**18),
        "global_batch=1000000000000000000 must be in [1, 16,777,216]",
    ),
    ("global_batch_zero", _set("global_batch", value=0), "global_batch=0 must be in [1, "),
    (
        "global_batch_float",
        _set("global_batch", value=16.5),
        "global_batch=16.5 must be an integer",
    ),
    (
        "num_gpus_1e6",
        _set("cluster", "num_gpus", value=10**6),
        "cluster.num_gpus=1000000 must equal the world size of layouts[0]: 1 encoder + 1 LLM "
        "ranks = 2",
    ),
    (
        "num_gpus_1e18",
        _set("cluster", "num_gpus", value=10**18),
        "cluster.num_gpus=1000000000000000000 must be in [2, 1,048,576]",
    ),
    (
        "gpu_memory_negative",
        _set("cluster", "gpu_memory_bytes", value=-1.0),
        "cluster.gpu_memory_bytes=-1.0 must be > 0",
    ),
    (
        "num_microbatches_negative",
        _set("layouts", 0, "num_microbatches", value=-3),
        "layouts[0].num_microbatches=-3 must be in [1, 16]",
    ),
    (
        "num_microbatches_other_than_steps",
        _set("layouts", 0, "num_microbatches", value=3),
        "layouts[0].num_microbatches=3 must equal the recorded steps' microbatch count (4 in "
        "layouts[0].steps[0].microbatch_order)",
    ),
    (
        "assignment_out_of_range",
        _set("layouts", 0, "steps", 0, "assignment", 3, value=99),
        "layouts[0].steps[0].assignment[3]=99 must be in [0, ",
    ),
    (
        "assignment_negative",
        _set("layouts", 0, "steps", 2, "assignment", 0, value=-1),
        "layouts[0].steps[2].assignment[0]=-1 must be in [0, ",
    ),
    (
        "assignment_short",
        _set("layouts", 0, "steps", 0, "assignment", value=[0, 1]),
        "global_batch=16 must equal the batch size of the recorded steps (2 samples in "
        "layouts[0].steps[0].assignment)",
    ),
    (
        "layer_ranges_negative",
        _set("layouts", 0, "encoder", "layer_ranges", value=[[-5, 2]]),
        "layouts[0].encoder.layer_ranges[0]=[-5, 2] must be [0, 2]",
    ),
    (
        "layers_per_stage_other_model",
        _set("layouts", 0, "llm", "layers_per_stage", value=[5]),
        "layouts[0].llm.layers_per_stage=[5] must sum to inputs.llm.num_layers=2",
    ),
    (
        "layers_per_stage_zero",
        _set("layouts", 1, "encoder", "layers_per_stage", value=[0]),
        "layouts[1].encoder.layers_per_stage[0]=0 must be in [1, ",
    ),
    (
        "tp_string",
        _set("layouts", 0, "llm", "tp", value="1"),
        "layouts[0].llm.tp='1' must be an integer",
    ),
    (
        "dp_breaks_world",
        _set("layouts", 0, "llm", "dp", value=3),
        "cluster.num_gpus=2 must equal the world size of layouts[0]: 1 encoder + 3 LLM ranks = 4",
    ),
    (
        "first_rank_overlaps",
        _set("layouts", 0, "llm", "first_rank", value=0),
        "layouts[0].llm.first_rank=0 must be 1",
    ),
    (
        "stage_time_nan",
        _set("layouts", 0, "steps", 1, "llm_forward_s", 0, 0, 1, value=math.nan),
        "layouts[0].steps[1].llm_forward_s[0][0][1]=nan must be finite and >= 0",
    ),
    (
        "stage_time_huge",
        _set("layouts", 0, "steps", 1, "encoder_backward_s", 0, 0, 0, value=math.inf),
        "layouts[0].steps[1].encoder_backward_s[0][0][0]=inf must be finite and >= 0",
    ),
    (
        "microbatch_order_repeats",
        _set("layouts", 0, "steps", 0, "microbatch_order", value=[0, 0, 1, 2]),
        "must be a permutation of 0..",
    ),
    (
        "piece_replica_out_of_range",
        _set("layouts", 0, "steps", 0, "pieces", "replica", 0, value=5),
        "layouts[0].steps[0].pieces.replica[0]=5 must be in [0, 1)",
    ),
    (
        "step_time_infinite",
        _set("layouts", 0, "prediction", "step_time_s", value=math.inf),
        "layouts[0].prediction.step_time_s=inf must be a finite number",
    ),
    (
        "step_times_per_batch",
        _set("layouts", 0, "prediction", "step_times_s", value=[0.1]),
        "layouts[0].prediction.step_times_s=<1 step times> must hold one per sampled batch "
        "(inputs.num_batches=16)",
    ),
    (
        "unknown_layout_field",
        _set("layouts", 0, "num_microbatch", value=4),
        "layouts[0] has an unknown field 'num_microbatch'",
    ),
    (
        "performance_model_broken",
        _set("inputs", "performance_model", "format", value="nope"),
        "inputs.performance_model: not a dflop performance model",
    ),
    ("version_newer", _set("version", value=99), "plan version 99 is not supported"),
    ("no_layouts", _set("layouts", value=[]), "the plan holds no layout"),
    (
        "huge_value_is_cut",
        _set("layouts", 0, "encoder", "layer_ranges", value=list(range(10**6))),
        "layouts[0].encoder.layer_ranges=[0, 1, 2, 3,",
    ),
    (
        "huge_integer_is_cut",
        _set("global_batch", value=10**4000),
        "global_batch=1000000000",
    ),
]


@pytest.mark.parametrize(
    "edit, expected", [c[1:] for c in LOCAL_CASES], ids=[c[0] for c in LOCAL_CASES]
)
def test_a_broken_plan_fails_at_load_naming_file_field_and_rule(
    tmp_path, local_plan, edit, expected
) -> None:
    path = _write(tmp_path, _edited(local_plan, edit))
    message = _error_of(path)
    assert expected in message, message


def test_valid_plans_load(tmp_path, local_plan, cluster_plan) -> None:
    for name, data in (("local.json", local_plan), ("cluster.json", cluster_plan)):
        plan = Plan.load(_write(tmp_path, data, name))
        assert plan.to_dict() == data
    assert cluster_plan["baseline"]["colocated"]  # a colocated layout passes its own rules


def test_a_plan_file_from_before_the_rename_still_loads(tmp_path, local_plan) -> None:
    """Layouts wrote their scheduler as "schedule" before (docs/concepts.md › Glossary)."""

    def rename(data: dict[str, Any]) -> None:
        for layout in data["layouts"]:
            layout["schedule"] = layout.pop("scheduler")

    plan = Plan.load(_write(tmp_path, _edited(local_plan, rename)))
    assert plan.to_dict() == local_plan  # read as scheduler, written as scheduler
    with pytest.warns(DeprecationWarning, match="LayoutPlan.scheduler"):
        assert plan.best.schedule == plan.best.scheduler  # the old attribute


CLUSTER_CASES = [
    (
        "colocated_uses_part",
        _set("baseline", "llm", "dp", value=1),
        "baseline.llm=tp=4 x pp=1 x dp=1 = 4 GPUs must use the cluster's num_gpus=8",
    ),
    (
        "colocated_flag",
        _set("baseline", "encoder", "colocated", value=False),
        "baseline.encoder.colocated=False must equal the layout's colocated=true",
    ),
    (
        "tp_across_nodes",
        _set("cluster", "gpus_per_node", value=1),
        "must divide cluster.gpus_per_node=1",
    ),
    (
        "tp_splits_heads",
        _set("baseline", "llm", "tp", value=8),
        "baseline.llm.tp=8 must divide inputs.llm.num_heads=28",
    ),
    (
        "stage_ranks",
        _set("layouts", 0, "llm", "stage_ranks", 0, 0, value=[7, 7]),
        "layouts[0].llm.stage_ranks[0]=",
    ),
    (
        "huge_hidden",
        _set("inputs", "llm", "hidden_size", value=1 << 20),
        "inputs.llm.hidden_size=1048576 must be in [0, 131,072]",
    ),
    (
        "huge_vocab",
        _set("inputs", "llm", "vocab_size", value=1 << 31),
        "inputs.llm.vocab_size=2147483648 must be in [0, 4,194,304]",
    ),
    ("zero1_not_bool", _set("inputs", "zero1", value="yes"), "inputs.zero1"),
]


@pytest.mark.parametrize(
    "edit, expected", [c[1:] for c in CLUSTER_CASES], ids=[c[0] for c in CLUSTER_CASES]
)
def test_cluster_plan_rules(tmp_path, cluster_plan, edit, expected) -> None:
    path = _write(tmp_path, _edited(cluster_plan, edit))
    assert expected in _error_of(path)


def test_a_cost_no_machine_measures_and_a_huge_file_are_refused(tmp_path, local_plan) -> None:
    """A performance model's 1e300 s per token is named where the plan is read, not after
    the processes start; a plan file over the size limit is not read into memory."""
    edit = _set("inputs", "performance_model", "llm", "per_token_s", value=1e300)
    message = _error_of(_write(tmp_path, _edited(local_plan, edit)))
    assert "LLMTimeCoefficients.per_token_s=1e+300 is more than 1e+06 s" in message
    huge = tmp_path / "huge.json"
    with open(huge, "w") as f:
        f.truncate((64 << 20) + 1)  # sparse: the check reads the size, not the bytes
    assert f"is {(64 << 20) + 1:,} bytes, more than a plan file may be (64 MiB): not read" in (
        _error_of(huge)
    )


def test_not_json_and_too_deep(tmp_path, local_plan) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in _error_of(deep)
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "dflop.plan", ')
    assert "is not valid JSON" in _error_of(broken)
    long_int = tmp_path / "long_int.json"
    long_int.write_text('{"global_batch": ' + "9" * 5000 + "}")
    assert "is not valid JSON" in _error_of(long_int)
    # Nested deep inside a field, but not past the parser: a bad field, cut short.
    nested: list[Any] = []
    for _ in range(500):
        nested = [nested]
    path = _write(tmp_path, _edited(local_plan, _set("global_batch", value=nested)), "n.json")
    message = _error_of(path)
    assert "global_batch=[[[[" in message and "must be an integer" in message
    path = _write(
        tmp_path,
        _edited(local_plan, _set("layouts", 0, "steps", 0, "llm_forward_s", value=nested)),
        "n2.json",
    )
    assert "layouts[0].steps[0].llm_forward_s=[[[[" in _error_of(path)


def test_show_is_bounded() -> None:
    assert show([-5, 2]) == "[-5, 2]"
    assert len(show(list(range(10**7)))) <= 200
    assert len(show({"a" * 10**6: [1] * 10**6})) <= 200
    assert show(10**300).endswith("...") and len(show(10**300)) == 200


def test_train_refuses_a_huge_but_valid_global_batch(tmp_path, local_plan) -> None:
    """A consistent plan (no recorded steps) for 100,000 samples per step loads, but
    local training refuses it before building anything, naming the file and field; a
    run's own --global-batch beyond the bound too."""
    batch = MAX_LOCAL_GLOBAL_BATCH + 1
    assert batch <= MAX_PLAN_GLOBAL_BATCH
    data = _edited(local_plan, _all_global_batches(batch, drop_steps=True))
    path = _write(tmp_path, data)
    assert Plan.load(path).global_batch == batch
    with pytest.raises(ValueError) as caught:
        layout_from_plan(path, "tiny")
    assert str(caught.value).startswith(f"{path}: global_batch=65,537 is more than dflop train")
    good = _write(tmp_path, local_plan, "good.json")
    assert layout_from_plan(good, "tiny").global_batch == 16
    with pytest.raises(ValueError, match=r"TrainConfig.global_batch=65,537 is more than"):
        layout_from_plan(good, "tiny", global_batch=batch)
    # Another model's layer counts: the field is named.
    with pytest.raises(ValueError, match=r"layouts\[0\]\.encoder\.layers_per_stage=\[2\]"):
        layout_from_plan(good, "small")


# ---------------------------------------------------------------------- the CLI


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return cli_harness.run_cli(*args, timeout_s=timeout_s)


def _one_line_error(result: subprocess.CompletedProcess, command: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(f"dflop {command}: error: ")
    assert len(lines[0]) <= MAX_MESSAGE + 40
    return lines[0]


@pytest.mark.integration
def test_simulate_refuses_bad_plans(tmp_path, local_plan) -> None:
    cases = [
        (_set("layouts", 0, "num_microbatches", value=-3), "layouts[0].num_microbatches=-3"),
        (
            _set("layouts", 0, "steps", 0, "assignment", 0, value=10**6),
            "layouts[0].steps[0].assignment[0]=1000000 must be in [0, ",
        ),
        (
            _set("layouts", 0, "encoder", "layer_ranges", value=[[-5, 2]]),
            "layouts[0].encoder.layer_ranges[0]=[-5, 2] must be [0, 2]",
        ),
    ]
    for k, (edit, expected) in enumerate(cases):
        path = _write(tmp_path, _edited(local_plan, edit), f"bad{k}.json")
        line = _one_line_error(run_cli("simulate", str(path)), "simulate")
        assert f"{path}: {expected}" in line, line
    good = _write(tmp_path, local_plan, "good.json")
    result = run_cli("simulate", str(good))
    assert result.returncode == 0, result.stderr
    assert "re-simulated from the recorded step" in result.stdout


@pytest.mark.integration
def test_train_refuses_bad_plans_before_any_process(tmp_path, local_plan) -> None:
    """Each used to start ranks (40 s and 3.8 GB at 10^7 samples, a MemoryError at 10^18,
    a ValueError traceback from a rank at 10^6 GPUs); now: exit 2, one line, at once."""
    cases = [
        (_all_global_batches(10**7, drop_steps=False), "global_batch=10000000 must equal"),
        (_set("global_batch", value=10**18), "global_batch=1000000000000000000 must be in"),
        (_set("cluster", "num_gpus", value=10**6), "cluster.num_gpus=1000000 must equal"),
        (
            _all_global_batches(10**5, drop_steps=True),
            "global_batch=100,000 is more than dflop train runs on local processes",
        ),
    ]
    for k, (edit, expected) in enumerate(cases):
        path = _write(tmp_path, _edited(local_plan, edit), f"bad{k}.json")
        began = time.perf_counter()
        result = run_cli(
            "train", "--plan", str(path), "--steps", "1", "--json", str(tmp_path / "m.json")
        )
        line = _one_line_error(result, "train")
        assert f"{path}: {expected}" in line, line
        assert time.perf_counter() - began < 60
        assert not (tmp_path / "m.json").exists()
