"""Pipeline programs through the Python API: the generated orders, the validator's
messages (with the stage x time grid), the memory rule, the simulator on interleaved and
split-backward programs against an independent pass-by-pass reference, the schedule
registry and choice, and actions and programs as text and files."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from dflop.scheduling import (
    PIPELINE_ORDERS,
    PipelineAction,
    PipelineProgram,
    format_action,
    format_program,
    load_program,
    parse_action,
    parse_program,
    peak_in_flight,
    pipeline_order_for,
    pipeline_program,
    program_grid,
    save_program,
    validate_program,
)
from dflop.scheduling.actions import ACTION_KINDS
from dflop.simulator import simulate_pipeline
from hypothesis import given, settings
from hypothesis import strategies as st


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


def _reference_step(
    program: PipelineProgram, fwd, bwd, latency, w_fraction=0.5, weight=None
) -> float:
    """The step by repeated passes over the stages (no worklist, no shared code);
    ``weight``: the W seconds per cell (default ``w_fraction`` of the backward)."""
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
                w = bwd[v, k] * w_fraction if weight is None else weight[v, k]
                duration = {"F": fwd[v, k], "B": bwd[v, k], "I": bwd[v, k] - w, "W": w}[kind]
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
        fwd, bwd, order="interleaved-1f1b", stages=stages, chunks=chunks, link_latency_s=0.01
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
        order="interleaved-1f1b",
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


@pytest.mark.parametrize("stages", [[3], [1, 3], [2, 2]])
def test_zero_bubble_h1_keeps_the_pipelines_peak_and_shrinks_the_bubble(stages):
    S = sum(stages)
    for m in range(1, 3 * S + 1):
        program = pipeline_program("zb-h1", stages, m)
        validate_program(program)
        for s, actions in enumerate(program.actions):
            live = peak = 0
            for a in actions:
                live += {"F": 1, "I": 0, "W": -1}[a.kind]
                peak = max(peak, live)
            assert peak_in_flight("zb-h1", stages, m, s) == peak == min(S, m)
            assert peak_in_flight("1f1b", stages, m, s) == min(S - s, m)
    # Equal F, I and W: 3 m + S - 1 against 1F1B's 3 (m + S - 1).
    m = 2 * S
    f = np.ones((S, m))
    assert simulate_pipeline(f, 2 * f, order="zb-h1", stages=stages).step_time_s == 3 * m + S - 1
    assert simulate_pipeline(f, 2 * f, order="1f1b", stages=stages).step_time_s == 3 * (m + S - 1)
    # Per-cell W seconds: the first stage defers its whole backward (its input takes no
    # gradient); the simulator and the reference agree.
    rng = np.random.default_rng(S)
    fwd, bwd = rng.uniform(0.5, 1.5, (S, m)), rng.uniform(1.0, 3.0, (S, m))
    weight = bwd * rng.uniform(0.3, 0.7, (S, m))
    weight[0] = bwd[0]
    got = simulate_pipeline(fwd, bwd, order="zb-h1", stages=stages, weight_s=weight)
    program = pipeline_program("zb-h1", stages, m)
    assert got.step_time_s == pytest.approx(_reference_step(program, fwd, bwd, 0.0, weight=weight))
    with pytest.raises(ValueError, match=r"weight_s\[1\]=.* exceeds backward_s\[1\]"):
        bad = weight.copy()
        bad[0, 1] = bwd[0, 1] + 1.0
        simulate_pipeline(fwd, bwd, order="zb-h1", stages=stages, weight_s=bad)
    with pytest.raises(ValueError, match="weight_s must have the shape of backward_s"):
        simulate_pipeline(fwd, bwd, order="zb-h1", stages=stages, weight_s=weight[:, :1])


def test_every_small_generated_program_runs():
    for schedule, stages, v in itertools.product(
        ["1f1b", "gpipe", "interleaved-1f1b", "zb-h1"], [1, 2, 3], [1, 2]
    ):
        if schedule in ("1f1b", "zb-h1") and v > 1:
            continue
        m = 2 * stages
        program = pipeline_program(schedule, [1, stages], m, chunks=[1, v])
        validate_program(program)
        V = program.num_virtual_stages
        res = simulate_pipeline(
            np.ones((V, m)), np.ones((V, m)), order=schedule, stages=[1, stages], chunks=[1, v]
        )
        assert res.step_time_s == pytest.approx(
            _reference_step(program, np.ones((V, m)), np.ones((V, m)), 0.0)
        )


# ---------------------------------------------------------------- the schedule registry


def test_schedules_come_from_the_registry_and_the_choice_is_the_cores():
    from dflop import _core
    from dflop.runtime.topology import RuntimeLayout

    assert (
        PIPELINE_ORDERS
        == tuple(_core.pipeline_order_names())
        == ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1")
    )
    assert pipeline_order_for(([4], [1])) == "1f1b"
    assert pipeline_order_for(([2, 3], [1, 1])) == "1f1b"
    assert pipeline_order_for(([2, 3], [1, 2])) == "interleaved-1f1b"
    for v, expected in [(1, "1f1b"), (2, "interleaved-1f1b")]:
        layout = RuntimeLayout.simple(
            llm_pp=2,
            encoder_layers=2,
            llm_layers=4,
            num_microbatches=4,
            global_batch=8,
            llm_virtual_stages=v,
        )
        assert pipeline_order_for(layout) == layout.pipeline_order == expected
    with pytest.raises(ValueError, match=r"shape.stages\[0\] must be in \[1"):
        pipeline_order_for(([0], [1]))
    with pytest.raises(TypeError, match="RuntimeLayout or a"):
        pipeline_order_for("1f1b")


# ---------------------------------------------------------------- actions and programs as text

_ACTIONS = st.builds(
    PipelineAction,
    st.integers(0, 10**12 - 1),
    st.sampled_from(ACTION_KINDS),
    st.integers(0, 10**12 - 1),
)


@settings(max_examples=300, deadline=None)
@given(_ACTIONS)
def test_an_action_round_trips_through_its_text(action):
    text = format_action(action)
    assert text == str(action) == f"{action.kind}{action.stage}.{action.microbatch}"
    assert parse_action(text) == action


@settings(max_examples=300, deadline=None)
@given(st.from_regex(r"[FBIW](0|[1-9][0-9]{0,11})\.(0|[1-9][0-9]{0,11})", fullmatch=True))
def test_an_action_text_round_trips(text):
    assert format_action(parse_action(text)) == text


@pytest.mark.parametrize(
    "text, match",
    [
        ("F01.3", "is not an action"),
        ("F1.3 ", "is not an action"),
        ("F1", "is not an action"),
        ("1F3", "is not an action"),
        ("F-1.3", "is not an action"),
        ("F1.1234567890123", "is not an action"),
        ("", "is not an action"),
        ("X1.3", "has kind 'X', not one of F, B, I, W"),
        ("f1.3", "has kind 'f'"),
    ],
)
def test_a_bad_action_text_is_refused(text, match):
    with pytest.raises(ValueError, match=match):
        parse_action(text)


def test_format_action_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="'X' is not one of F, B, I, W"):
        format_action(PipelineAction(0, "X", 0))
    with pytest.raises(ValueError, match="negative"):
        format_action(PipelineAction(-1, "F", 0))


@settings(max_examples=60, deadline=None)
@given(
    schedule=st.sampled_from(PIPELINE_ORDERS),
    encoder_stages=st.integers(0, 2),
    llm_stages=st.integers(1, 4),
    chunks=st.integers(1, 3),
    rounds=st.integers(1, 3),
    split=st.booleans(),
)
def test_a_program_round_trips_through_its_text_and_a_file(
    tmp_path_factory, schedule, encoder_stages, llm_stages, chunks, rounds, split
):
    if schedule in ("1f1b", "zb-h1"):
        chunks = 1
    stages = [encoder_stages, llm_stages] if encoder_stages else [llm_stages]
    chunk_counts = [1, chunks] if encoder_stages else [chunks]
    m = llm_stages * rounds
    program = pipeline_program(schedule, stages, m, chunks=chunk_counts)
    if split:  # every B of the last stage as I then W: still valid, and written as such
        last = tuple(
            b
            for a in program.actions[-1]
            for b in (
                [
                    PipelineAction(a.stage, "I", a.microbatch),
                    PipelineAction(a.stage, "W", a.microbatch),
                ]
                if a.kind == "B"
                else [a]
            )
        )
        program = PipelineProgram(m, program.owner, (*program.actions[:-1], last))
    text = format_program(program)
    assert parse_program(text) == program
    path = tmp_path_factory.mktemp("program") / "program.txt"
    save_program(program, path)
    assert path.read_text() == text
    assert load_program(path) == program
    assert load_program(str(path)).virtual_stages_of(len(stages) - 1) == program.virtual_stages_of(
        len(stages) - 1
    )


def test_the_program_text_format():
    program = pipeline_program("1f1b", [2], 2)
    assert format_program(program).splitlines()[-4:] == [
        "microbatches 2",
        "owners 0 1",
        "stage 0: F0.0 F0.1 B0.0 B0.1",
        "stage 1: F1.0 B1.0 F1.1 B1.1",
    ]
    # Comments, blank lines and extra spaces are ignored; the words are as written.
    loose = "\n  # a comment\nowners 0   1\nmicrobatches 2  # m\n\nstage 0 : F0.0 F0.1 B0.0 B0.1\n"
    assert parse_program(loose + "stage 1:F1.0  B1.0 F1.1 B1.1") == program


@pytest.mark.parametrize(
    "text, match",
    [
        ("owners 0 1\nstage 0: F0.0\n", r"lacks microbatches"),
        ("microbatches 2\nstage 0: F0.0\n", r"lacks owners"),
        ("microbatches 2\nowners 0 1\n", r"lacks stage lines"),
        ("microbatches 2\nmicrobatches 2\n", r"line 2: 'microbatches' takes one count"),
        ("microbatches two\n", r"line 1: 'two' is not a whole number"),
        ("microbatches 2\nowners 0\nowners 0\n", r"line 3: 'owners' is given twice"),
        ("microbatches 2\nowners 0 1\nstage 1: F1.0\n", r"line 3: expected 'stage 0:'"),
        ("microbatches 2\nowners 0 1\nstage 0 F0.0\n", r"line 3: expected 'stage 0:'"),
        ("microbatches 2\nowners 0\nstage 0: F0.0 F0.x\n", r"line 3, action 1: 'F0.x' is not"),
        ("microbatches 2\nowners 0\nstage 0: F0.0 S0.1\n", r"line 3, action 1: 'S0.1' has kind"),
        ("schedule 1f1b\n", r"line 1: 'schedule' is not 'microbatches', 'owners' or 'stage'"),
    ],
)
def test_a_malformed_program_text_names_the_line(text, match):
    with pytest.raises(ValueError, match=r"^my.txt(, line \d+)?.*" + match):
        parse_program(text, source="my.txt")


def test_an_invalid_program_file_shows_the_grid_with_the_failing_action(tmp_path):
    program = pipeline_program("1f1b", [2], 2)
    swapped = list(program.actions[1])
    swapped[0], swapped[1] = swapped[1], swapped[0]
    bad = PipelineProgram(2, program.owner, (program.actions[0], tuple(swapped)))
    path = tmp_path / "bad.txt"
    save_program(bad, path)  # saving does not validate
    with pytest.raises(ValueError) as info:
        load_program(path)
    message = str(info.value)
    assert message.startswith(f"pipeline program file {str(path)!r} is not a valid program: ")
    assert "stage 1, action 0 (B of virtual stage 1, microbatch 0): needs its forward" in message
    assert message.splitlines()[-3:] == [
        "slot     0       1       2       3",
        "stage 0  F0.0    F0.1    B0.0    B0.1",
        "stage 1  >B1.0<  F1.0    F1.1    B1.1",
    ]
    # A deadlock marks every waiting stage.
    order = {
        0: [("F", 0), ("B", 0), ("F", 1), ("B", 1)],
        1: [("F", 1), ("F", 0), ("B", 0), ("B", 1)],
    }
    deadlock = PipelineProgram(
        2, (0, 1), tuple(tuple(PipelineAction(s, k, j) for k, j in order[s]) for s in (0, 1))
    )
    with pytest.raises(ValueError, match=r"(?s)deadlocks.*stage 0  F0.0    >B0.0<.*>F1.1<"):
        parse_program(format_program(deadlock))


def test_the_grid_of_a_big_program_is_bounded():
    program = pipeline_program("gpipe", [64], 500)
    stage_actions = list(program.actions[40])
    stage_actions[700] = PipelineAction(40, "B", 600)  # a microbatch out of range
    bad = PipelineProgram(
        500, program.owner, (*program.actions[:40], tuple(stage_actions), *program.actions[41:])
    )
    with pytest.raises(ValueError) as info:
        validate_program(bad)
    message = str(info.value)
    assert ">B40.600<" in message
    assert "(stages 0 to 31 not shown)" in message and "(stages 48 to 63 not shown)" in message
    assert len(message.splitlines()) <= 22 and len(message) < 4000
    # The same grid, asked for.
    assert program_grid(bad, [(40, 700)]) in message


def test_program_grid_of_a_valid_program():
    grid = program_grid(pipeline_program("gpipe", [2], 2))
    assert grid.splitlines()[1:] == [
        "slot     0     1     2     3",
        "stage 0  F0.0  F0.1  B0.0  B0.1",
        "stage 1  F1.0  F1.1  B1.0  B1.1",
    ]
