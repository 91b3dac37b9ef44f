"""Planner: constraints, memory, determinism, pruning = exhaustive, JSON, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from dflop import _core
from dflop.data.costs import AnalyticCostModel
from dflop.planner import (
    ClusterSpec,
    InfeasibleClusterError,
    LayoutPlan,
    Plan,
    PlannerConfig,
    evaluate_layout,
    plan,
    prepare_inputs,
    search_layouts,
    simulate_layout,
)

# Disaggregated layouts only (as before colocated candidates were on by default): these tests
# check the disaggregated search; test_layouts_respect_constraints adds the colocated ones.
FAST = PlannerConfig(num_batches=2, top_k=3, colocated_candidates=False)


def _plan(
    gpus: int = 16,
    encoder: str = "siglip-400m",
    llm: str = "llm-7b",
    batch: int = 64,
    config: PlannerConfig = FAST,
    **cluster,
) -> Plan:
    model = AnalyticCostModel(encoder, llm)
    return plan(
        model,
        model.encoder,
        model.llm,
        ClusterSpec(num_gpus=gpus, **cluster),
        global_batch=batch,
        config=config,
    )


def _inputs(encoder: str = "siglip-400m", llm: str = "llm-7b", batch: int = 64, batches: int = 2):
    model = AnalyticCostModel(encoder, llm)
    return prepare_inputs(model, model.encoder, model.llm, global_batch=batch, num_batches=batches)


def _check_layout(lp, cluster: ClusterSpec, encoder_heads: int, llm_heads: int, layers) -> None:
    gpn = cluster.gpus_per_node
    used: list[int] = []
    for module, heads, num_layers in (
        (lp.encoder, encoder_heads, layers[0]),
        (lp.llm, llm_heads, layers[1]),
    ):
        assert gpn % module.tp == 0
        # A colocated encoder runs at the LLM's tp with its heads padded where needed.
        if module.colocated:
            assert module.padded_heads == (
                0 if heads % module.tp == 0 else -(-heads // module.tp) * module.tp
            )
        else:
            assert heads % module.tp == 0
        assert sum(module.layers_per_stage) == num_layers
        assert all(n >= 1 for n in module.layers_per_stage)
        assert module.layer_ranges[-1][1] == num_layers
        for stage in module.stage_ranks:
            for group in stage:
                assert len({r // gpn for r in group}) == 1  # TP inside one node
                used.extend(group)
    if lp.colocated:
        assert lp.encoder.num_gpus == 0
    assert sorted(used) == list(range(cluster.num_gpus))  # disjoint, all GPUs
    assert lp.num_microbatches * lp.llm.dp <= lp.global_batch


def test_layouts_respect_constraints() -> None:
    result = _plan(16)
    model = AnalyticCostModel("siglip-400m", "llm-7b")
    assert 1 <= len(result.layouts) <= 3
    for lp in [*result.layouts, result.baseline]:
        assert lp is not None
        _check_layout(
            lp,
            result.cluster,
            model.encoder.num_heads,
            model.llm.num_heads,
            (model.encoder.num_layers, model.llm.num_layers),
        )
        p = lp.prediction
        assert p.step_time_s >= p.lower_bound_s * (1 - 1e-9)
        assert 0.0 <= p.idle_fraction < 1.0
        assert p.peak_memory_bytes <= result.cluster.gpu_memory_bytes
    times = [lp.prediction.step_time_s for lp in result.layouts]
    assert times == sorted(times)
    # FAST: disaggregated layouts only. By default the colocated ones are candidates too
    # (the runtime runs them): the search covers the baseline's layouts and beats it.
    assert not any(lp.colocated for lp in result.layouts)
    assert PlannerConfig().colocated_candidates
    both = _plan(16, config=replace(FAST, colocated_candidates=True))
    assert both.best.prediction.step_time_s <= result.best.prediction.step_time_s
    assert both.best.prediction.step_time_s <= both.baseline.prediction.step_time_s


def test_disaggregated_layout_on_large_encoder() -> None:
    result = _plan(32, encoder="vit-6b", batch=128)
    best = result.best
    assert not best.colocated and best.encoder.num_gpus >= 1 and best.llm.num_gpus >= 1
    assert best.encoder.tp == 1  # 25 heads: no TP degree within a node divides them but 1
    assert best.llm.first_rank == best.encoder.num_gpus


def test_encoder_restrictions_are_obeyed_and_validated() -> None:
    # The search's own scores (the re-scoring of its top_k with the trainer's scheduler may
    # re-rank a different top_k differently).
    search = replace(FAST, runtime_schedule=False)
    free = _plan(16, config=search)
    fixed = _plan(16, config=replace(search, encoder_gpus=(2, 4), encoder_max_tp=1))
    assert fixed.layouts
    for lp in fixed.layouts:
        assert lp.encoder.num_gpus in (2, 4) and lp.encoder.tp == 1
    # A restriction can only narrow the search.
    assert fixed.best.prediction.step_time_s >= free.best.prediction.step_time_s
    with pytest.raises(ValueError, match=r"PlannerConfig.encoder_gpus\[1\]"):
        PlannerConfig(encoder_gpus=(2, 0))
    with pytest.raises(ValueError, match="PlannerConfig.encoder_max_tp"):
        PlannerConfig(encoder_max_tp=0)
    with pytest.raises(ValueError, match=r"encoder_gpu_choices\[0\] must be in \[1, num_gpus\)"):
        _plan(16, config=replace(FAST, encoder_gpus=(16,)))


def test_given_schedules_are_scored_and_bad_ones_named() -> None:
    result = _plan(16)
    inputs = _inputs()
    best = result.best
    # The plan's records are the schedules it was scored with: scoring them again agrees.
    given = [step.assignment for step in best.steps]
    again = evaluate_layout(result.cluster, inputs, best, FAST, assignments=given)
    assert again.prediction.step_time_s == pytest.approx(best.prediction.step_time_s)
    with pytest.raises(ValueError, match=r"assignments has 1 schedules, expected 2"):
        evaluate_layout(result.cluster, inputs, best, FAST, assignments=given[:1])
    bad = [given[0].copy(), given[1]]
    bad[0][3] = 10_000
    with pytest.raises(ValueError, match=r"assignments\[0\]\[3\]=10000 is out of range"):
        evaluate_layout(result.cluster, inputs, best, FAST, assignments=bad)


def test_data_blind_baseline_pads_encoder_heads() -> None:
    # InternViT-6B has 25 heads: a colocated layout at tp > 1 needs padded heads (as NVLM
    # does in Megatron-LM); without them only tp = 1 exists and a 32B LLM does not fit.
    inputs = _inputs("vit-6b", "llm-32b", batch=64, batches=1)
    cluster = ClusterSpec(num_gpus=32)
    layouts, _ = search_layouts(cluster, inputs, FAST, strategy="data_blind", top_k=3)
    assert layouts and all(lp.colocated and lp.scheduler == "data_blind" for lp in layouts)
    best = layouts[0]
    assert best.llm.tp > 1 and best.encoder.tp == best.llm.tp
    assert best.encoder.padded_heads == -(-25 // best.llm.tp) * best.llm.tp
    assert "padded" in best.describe()
    assert LayoutPlan.from_dict(best.to_dict()).encoder.padded_heads == best.encoder.padded_heads
    assert best.prediction.peak_memory_bytes <= cluster.gpu_memory_bytes
    spec = inputs.encoder
    for name in (
        "attention_compute_fraction",
        "attention_param_fraction",
        "attention_activation_fraction",
    ):
        assert 0.0 < getattr(spec, name) < 1.0
    # The dummy heads cost: the same layout is faster and smaller if padding were free.
    free = replace(
        inputs,
        encoder=replace(
            spec,
            attention_compute_fraction=0.0,
            attention_param_fraction=0.0,
            attention_activation_fraction=0.0,
        ),
    )
    free_score = evaluate_layout(cluster, free, best, FAST)
    assert free_score.prediction.step_time_s < best.prediction.step_time_s
    assert free_score.prediction.peak_memory_bytes < best.prediction.peak_memory_bytes


def test_reference_keeps_its_estimate_ranking() -> None:
    inputs = _inputs(batches=1)
    layouts, _ = search_layouts(
        ClusterSpec(num_gpus=16), inputs, FAST, strategy="mean_shape", top_k=4
    )
    estimates = [lp.prediction.estimate_s for lp in layouts]
    assert len(layouts) == 4 and estimates == sorted(estimates)
    one, _ = search_layouts(ClusterSpec(num_gpus=16), inputs, FAST, strategy="mean_shape", top_k=1)
    assert one[0].describe() == layouts[0].describe()


def test_infeasible_cluster_message() -> None:
    with pytest.raises(InfeasibleClusterError) as info:
        _plan(8, encoder="vit-6b", llm="llm-72b", batch=32, config=PlannerConfig(num_batches=1))
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "8 GPUs of 80.0 GB" in message and "llm stage" in message
    assert "gpu_memory_bytes >=" in message and "num_gpus >=" in message


def test_memory_limit_rejects_layouts() -> None:
    inputs = _inputs()
    big, raw_big = search_layouts(ClusterSpec(num_gpus=16), inputs, FAST)
    small, raw_small = search_layouts(ClusterSpec(num_gpus=16, gpu_memory_bytes=40e9), inputs, FAST)
    assert raw_small["stats"]["num_memory_rejected"] > raw_big["stats"]["num_memory_rejected"]
    for lp in small:
        assert lp.prediction.peak_memory_bytes <= 40e9
    assert small[0].prediction.step_time_s >= big[0].prediction.step_time_s


def test_deterministic() -> None:
    a, b = _plan(16).to_dict(), _plan(16).to_dict()
    a.pop("planning_time_s"), b.pop("planning_time_s")
    assert a == b


# The pruned search (bounds, screening, patience) finds what the exhaustive one finds, on
# clusters small enough to search exhaustively: different encoders and LLMs, batches from
# one sample per GPU upwards, 4 or 8 GPUs per node, 40 or 80 GB. (benchmarks/bench_plan.py
# --validate runs hundreds of such settings.)
@pytest.mark.parametrize(
    ("gpus", "encoder", "llm", "batch", "gpn", "memory_gb"),
    [
        (8, "siglip-400m", "llm-7b", 32, 8, 80),
        (16, "vit-6b", "llm-7b", 32, 8, 80),
        (8, "vit-6b", "llm-7b", 8, 4, 80),
        (12, "vit-300m", "llm-8b", 48, 4, 40),
        (16, "siglip-400m", "qwen2-0.5b", 16, 4, 40),
        (24, "vit-6b", "llm-32b", 48, 8, 80),
    ],
)
def test_pruning_matches_exhaustive(gpus, encoder, llm, batch, gpn, memory_gb) -> None:
    inputs = _inputs(encoder=encoder, llm=llm, batch=batch)
    cluster = ClusterSpec(num_gpus=gpus, gpus_per_node=gpn, gpu_memory_bytes=memory_gb * 1e9)
    pruned, raw_pruned = search_layouts(cluster, inputs, PlannerConfig(num_batches=2, top_k=3))
    full, raw_full = search_layouts(
        cluster, inputs, PlannerConfig(num_batches=2, top_k=3, prune=False)
    )
    assert [lp.to_dict() for lp in pruned] == [lp.to_dict() for lp in full]
    assert raw_pruned["stats"]["num_simulated"] < raw_full["stats"]["num_simulated"]
    assert not raw_pruned["stats"]["stopped_by_patience"]
    assert raw_pruned["stats"]["num_candidates"] == raw_full["stats"]["num_candidates"]


def test_interleaved_candidates_pruned_exactly_and_planned_end_to_end(tmp_path) -> None:
    """With LLM virtual stages allowed the pruned search keeps the exhaustive result, picks
    an interleaved layout here (a deep LLM pipeline, few samples), records its layers per
    virtual stage, and the plan round-trips into the runtime's layout."""
    from dflop.models import model_config
    from dflop.planner.search import audited
    from dflop.train.planning import layout_from_plan

    interleave = replace(FAST, virtual_stage_choices=(1, 2))
    inputs = _inputs(batch=16)
    cluster = ClusterSpec(num_gpus=16)
    pruned, _ = search_layouts(cluster, inputs, interleave)
    full, _ = search_layouts(cluster, inputs, replace(interleave, prune=False))
    assert [lp.to_dict() for lp in pruned] == [lp.to_dict() for lp in full]
    best = pruned[0]
    assert best.llm.virtual_stages == 2 and "v=2" in best.describe()
    assert len(best.llm.layers_per_stage) == best.llm.pp * 2
    assert best.num_microbatches % best.llm.pp == 0
    # Each recorded step re-simulates, under the interleaved program, to its prediction.
    scored = audited(cluster, inputs, best, interleave)
    for step, planned in zip(scored.steps, scored.prediction.step_times_s):
        assert step.llm_chunks == 2
        assert step.simulate(record_events=False).step_time_s == pytest.approx(planned)
    sim = simulate_layout(cluster, inputs, scored, interleave)
    assert sim.busy_s.shape[1] == best.encoder.pp + best.llm.pp  # physical stages
    assert sim.events["virtual_stage"].max() == best.encoder.pp + 2 * best.llm.pp - 1
    # The trainer's scheduler re-scores the 1F1B-only search's layouts too: allowing
    # interleaving never makes the plan slower.
    for batch, llm in ((64, "llm-7b"), (32, "llm-32b")):
        encoder = "siglip-400m" if llm == "llm-7b" else "vit-6b"
        both = _plan(16, encoder, llm, batch, config=interleave).best.prediction.step_time_s
        only = _plan(16, encoder, llm, batch, config=FAST).best.prediction.step_time_s
        assert both <= only * (1 + 1e-12)
    # Off by default; a layout may not carry chunks the runtime cannot run.
    assert PlannerConfig().virtual_stage_choices == (1,)
    with pytest.raises(ValueError, match="must hold 1"):
        PlannerConfig(virtual_stage_choices=(2,))
    # The plan file keeps the virtual stages, and the trainer's layout takes them (a reference
    # model of the same depth: 28 layers in 6 chunks).
    path = tmp_path / "plan.json"
    # Priced as dflop train runs it (fp32, an unsharded optimizer): it refuses other plans.
    runs = dict(element_bytes=4, zero1=False)
    result = _plan(16, batch=16, config=replace(interleave, runtime_schedule=False, **runs))
    assert result.best.llm.virtual_stages == 2
    result.save(path)
    assert Plan.load(path).best.llm.virtual_stages == 2
    layout = layout_from_plan(path, model_config("siglip-400m+llm-7b"), 64)
    assert layout.llm.virtual_stages == 2 and layout.pipeline_order == "interleaved-1f1b"
    assert len(layout.llm.layer_ranges) == layout.llm.pp * 2


