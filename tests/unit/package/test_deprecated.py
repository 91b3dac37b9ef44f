"""Renamed public names (docs/concepts.md › Glossary) still work for one release, with a warning
that names the new one; the planner's ``plan`` stays its function."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize(
    "old, new",
    [
        ("dflop.runtime.comm", "dflop.runtime.dist"),
        ("dflop.runtime.communicator", "dflop.runtime.bridge"),
        ("dflop.runtime.pipeline", "dflop.runtime.engine"),
        ("dflop.scheduling.pipeline", "dflop.scheduling.pipeline_schedule"),
    ],
)
def test_an_old_module_path_imports_the_new_module_with_a_warning(old, new):
    pytest.importorskip("torch")
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated.*use {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


@pytest.mark.parametrize(
    "package, old, new",
    [
        ("dflop.scheduling", "SCHEDULES", "PIPELINE_ORDERS"),
        ("dflop.scheduling", "schedule_for", "pipeline_order_for"),
        ("dflop.planner", "ModuleSpec", "PlannerModule"),
        ("dflop.planner", "module_specs", "planner_modules"),
    ],
)
def test_an_old_attribute_is_the_new_one_with_a_warning(package, old, new):
    module = importlib.import_module(package)
    with pytest.warns(DeprecationWarning, match=f"{package}.{old} is deprecated.*{new}"):
        value = getattr(module, old)
    assert value is getattr(module, new)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        module.nothing_here  # noqa: B018


def test_old_keywords_of_the_simulator_and_the_layout():
    from dflop.simulator import simulate_pipeline

    with pytest.warns(DeprecationWarning, match=r"simulate_pipeline\(order=...\)"):
        old = simulate_pipeline([[1.0, 1.0]], [[2.0, 2.0]], schedule="gpipe")
    assert old.order == "gpipe"
    assert (
        old.step_time_s == simulate_pipeline([[1.0, 1.0]], [[2.0, 2.0]], order="gpipe").step_time_s
    )


def test_the_runtime_layouts_old_property():
    pytest.importorskip("torch")
    from dflop.runtime import RuntimeLayout

    layout = RuntimeLayout.simple(
        llm_pp=2,
        llm_virtual_stages=2,
        encoder_layers=2,
        llm_layers=4,
        num_microbatches=4,
        global_batch=4,
    )
    with pytest.warns(DeprecationWarning, match="RuntimeLayout.pipeline_order"):
        assert layout.default_schedule == layout.pipeline_order == "interleaved-1f1b"


def test_dflop_planner_plan_is_the_function_after_any_import():
    import dflop.planner
    import dflop.planner.result  # noqa: F401

    assert callable(dflop.planner.plan)
