"""The plan table says what it shows: units (GPUs or local processes), memory in units
that show it, what its tags mean, and why dflop's best is slower than the baseline where
it is."""

from __future__ import annotations

import pytest
from dflop.data.costs import ENCODER_PRESETS, LLM_PRESETS, AnalyticCostModel
from dflop.planner import ClusterSpec, PlannerConfig, plan
from dflop.planner.model import placement_candidates
from dflop.planner.result import _bytes


def _eight_gpu_plan(placement: str = "any", **settings):
    """siglip-400m + llm-7b on one 8-GPU node: the colocated data-blind baseline is faster than
    any layout with encoder GPUs of its own (as ``dflop plan --gpus 8`` finds)."""
    encoder, llm = ENCODER_PRESETS["siglip-400m"], LLM_PRESETS["llm-7b"]
    return plan(
        AnalyticCostModel(encoder, llm),
        encoder,
        llm,
        ClusterSpec(num_gpus=8),
        global_batch=256,
        config=PlannerConfig(**placement_candidates(placement), **settings),
    )


def test_the_baselines_placement_with_dflops_schedule_is_a_candidate() -> None:
    """By default the baseline's own (colocated) placement is a candidate under dflop's
    schedule, so the plan is not slower than the baseline, and says nothing about it."""
    result = _eight_gpu_plan()
    assert result.best.colocated and not result.best.encoder.padded_heads
    assert result.best.llm.describe() == result.baseline.llm.describe()  # the same GPUs
    assert result.speedup_over_baseline >= 1.0
    assert "slower than the" not in result.table()


def test_a_plan_slower_than_the_baseline_says_so_and_why() -> None:
    result = _eight_gpu_plan(placement="disaggregated")
    assert result.speedup_over_baseline < 1.0
    table = result.table()
    slower = 100 * (1 / result.speedup_over_baseline - 1)
    assert f"note: dflop's best layout is predicted {slower:.1f}% slower than the" in table
    assert "(colocated, Megatron-style); dflop's best gives the encoder 2 of 8" in table
    assert "this plan left colocated layouts out" in table
    assert "rc: activation recomputation" in table or " rc)" not in table
    assert "blind: the data-blind baseline" in table and "colocated: the encoder" in table
    assert " GB" in table and "enc 2 GPUs" in table
    # A plan of local processes counts processes.
    result.inputs["local"] = True
    assert "enc 2 processes" in result.table() and "GPUs (" not in result.table()


def test_memory_is_shown_in_units_that_show_it() -> None:
    assert _bytes(0.0) == "not modelled"
    assert _bytes(5.4e7) == "54 MB"
    assert _bytes(7.52e10) == "75.2 GB"


def test_a_narrow_top_k_looks_further_when_its_layouts_do_not_fit_as_run() -> None:
    """The search's best layouts can need more memory under the trainer's schedules than
    under its own: with top_k=1 the planner then looks further down its ranking (it once
    called this cluster infeasible) and finds what top_k=5 finds."""
    encoder, llm = ENCODER_PRESETS["siglip-400m"], LLM_PRESETS["llm-7b"]
    best = {}
    for top_k in (1, 5):
        result = plan(
            AnalyticCostModel(encoder, llm),
            encoder,
            llm,
            ClusterSpec(num_gpus=8),
            global_batch=256,
            config=PlannerConfig(top_k=top_k),
        )
        assert 1 <= len(result.layouts) <= top_k
        best[top_k] = result.best.core_dict()
    assert best[1] == best[5]


def test_a_colocated_plan_becomes_the_runtime_layout_that_runs_it(tmp_path) -> None:
    """The best (colocated) layout of a plan is a colocated RuntimeLayout on the LLM's
    GPUs; a baseline whose encoder heads were padded is refused, saying why."""
    from dflop.models import model_config
    from dflop.train.planning import layout_from_plan, runtime_layout

    # Priced as dflop train runs it (fp32, an unsharded optimizer): it refuses other plans.
    result = _eight_gpu_plan(element_bytes=4, zero1=False)
    path = tmp_path / "plan.json"
    result.save(path)
    layout = layout_from_plan(path, model_config("siglip-400m+llm-7b"))
    best = result.best
    assert layout.colocated and layout.world_size == 8
    assert (layout.llm.tp, layout.llm.pp, layout.llm.dp) == (best.llm.tp, best.llm.pp, best.llm.dp)
    assert (layout.encoder.tp, layout.encoder.pp, layout.encoder.dp) == (
        best.llm.tp,
        1,
        best.llm.dp,
    )
    encoder, llm = ENCODER_PRESETS["vit-6b"], LLM_PRESETS["llm-7b"]  # 25 heads
    padded = plan(
        AnalyticCostModel(encoder, llm),
        encoder,
        llm,
        ClusterSpec(num_gpus=16),
        global_batch=64,
        config=PlannerConfig(num_batches=2, top_k=2),
    ).baseline
    assert padded.colocated and padded.encoder.padded_heads
    with pytest.raises(ValueError, match="pads the encoder's heads to .* without padding"):
        runtime_layout(padded)


def test_placements_restrict_the_candidates() -> None:
    assert placement_candidates("colocated") == {
        "colocated_candidates": True,
        "disaggregated_candidates": False,
    }
    with pytest.raises(ValueError, match="placement='nowhere' must be one of any"):
        placement_candidates("nowhere")
    with pytest.raises(ValueError, match="both False: no layout would be a candidate"):
        PlannerConfig(colocated_candidates=False, disaggregated_candidates=False)
    colocated = _eight_gpu_plan(placement="colocated")
    assert all(lp.colocated for lp in colocated.layouts)
    disaggregated = _eight_gpu_plan(placement="disaggregated")
    assert not any(lp.colocated for lp in disaggregated.layouts)