def test_large_clusters_plan_with_bounded_effort() -> None:
    """1,024 GPUs: most blocks are never enumerated pair by pair, patience ends the
    plateau of near-equal layouts, and the few unexplored candidates are reported."""
    inputs = _inputs(batch=2048, batches=2)
    layouts, raw = search_layouts(ClusterSpec(num_gpus=1024), inputs, PlannerConfig(num_batches=2))
    stats = raw["stats"]
    assert layouts
    assert stats["num_scheduled"] < 5000 < stats["num_candidates"]
    assert (
        stats["num_pruned"]
        + stats["num_simulated"]
        + stats["num_memory_rejected"]
        + stats["num_unexplored"]
        == stats["num_candidates"]
    )
    if stats["stopped_by_patience"]:
        assert stats["num_unexplored"] >= 0


def test_threads_do_not_change_the_result() -> None:
    inputs = _inputs(encoder="vit-6b", batch=64)
    cluster = ClusterSpec(num_gpus=32)
    one, raw_one = search_layouts(
        cluster, inputs, PlannerConfig(num_batches=2, top_k=3, num_threads=1)
    )
    many, raw_many = search_layouts(
        cluster, inputs, PlannerConfig(num_batches=2, top_k=3, num_threads=4)
    )
    assert [lp.to_dict() for lp in one] == [lp.to_dict() for lp in many]
    assert raw_one["stats"] == raw_many["stats"]
    stats = raw_one["stats"]
    # Most candidates that pass the first bound are pruned by the schedule-based one.
    assert stats["num_pruned_after_schedule"] <= stats["num_pruned"]
    assert stats["num_simulated"] <= stats["num_scheduled"]
    with pytest.raises(ValueError, match="num_threads"):
        PlannerConfig(num_threads=0)


