"""Pipeline simulator: hand-computed cases, an independent event-loop reference on random
cases, input validation, and the timeline exports."""

from __future__ import annotations

import heapq
import json
import math
import sys

import numpy as np
import pytest
from dflop.scheduling.actions import pipeline_actions
from dflop.simulator import SimulationResult, simulate_pipeline
from dflop.timeline import (
    EVENT_DTYPE,
    as_events,
    make_events,
    to_chrome_trace,
    write_chrome_trace,
    write_gantt_png,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def _compute(result: SimulationResult, stage: int, kind: str, microbatch: int, replica: int = 0):
    ev = result.events
    mask = (
        (ev["replica"] == replica)
        & (ev["stage"] == stage)
        & (ev["kind"] == kind)
        & (ev["microbatch"] == microbatch)
    )
    assert mask.sum() == 1
    row = ev[mask][0]
    return float(row["start_s"]), float(row["end_s"])


# ---- hand-computed cases ------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages", [1, 2, 4, 7])
@pytest.mark.parametrize("num_microbatches", [1, 3, 4, 8, 16])
def test_uniform_makespan(schedule, num_stages, num_microbatches):
    f, b = 1.0, 2.0
    shape = (num_stages, num_microbatches)
    res = simulate_pipeline(np.full(shape, f), np.full(shape, b), order=schedule)
    expected = (num_microbatches + num_stages - 1) * (f + b)
    assert res.step_time_s == pytest.approx(expected)
    assert res.busy_s.shape == (1, num_stages)
    np.testing.assert_allclose(res.busy_s, num_microbatches * (f + b))
    np.testing.assert_allclose(res.idle_s, (num_stages - 1) * (f + b))
    assert res.idle_fraction == pytest.approx(
        (num_stages - 1) / (num_microbatches + num_stages - 1)
    )
    assert np.all(np.diff(res.events["start_s"]) >= 0)


def test_single_slow_microbatch():
    fwd = np.ones((2, 3))
    fwd[0, 1] = 3.0
    res = simulate_pipeline(fwd, np.ones((2, 3)))
    assert res.step_time_s == pytest.approx(9.0)
    assert _compute(res, 0, "fwd", 1) == pytest.approx((1.0, 4.0))
    assert _compute(res, 0, "bwd", 0) == pytest.approx((4.0, 5.0))
    assert _compute(res, 1, "fwd", 1) == pytest.approx((4.0, 5.0))
    np.testing.assert_allclose(res.busy_s, [[8.0, 6.0]])
    np.testing.assert_allclose(res.idle_s, [[1.0, 3.0]])
    gpipe = simulate_pipeline(fwd, np.ones((2, 3)), order="gpipe")
    assert gpipe.step_time_s == pytest.approx(10.0)


def test_unequal_stages():
    fwd = np.array([[1.0, 1.0], [2.0, 2.0]])
    res = simulate_pipeline(fwd, fwd.copy())
    # The slow stage paces: stage 0's first forward + 2 x (2 + 2) + stage 0's last backward.
    assert res.step_time_s == pytest.approx(10.0)
    assert _compute(res, 1, "fwd", 1) == pytest.approx((5.0, 7.0))
    assert _compute(res, 0, "bwd", 1) == pytest.approx((9.0, 10.0))


def test_latency_adds_a_round_trip():
    res = simulate_pipeline(np.ones((2, 2)), np.ones((2, 2)), link_latency_s=0.5)
    assert res.step_time_s == pytest.approx(7.0)
    sends = res.events[res.events["kind"] == "send"]
    assert len(sends) == 4
    back = sends[(sends["stage"] == 1) & (sends["microbatch"] == 0)][0]
    assert back["peer_stage"] == 0
    assert (back["start_s"], back["end_s"]) == pytest.approx((3.5, 4.0))


def test_bandwidth_serialises_transfers():
    half = np.full((2, 2), 0.5)
    res = simulate_pipeline(
        half,
        half,
        order="gpipe",
        activation_bytes=1e9,
        link_bandwidth_bytes_per_s=1e9,
    )
    # The second activation waits for the first on the link: 5.0 without queueing.
    assert res.step_time_s == pytest.approx(6.0)
    assert _compute(res, 1, "fwd", 1) == pytest.approx((2.5, 3.0))


def test_replicas_and_allreduce():
    fwd = np.ones((2, 2, 1))
    fwd[1, 1, 0] = 3.0  # a straggler in replica 1
    res = simulate_pipeline(fwd, np.ones((2, 2, 1)), allreduce_s=[1.0, 3.0])
    np.testing.assert_allclose(res.compute_end_s, [[4.0, 3.0], [6.0, 5.0]])
    assert res.step_time_s == pytest.approx(8.0)
    ar = res.events[res.events["kind"] == "allreduce"]
    assert len(ar) == 4
    stage0 = ar[ar["stage"] == 0]
    np.testing.assert_allclose(stage0["start_s"], 6.0)  # waits for replica 1
    np.testing.assert_allclose(res.idle_s, [[6.0, 6.0], [6.0, 4.0]])


def test_pipeline_actions_orders():
    def fmt(actions):
        return " ".join(f"{a.kind}{a.microbatch}" for a in actions)

    assert fmt(pipeline_actions("1f1b", 4, 6, 1)) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"
    assert fmt(pipeline_actions("1f1b", 4, 6, 3)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert fmt(pipeline_actions("1f1b", 4, 2, 0)) == "F0 F1 B0 B1"
    assert fmt(pipeline_actions("GPipe", 3, 3, 2)) == "F0 F1 F2 B0 B1 B2"


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("num_microbatches", [1, 2, 5, 9])
def test_pipeline_actions_match_in_flight_rule(schedule, num_stages, num_microbatches):
    for stage in range(num_stages):
        expected = _reference_order(schedule, num_stages, num_microbatches, stage)
        got = pipeline_actions(schedule, num_stages, num_microbatches, stage)
        assert all(a.stage == stage for a in got)
        assert [(a.is_forward, a.microbatch) for a in got] == expected


# ---- independent reference: a time-ordered event loop ------------------------------------


def _next_action(schedule, num_stages, num_microbatches, stage, fwd_done, bwd_done):
    """Forward while forwards remain and fewer than S - stage microbatches (1F1B; no limit
    for GPipe) are in flight, else the oldest backward."""
    limit = num_stages - stage if schedule == "1f1b" else math.inf
    if fwd_done < num_microbatches and fwd_done - bwd_done < limit:
        return True, fwd_done
    if bwd_done < num_microbatches:
        return False, bwd_done
    return None


def _reference_order(schedule, num_stages, num_microbatches, stage):
    order, fwd_done, bwd_done = [], 0, 0
    while True:
        action = _next_action(schedule, num_stages, num_microbatches, stage, fwd_done, bwd_done)
        if action is None:
            return order
        order.append(action)
        fwd_done += action[0]
        bwd_done += not action[0]


class _ReferenceReplica:
    """One replica's pipeline as a time-ordered event loop over a heap: stages start their
    next action (by the in-flight rule) when idle and its input has arrived; links carry
    one transfer at a time per direction, FIFO."""

    def __init__(self, r, fwd, bwd, schedule, latency, bandwidth, sizes, grads=None):
        self.r, self.fwd, self.bwd, self.schedule = r, fwd, bwd, schedule
        self.latency, self.bandwidth, self.sizes = latency, bandwidth, sizes
        _, self.num_stages, self.m = fwd.shape
        # grads[l]: boundary l carries gradients back (all do by default).
        self.grads = [True] * (self.num_stages - 1) if grads is None else [bool(g) for g in grads]
        self.heap, self.seq, self.now = [], 0, 0.0
        self.fwd_done = [0] * self.num_stages
        self.bwd_done = [0] * self.num_stages
        self.stage_busy = [False] * self.num_stages
        self.arrived = set()  # (stage, is_forward, k) inputs that have arrived
        self.link_busy = {}  # (link, is_forward) -> bool
        self.link_queue = {}  # (link, is_forward) -> FIFO of (from, to, k)
        self.events = []
        self.busy = np.zeros(self.num_stages)
        self.compute_end = np.zeros(self.num_stages)

    def push(self, t, what, *payload):
        heapq.heappush(self.heap, (t, self.seq, what, payload))
        self.seq += 1

    def try_link(self, key):
        if self.link_busy.get(key) or not self.link_queue.get(key):
            return
        src, dst, k = self.link_queue[key].pop(0)
        link = min(src, dst)
        size = self.sizes[self.r, link, k] if self.sizes is not None else 0.0
        occupancy = size / self.bandwidth[link]
        self.link_busy[key] = True
        self.push(self.now + occupancy, "link_free", key)
        arrival = self.now + occupancy + self.latency[link]
        self.push(arrival, "arrive", dst, dst > src, k)
        self.events.append((self.r, src, "send", k, dst, self.now, arrival))

    def try_stage(self, s):
        if self.stage_busy[s]:
            return
        action = _next_action(
            self.schedule, self.num_stages, self.m, s, self.fwd_done[s], self.bwd_done[s]
        )
        if action is None:
            return
        is_forward, k = action
        needs_input = (is_forward and s > 0) or (
            not is_forward and s < self.num_stages - 1 and self.grads[s]
        )
        if needs_input and (s, is_forward, k) not in self.arrived:
            return
        duration = (self.fwd if is_forward else self.bwd)[self.r, s, k]
        self.stage_busy[s] = True
        self.push(self.now + duration, "done", s, is_forward, k, self.now)

    def run(self):
        for s in range(self.num_stages):
            self.try_stage(s)
        while self.heap:
            self.now, _, what, payload = heapq.heappop(self.heap)
            if what == "done":
                s, is_forward, k, start = payload
                self.stage_busy[s] = False
                self.busy[s] += self.now - start
                self.compute_end[s] = self.now
                self.events.append(
                    (self.r, s, "fwd" if is_forward else "bwd", k, -1, start, self.now)
                )
                if is_forward:
                    self.fwd_done[s] += 1
                else:
                    self.bwd_done[s] += 1
                dst = s + 1 if is_forward else s - 1
                if 0 <= dst < self.num_stages and (is_forward or self.grads[dst]):
                    key = (min(s, dst), is_forward)
                    self.link_queue.setdefault(key, []).append((s, dst, k))
                    self.try_link(key)
                self.try_stage(s)
            elif what == "arrive":
                dst, is_forward, k = payload
                self.arrived.add((dst, is_forward, k))
                self.try_stage(dst)
            else:
                self.link_busy[payload[0]] = False
                self.try_link(payload[0])
        assert self.fwd_done == [self.m] * self.num_stages
        assert self.bwd_done == [self.m] * self.num_stages


def _reference_simulate(fwd, bwd, schedule, latency, bandwidth, sizes, allreduce, grads=None):
    num_replicas, num_stages, _ = fwd.shape
    replicas = [
        _ReferenceReplica(r, fwd, bwd, schedule, latency, bandwidth, sizes, grads)
        for r in range(num_replicas)
    ]
    events = []
    for replica in replicas:
        replica.run()
        events.extend(replica.events)
    busy = np.array([replica.busy for replica in replicas])
    compute_end = np.array([replica.compute_end for replica in replicas])
    step = 0.0
    for s in range(num_stages):
        start = compute_end[:, s].max()
        end = start + allreduce[s]
        if np.any(allreduce != 0):
            events.extend((r, s, "allreduce", -1, -1, start, end) for r in range(num_replicas))
        step = max(step, end)
    return step, busy, compute_end, events


def test_gradient_links_all_ones_match_the_default():
    rng = np.random.default_rng(7)
    for schedule in ("1f1b", "gpipe"):
        fwd = rng.uniform(0.0, 2.0, (2, 4, 5))
        bwd = rng.uniform(0.0, 4.0, (2, 4, 5))
        kwargs = {
            "order": schedule,
            "link_latency_s": [0.1, 0.0, 0.3],
            "activation_bytes": rng.uniform(0.0, 3.0, (2, 3, 5)),
            "link_bandwidth_bytes_per_s": [1.0, 2.0, np.inf],
            "allreduce_s": [0.5, 1.0, 0.0, 2.0],
        }
        default = simulate_pipeline(fwd, bwd, **kwargs)
        for ones in ([1, 1, 1], np.ones(3, dtype=bool)):
            linked = simulate_pipeline(fwd, bwd, gradient_links=ones, **kwargs)
            assert linked.step_time_s == default.step_time_s
            for field in ("busy_s", "idle_s", "compute_end_s"):
                np.testing.assert_array_equal(getattr(linked, field), getattr(default, field))
            np.testing.assert_array_equal(linked.events, default.events)


def test_gradient_links_frozen_first_stage():
    # Stage 0 is frozen (backward 0 s, no gradient back over boundary 0): its 1F1B order
    # F0 F1 B0 F2 B1 B2 never waits for stage 1, so its forwards run back to back. Stage 1
    # (f = 2, b = 1) gets each activation 0.5 s after its forward ends.
    fwd = np.array([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    bwd = np.array([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    res = simulate_pipeline(fwd, bwd, link_latency_s=0.5, gradient_links=[0])
    assert [_compute(res, 0, "fwd", k) for k in range(3)] == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    assert [_compute(res, 0, "bwd", k) for k in range(3)] == [(2.0, 2.0), (3.0, 3.0), (3.0, 3.0)]
    assert [_compute(res, 1, "fwd", k) for k in range(3)] == [(1.5, 3.5), (4.5, 6.5), (7.5, 9.5)]
    assert [_compute(res, 1, "bwd", k) for k in range(3)] == [(3.5, 4.5), (6.5, 7.5), (9.5, 10.5)]
    assert res.step_time_s == 10.5
    np.testing.assert_array_equal(res.compute_end_s, [[3.0, 10.5]])
    np.testing.assert_array_equal(res.busy_s, [[3.0, 9.0]])
    sends = res.events[res.events["kind"] == "send"]
    assert len(sends) == 3  # the activations only: no gradient back over boundary 0
    assert set(sends["stage"]) == {0}
    assert set(sends["peer_stage"]) == {1}
    # With the gradient link, stage 0's B0 waits for stage 1's gradient (4.5 + 0.5).
    linked = simulate_pipeline(fwd, bwd, link_latency_s=0.5)
    assert _compute(linked, 0, "bwd", 0) == (5.0, 5.0)
    assert _compute(linked, 0, "fwd", 2) == (5.0, 6.0)


def _event_key(e):
    return (int(e[0]), int(e[1]), str(e[2]), int(e[3]), int(e[4]))


@settings(max_examples=150, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_matches_reference_event_loop(seed):
    rng = np.random.default_rng(seed)
    num_replicas = int(rng.integers(1, 4))
    num_stages = int(rng.integers(1, 6))
    num_microbatches = int(rng.integers(1, 9))
    shape = (num_replicas, num_stages, num_microbatches)
    # Small integers half the time, so that events tie and the tie rules are exercised.
    if rng.random() < 0.5:
        fwd = rng.integers(0, 4, shape).astype(float)
        bwd = rng.integers(0, 4, shape).astype(float)
    else:
        fwd = rng.uniform(0.0, 2.0, shape)
        bwd = rng.uniform(0.0, 4.0, shape)
    num_links = num_stages - 1
    latency = rng.uniform(0.0, 0.5, num_links) * (rng.random() < 0.7)
    bandwidth = (
        rng.uniform(0.5, 4.0, num_links) if rng.random() < 0.6 else np.full(num_links, np.inf)
    )
    sizes = (
        rng.uniform(0.0, 3.0, (num_replicas, num_links, num_microbatches))
        if rng.random() < 0.6
        else None
    )
    allreduce = rng.uniform(0.0, 2.0, num_stages) if rng.random() < 0.5 else np.zeros(num_stages)
    schedule = "1f1b" if rng.random() < 0.6 else "gpipe"
    # Drawn last: the cases above are those drawn before gradient links existed.
    grads = rng.integers(0, 2, num_links) if rng.random() < 0.3 else None

    res = simulate_pipeline(
        fwd,
        bwd,
        order=schedule,
        link_latency_s=latency,
        activation_bytes=sizes,
        link_bandwidth_bytes_per_s=bandwidth,
        allreduce_s=allreduce,
        gradient_links=grads,
    )
    step, busy, compute_end, ref_events = _reference_simulate(
        fwd, bwd, schedule, latency, bandwidth, sizes, allreduce, grads
    )
    assert res.step_time_s == pytest.approx(step, rel=1e-9, abs=1e-12)
    np.testing.assert_allclose(res.busy_s, busy, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(res.compute_end_s, compute_end, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(res.idle_s, step - busy, rtol=1e-9, atol=1e-9)
    ours = sorted((_event_key(e), float(e["start_s"]), float(e["end_s"])) for e in res.events)
    theirs = sorted((_event_key(e), e[5], e[6]) for e in ref_events)
    assert [k for k, _, _ in ours] == [k for k, _, _ in theirs]
    np.testing.assert_allclose(
        [t for _, t, _ in ours], [t for _, t, _ in theirs], rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(
        [t for _, _, t in ours], [t for _, _, t in theirs], rtol=1e-9, atol=1e-12
    )


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"forward_s": [[1.0, np.nan]]}, r"forward_s\[replica 0, stage 0, microbatch 1\]"),
        ({"backward_s": [[1.0, -1.0]]}, r"backward_s\[replica 0, stage 0, microbatch 1\]"),
        ({"forward_s": [[1.0, np.inf]]}, "forward_s"),
        ({"forward_s": [1.0, 1.0]}, "forward_s"),
        ({"forward_s": np.ones((1, 0))}, "forward_s"),
        ({"backward_s": [[1.0, 1.0, 1.0]]}, "backward_s"),
        ({"order": "zero-bubble"}, "pipeline order"),
    ],
)
def test_bad_inputs_single_stage(kwargs, match):
    args = {"forward_s": [[1.0, 1.0]], "backward_s": [[1.0, 1.0]]}
    args.update(kwargs)
    fwd, bwd = args.pop("forward_s"), args.pop("backward_s")
    with pytest.raises(ValueError, match=match):
        simulate_pipeline(fwd, bwd, **args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"link_latency_s": [0.1]}, "link_latency_s"),
        ({"link_latency_s": [0.1, -0.1]}, r"link_latency_s\[link 1\]"),
        ({"link_bandwidth_bytes_per_s": [1.0, 0.0]}, r"link_bandwidth_bytes_per_s\[link 1\]"),
        ({"link_bandwidth_bytes_per_s": np.nan}, "link_bandwidth_bytes_per_s"),
        ({"activation_bytes": np.ones((3, 2))}, "activation_bytes"),
        ({"activation_bytes": np.ones((2, 2, 2))}, "activation_bytes"),
        (
            {"activation_bytes": [[1.0, 1.0], [1.0, -5.0]]},
            r"activation_bytes\[replica 0, link 1, microbatch 1\]",
        ),
        ({"allreduce_s": [1.0, 2.0]}, "allreduce_s"),
        ({"allreduce_s": [1.0, 2.0, np.nan]}, r"allreduce_s\[stage 2\]"),
        ({"gradient_links": [1]}, r"gradient_links must have shape \(V-1,\) = \(2,\)"),
        ({"gradient_links": [[1, 0]]}, "gradient_links"),
        ({"gradient_links": [1, 2]}, r"gradient_links\[link 1\] must be 0 or 1, got 2"),
        ({"gradient_links": [-1, 0]}, r"gradient_links\[link 0\] must be 0 or 1, got -1"),
    ],
)
def test_bad_inputs_three_stages(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate_pipeline(np.ones((3, 2)), np.ones((3, 2)), **kwargs)


def test_bad_types():
    with pytest.raises(TypeError, match="forward_s"):
        simulate_pipeline([["a"]], [[1.0]])
    with pytest.raises(TypeError, match="pipeline order"):
        simulate_pipeline([[1.0]], [[1.0]], order=1)
    with pytest.raises(TypeError, match="gradient_links"):
        simulate_pipeline([[1.0], [1.0]], [[1.0], [1.0]], gradient_links=[0.5])
    with pytest.raises(ValueError, match="stage"):
        pipeline_actions("1f1b", 3, 2, 3)
    with pytest.raises(ValueError, match="num_microbatches"):
        pipeline_actions("1f1b", 3, 0, 0)
    with pytest.raises(TypeError, match="num_stages"):
        pipeline_actions("1f1b", 3.0, 2, 0)


def test_result_arrays_are_read_only():
    res = simulate_pipeline(np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError):
        res.busy_s[0, 0] = 1.0
    assert res.events.dtype == EVENT_DTYPE


# ---- timeline export ---------------------------------------------------------------------------


def _sample_result() -> SimulationResult:
    rng = np.random.default_rng(0)
    return simulate_pipeline(
        rng.uniform(0.5, 1.5, (2, 3, 4)),
        rng.uniform(1.0, 3.0, (2, 3, 4)),
        link_latency_s=0.05,
        activation_bytes=1e8,
        link_bandwidth_bytes_per_s=1e9,
        allreduce_s=[0.3, 0.2, 0.1],
    )


def test_chrome_trace_is_valid(tmp_path):
    res = _sample_result()
    path = tmp_path / "trace.json"
    res.write_chrome_trace(path)
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert len(slices) == len(res.events)
    for e in slices:
        assert {"name", "cat", "pid", "tid", "ts", "dur"} <= e.keys()
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["ts"] >= 0 and e["dur"] >= 0
    compute = [e for e in slices if e["cat"] in ("fwd", "bwd")]
    assert {e["pid"] for e in compute} == {0, 1}
    assert {e["tid"] for e in compute} == {0, 1, 2}
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(res.step_time_s * 1e6)
    names = {e["args"]["name"] for e in meta if e["name"] in ("process_name", "thread_name")}
    assert {"replica 0", "replica 1", "stage 0", "stage 2 comm"} <= names
    # Compute slices on one track never overlap (trace viewers need proper nesting).
    for pid in (0, 1):
        for tid in (0, 1, 2):
            track = sorted(
                (e["ts"], e["ts"] + e["dur"]) for e in compute if (e["pid"], e["tid"]) == (pid, tid)
            )
            assert all(a[1] <= b[0] + 1e-6 for a, b in zip(track, track[1:]))


def test_measured_timeline_roundtrip(tmp_path):
    records = [
        {"replica": 0, "stage": 0, "kind": "fwd", "microbatch": 0, "start_s": 0.0, "end_s": 1.0},
        {"replica": 0, "stage": 1, "kind": "recv", "microbatch": 0, "start_s": 1.0, "end_s": 1.2},
        {"replica": 0, "stage": 0, "kind": "bwd", "microbatch": 0, "start_s": 3.0, "end_s": 4.0},
    ]
    events = make_events(records)
    assert events.dtype == EVENT_DTYPE and events["peer_stage"].tolist() == [-1, -1, -1]
    trace = to_chrome_trace(records)
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == 3
    write_chrome_trace(events, tmp_path / "m.json")
    json.loads((tmp_path / "m.json").read_text())
    with pytest.raises(ValueError, match=r"records\[0\] lacks key 'end_s'"):
        make_events([{"replica": 0, "stage": 0, "kind": "fwd", "microbatch": 0, "start_s": 0.0}])
    with pytest.raises(ValueError, match="ends before it starts"):
        make_events([dict(records[0], end_s=-1.0)])
    assert as_events(_sample_result()).dtype == EVENT_DTYPE


def test_gantt_png_written(tmp_path):
    pytest.importorskip("matplotlib")
    res = _sample_result()
    path = tmp_path / "gantt.png"
    res.write_gantt_png(path, title="sample")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    write_gantt_png(make_events([]), tmp_path / "empty.png")
    assert (tmp_path / "empty.png").exists()


def test_gantt_png_without_matplotlib(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"dflop\[plot\]"):
        write_gantt_png(_sample_result(), tmp_path / "x.png")
