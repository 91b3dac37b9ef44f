"""The demo's paired verdict: per-step ratios, their median and spread, the median step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from dflop.commands.demo_figure import paired_steps


def _rows(dflop: list[float], blind: list[float]) -> list[SimpleNamespace]:
    rows = []
    for step, (d, b) in enumerate(zip(dflop, blind)):
        rows.append(SimpleNamespace(step=step, mode="dflop", step_time_s=d))
        rows.append(SimpleNamespace(step=step, mode="blind", step_time_s=b))
    return rows


def test_paired_steps_after_the_warmup() -> None:
    # Step 0 (warm-up, excluded) is slow; ratios of steps 1-5: 0.5, 0.8, 1.2, 0.9, 0.6.
    rows = _rows([9.0, 1.0, 0.8, 1.2, 0.9, 0.6], [1.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    paired = paired_steps(rows, warmup=1)
    assert paired.steps.tolist() == [1, 2, 3, 4, 5]
    assert paired.ratios.tolist() == pytest.approx([0.5, 0.8, 1.2, 0.9, 0.6])
    assert paired.representative == 2  # ratio 0.8, the median
    headline = paired.headline()
    assert "over 5 paired steps" in headline and "median 0.80x" in headline
    assert "range 0.50x-1.20x" in headline and "dflop faster in 4 of 5 steps" in headline


def test_a_run_without_both_schedules_is_refused() -> None:
    rows = [SimpleNamespace(step=0, mode="dflop", step_time_s=1.0)]
    with pytest.raises(ValueError, match="no step ran with both schedules"):
        paired_steps(rows, warmup=0)