def test_zero_bubble_is_chosen_where_it_pays_and_planned_end_to_end(tmp_path) -> None:
    """PlannerConfig.zero_bubble scores each kept layout under ZB-H1 too: a deep pipeline
    with few microbatches takes it (its steps re-simulate under the split program, its
    lower bound stays below), it is never slower than the search without it, the plan file
    keeps the order and the trainer's layout runs it."""
    from dflop.models import model_config
    from dflop.planner.search import audited
    from dflop.train.planning import layout_from_plan

    zero_bubble = replace(FAST, zero_bubble=True)
    assert PlannerConfig().zero_bubble is False  # opt in: see PlannerConfig
    inputs = _inputs(batch=16)
    cluster = ClusterSpec(num_gpus=16)
    with_zb, _ = search_layouts(cluster, inputs, zero_bubble)
    without, _ = search_layouts(cluster, inputs, FAST)
    assert with_zb[0].prediction.step_time_s <= without[0].prediction.step_time_s * (1 + 1e-12)
    best = with_zb[0]
    assert best.order == "zb-h1" and "zb-h1" in best.describe()
    assert best.prediction.lower_bound_s <= best.prediction.step_time_s
    # The same layout without the order is slower (ZB-H1 was kept because it pays).
    plain = [lp for lp in without if lp.core_dict() == {**best.core_dict(), "order": None}]
    if plain:
        assert best.prediction.step_time_s < plain[0].prediction.step_time_s
    scored = audited(cluster, inputs, best, zero_bubble)
    for step, planned in zip(scored.steps, scored.prediction.step_times_s):
        assert step.order == "zb-h1" and step.weight_s.size
        assert step.simulate(record_events=False).step_time_s == pytest.approx(planned)
    path = tmp_path / "plan.json"
    # Priced as dflop train runs it (fp32, an unsharded optimizer): it refuses other plans.
    result = _plan(16, batch=16, config=replace(zero_bubble, element_bytes=4, zero1=False))
    assert result.best.order == "zb-h1"
    result.save(path)
    assert Plan.load(path).best.order == "zb-h1"
    layout = layout_from_plan(path, model_config("siglip-400m+llm-7b"), 64)
    assert layout.pipeline_order == "zb-h1"


