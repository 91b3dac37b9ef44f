"""Pipeline programs through the Python API: the generated orders, the validator's
messages, the memory rule, and the simulator on interleaved and split-backward programs
against an independent pass-by-pass reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from dflop.scheduling import (
    PipelineAction,
    PipelineProgram,
    peak_in_flight,
    pipeline_program,
    validate_program,
)
from dflop.simulator import simulate_pipeline


def _text(actions) -> str:
    return " ".join(str(a) for a in actions)


def test_interleaved_order_is_megatrons():
    program = pipeline_program("interleaved-1f1b", [2], 4, chunks=[2])
    assert program.owner == (0, 1, 0, 1)
    assert program.virtual_stages_of(1) == (1, 3)
    assert _text(program.actions[0]) == (
        "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3"
    )


@pytest.mark.parametrize("encoder_stages", [0, 1, 2])
@pytest.mark.parametrize("llm_stages,chunks", [(1, 1), (2, 2), (3, 2), (4, 3)])
def test_memory_rule_is_the_generated_lists_peak(encoder_stages, llm_stages, chunks):
    stages = [encoder_stages, llm_stages] if encoder_stages else [llm_stages]
    chunk_counts = [1, chunks] if encoder_stages else [chunks]
    for m in range(llm_stages, 4 * llm_stages + 1, llm_stages):
        program = pipeline_program("interleaved-1f1b", stages, m, chunks=chunk_counts)
        validate_program(program)
        for s, actions in enumerate(program.actions):
            live = peak = 0
            for a in actions:
                live += 1 if a.kind == "F" else -1
                peak = max(peak, live)
            assert peak_in_flight("interleaved-1f1b", stages, m, s, chunks=chunk_counts) == peak


def test_validator_names_stage_action_and_problem():
    program = pipeline_program("1f1b", [2], 2)
    swapped = list(program.actions[1])
    swapped[0], swapped[1] = swapped[1], swapped[0]
    bad = PipelineProgram(2, program.owner, (program.actions[0], tuple(swapped)))
    with pytest.raises(
        ValueError, match=r"stage 1, action 0 \(B of virtual stage 1, microbatch 0\)"
    ):
        validate_program(bad)
    deadlock = PipelineProgram(
        2,
        (0, 1),
        (
            tuple(PipelineAction(0, k, j) for k, j in [("F", 0), ("B", 0), ("F", 1), ("B", 1)]),
            tuple(PipelineAction(1, k, j) for k, j in [("F", 1), ("F", 0), ("B", 0), ("B", 1)]),
        ),
    )
    with pytest.raises(ValueError, match="deadlocks: stage 0 waits at action 1"):
        validate_program(deadlock)
    with pytest.raises(ValueError, match="kind 'X'"):
        validate_program(PipelineProgram(1, (0,), ((PipelineAction(0, "X", 0),),)))
    with pytest.raises(ValueError, match="multiple of the last segment's stages"):
        pipeline_program("interleaved-1f1b", [4], 6, chunks=[2])
    with pytest.raises(ValueError, match="1f1b runs one chunk per stage"):
        pipeline_program("1f1b", [2], 4, chunks=[2])


def _reference_step(program: PipelineProgram, fwd, bwd, latency, w_fraction=0.5) -> float:
    """The step by repeated passes over the stages (no worklist, no shared code)."""
    V, m = fwd.shape
    fwd_at, grad_at = {}, {}
    free = [0.0] * program.num_stages
    nxt = [0] * program.num_stages
    moved = True
    while moved:
        moved = False
        for s, actions in enumerate(program.actions):
            while nxt[s] < len(actions):
                v, kind, k = actions[nxt[s]]
                ready = 0.0
                if kind == "F" and v > 0:
                    if (v, k) not in fwd_at:
                        break
                    ready = fwd_at[(v, k)]
                if kind in "BI" and v < V - 1:
                    if (v, k) not in grad_at:
                        break
                    ready = grad_at[(v, k)]
                share = {"F": 1.0, "B": 1.0, "I": 1.0 - w_fraction, "W": w_fraction}[kind]
                duration = (fwd if kind == "F" else bwd)[v, k] * share
                free[s] = max(free[s], ready) + duration
                if kind == "F" and v < V - 1:
                    fwd_at[(v + 1, k)] = free[s] + latency
                if kind in "BI" and v > 0:
                    grad_at[(v - 1, k)] = free[s] + latency
                nxt[s] += 1
                moved = True
    assert all(n == len(a) for n, a in zip(nxt, program.actions))
    return max(free)


@pytest.mark.parametrize("seed", range(4))
def test_interleaved_simulation_matches_reference(seed):
    rng = np.random.default_rng(seed)
    stages, chunks, m = [1, 3], [1, 2], 6
    program = pipeline_program("interleaved-1f1b", stages, m, chunks=chunks)
    V = program.num_virtual_stages
    fwd, bwd = rng.uniform(0.1, 1.0, (V, m)), rng.uniform(0.2, 2.0, (V, m))
    result = simulate_pipeline(
        fwd, bwd, schedule="interleaved-1f1b", stages=stages, chunks=chunks, link_latency_s=0.01
    )
    assert result.step_time_s == pytest.approx(_reference_step(program, fwd, bwd, 0.01))
    assert result.busy_s.shape == (1, 4)
    np.testing.assert_allclose(result.busy_s.sum(), fwd.sum() + bwd.sum())
    assert set(result.events["virtual_stage"][result.events["kind"] == "fwd"]) == set(range(V))


def test_interleaving_shrinks_the_bubble_and_a_split_backward_runs():
    plain = simulate_pipeline(np.full((4, 8), 1.0), np.full((4, 8), 2.0))
    inter = simulate_pipeline(
        np.full((8, 8), 0.5),
        np.full((8, 8), 1.0),
        schedule="interleaved-1f1b",
        stages=[4],
        chunks=[2],
    )
    assert (plain.step_time_s, inter.step_time_s) == (pytest.approx(33.0), pytest.approx(28.5))
    # A zero-bubble-style hand-written program: input gradients first, weights at the end.
    order = {
        0: [("F", 0), ("F", 1), ("I", 0), ("I", 1), ("W", 0), ("W", 1)],
        1: [("F", 0), ("I", 0), ("F", 1), ("I", 1), ("W", 0), ("W", 1)],
    }
    program = PipelineProgram(
        2, (0, 1), tuple(tuple(PipelineAction(s, k, j) for k, j in order[s]) for s in (0, 1))
    )
    fwd, bwd = np.ones((2, 2)), np.full((2, 2), 2.0)
    result = simulate_pipeline(fwd, bwd, program=program)
    assert result.step_time_s == pytest.approx(_reference_step(program, fwd, bwd, 0.0)) == 8.0
    kinds = set(result.events["kind"])
    assert {"bwd_input", "bwd_weight"} <= kinds
    with pytest.raises(ValueError, match="owners"):
        simulate_pipeline(np.ones((4, 2)), np.ones((4, 2)), stages=[2], chunks=[2], program=program)


def test_every_small_generated_program_runs():
    for schedule, stages, v in itertools.product(
        ["1f1b", "gpipe", "interleaved-1f1b"], [1, 2, 3], [1, 2]
    ):
        if schedule == "1f1b" and v > 1:
            continue
        m = 2 * stages
        program = pipeline_program(schedule, [1, stages], m, chunks=[1, v])
        validate_program(program)
        V = program.num_virtual_stages
        res = simulate_pipeline(
            np.ones((V, m)), np.ones((V, m)), schedule=schedule, stages=[1, stages], chunks=[1, v]
        )
        assert res.step_time_s == pytest.approx(
            _reference_step(program, np.ones((V, m)), np.ones((V, m)), 0.0)
        )