def test_zero_bubble_tries_more_than_the_kept_layouts_and_never_loses_the_1f1b_plan() -> None:
    """ZB-H1 is tried beyond the 1F1B top_k (on the best layouts simulated under 1F1B):
    here it finds a layout faster under ZB-H1 than any kept layout is, although it is not
    among them. The search also keeps the 1F1B top_k, so choosing among them as the
    runtime runs them (choose_layouts) is never slower than planning without ZB-H1."""
    from dflop.planner.search import choose_layouts, evaluate_layout

    inputs = _inputs(batch=16)
    cluster = ClusterSpec(num_gpus=16)
    plain, _ = search_layouts(cluster, inputs, FAST)
    with_zb, _ = search_layouts(cluster, inputs, replace(FAST, zero_bubble=True))
    assert len(with_zb) <= 2 * FAST.top_k
    best = with_zb[0]
    assert best.order == "zb-h1"
    assert {**best.core_dict(), "order": None} not in [lp.core_dict() for lp in plain]
    kept_under_zb = [
        evaluate_layout(cluster, inputs, replace(lp, order="zb-h1"), FAST) for lp in plain
    ]
    assert best.prediction.step_time_s < min(lp.prediction.step_time_s for lp in kept_under_zb)
    for lp in plain:  # the 1F1B top_k is kept
        assert lp.core_dict() in [z.core_dict() for z in with_zb]
    for gpus, batch in ((16, 16), (16, 64)):
        inputs = _inputs(batch=batch)
        cluster = ClusterSpec(num_gpus=gpus)
        chosen = [
            choose_layouts(cluster, inputs, config)[0]
            for config in (FAST, replace(FAST, zero_bubble=True))
        ]
        assert all(len(layouts) <= FAST.top_k for layouts in chosen)
        ran = [layouts[0].prediction.step_time_s for layouts in chosen]
        assert ran[1] <= ran[0] * (1 + 1e-12)


def test_microbatch_ordering_never_hurts() -> None:
    inputs = _inputs(encoder="vit-6b", batch=64)
    layouts, _ = search_layouts(ClusterSpec(num_gpus=16), inputs, FAST)
    for lp in layouts:
        p = lp.prediction
        assert p.step_time_s <= p.step_time_as_scheduled_s + 1e-12


def test_plan_json_roundtrip(tmp_path) -> None:
    result = _plan(16)
    path = tmp_path / "plan.json"
    result.save(path)
    loaded = Plan.load(path)
    assert loaded.to_dict() == result.to_dict()
    data = json.loads(path.read_text())
    assert data["format"] == "dflop.plan" and data["version"] == 1
    llm = data["layouts"][0]["llm"]
    assert {"tp", "pp", "dp", "layer_ranges", "stage_ranks", "first_rank"} <= set(llm)
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version 99"):
        Plan.load(path)


def test_simulate_layout_timeline(tmp_path) -> None:
    result = _plan(16)
    inputs = _inputs()
    sim = simulate_layout(result.cluster, inputs, result.best, batch=0)
    assert sim.step_time_s == pytest.approx(result.best.prediction.step_times_s[0])
    sim.write_chrome_trace(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())


def test_cluster_spec_validation_names_field() -> None:
    with pytest.raises(ValueError, match="ClusterSpec.num_gpus"):
        ClusterSpec(num_gpus=1)
    with pytest.raises(ValueError, match="ClusterSpec.gpu_memory_bytes"):
        ClusterSpec(num_gpus=8, gpu_memory_bytes=-1)
    with pytest.raises(TypeError, match="ClusterSpec.gpus_per_node"):
        ClusterSpec(num_gpus=8, gpus_per_node=2.5)
    with pytest.raises(ValueError, match="PlannerConfig.top_k"):
        PlannerConfig(top_k=0)


def test_core_split_layers_and_microbatches() -> None:
    assert _core.split_layers(10, 3, 1.0, 0.0, 0.0, False) == [4, 3, 3]
    # An LM head worth 2 layers on the last stage: it takes fewer layers.
    assert _core.split_layers(10, 3, 1.0, 0.0, 2.0, True) == [4, 4, 2]
    assert _core.default_microbatch_choices(10) == [1, 2, 3, 4, 6, 8, 10]
    with pytest.raises(ValueError, match="num_stages"):
        _core.split_layers(3, 4, 1.0, 0.0, 0.0, True)


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, "-m", "dflop.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_plan_and_simulate(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = _cli(
        "plan",
        "--perf",
        "analytic",
        "--encoder",
        "siglip-400m",
        "--llm",
        "llm-7b",
        "--shapes",
        "synthetic",
        "--gpus",
        "16",
        "--gpus-per-node",
        "8",
        "--gpu-memory-gb",
        "80",
        "--global-batch",
        "64",
        "--batches",
        "2",
        "-o",
        "plan.json",
        "--top",
        "2",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "samples/s" in out.stdout and "data-blind" in out.stdout
    out = _cli(
        "plan", "--gpus", "16", "--global-batch", "64", "--batches", "2", "--json", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["format"] == "dflop.plan"
    out = _cli("simulate", "plan.json", "--trace", "out.json", "--png", "out.png", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out.png").stat().st_size > 0
    assert json.loads((tmp_path / "out.json").read_text())
    bad = _cli(
        "plan",
        "--encoder",
        "vit-6b",
        "--llm",
        "llm-72b",
        "--gpus",
        "8",
        "--global-batch",
        "32",
        "--batches",
        "1",
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "no layout fits" in bad.stderr
    missing = _cli("plan", "--perf", "nope.json", "--gpus", "8", cwd=tmp_path)
    assert missing.returncode == 2 and "nope.json" in missing.stderr


def test_accepts_custom_distribution_and_shapes() -> None:
    from dflop.data.synthetic import synthetic_shapes

    model = AnalyticCostModel("siglip-400m", "llm-7b")
    shapes = synthetic_shapes(500, seed=3)
    result = plan(
        model,
        model.encoder,
        model.llm,
        ClusterSpec(num_gpus=8),
        global_batch=32,
        shapes=shapes,
        config=FAST,
    )
    assert np.isfinite(result.best.prediction.step_time_s)


def test_a_runs_steps_are_planned_as_they_are() -> None:
    """Given a run's steps (``.shapes(step)``), batch b of the plan is step b: the
    recorded samples are the steps' samples in order; a step of the wrong size is an
    error naming it."""
    from dflop.data.synthetic import synthetic_shapes

    steps = [synthetic_shapes(16, seed=100 + b) for b in range(FAST.num_batches)]

    class RunSteps:
        def shapes(self, step: int):
            return steps[step]

    model = AnalyticCostModel("siglip-400m", "llm-7b")
    inputs = prepare_inputs(
        model, model.encoder, model.llm, global_batch=16, shapes=RunSteps(), num_batches=2
    )
    want = np.concatenate([s.seq_len for s in steps]).astype(np.float64)
    np.testing.assert_array_equal(inputs.samples["llm_tokens"], want)
    steps[1] = steps[1].take(np.arange(15))
    with pytest.raises(
        ValueError, match=r"shapes.shapes\(1\) gave 15, expected .*global_batch=16 samples"
    ):
        prepare_inputs(
            model, model.encoder, model.llm, global_batch=16, shapes=RunSteps(), num_batches=2
        )


def test_the_core_reads_its_argument_dicts_strictly(monkeypatch) -> None:
    """A misspelt optional key is an error naming it (it used to be ignored), and so is a
    value of the wrong type (it used to be a bare cast error)."""
    from dflop.planner import search

    valid = search.core_options  # what plan() calls (dflop.planner.inputs)

    def misspelt(*args, **kwargs):
        options = valid(*args, **kwargs)
        options["prunee"] = options.pop("prune")
        return options

    monkeypatch.setattr(search, "core_options", misspelt)
    with pytest.raises(ValueError, match=r'options has unknown key "prunee" \(known: strategy'):
        _plan(8)

    def wrong_type(*args, **kwargs):
        return {**valid(*args, **kwargs), "top_k": "five"}

    monkeypatch.setattr(search, "core_options", wrong_type)
    with pytest.raises(ValueError, match=r'options\["top_k"\] has the wrong type: str'):
        _plan(8)
