"""Routing plan (properties), the encoder's unit split, the bridge communicator on real gloo
processes (features to the right LLM replica in recv order, gradients back; uneven and
empty transfers; debug-header mismatch; timeouts), and spawn_local's failure handling."""

from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import dflop  # noqa: E402
from dflop.runtime import (  # noqa: E402
    RuntimeLayout,
    SpawnError,
    Topology,
    plan_routing,
    spawn_local,
    split_units,
)

SPAWN_TIMEOUT_S = 60.0
HIDDEN = 4

# ---- routing plan -----------------------------------------------------------------------


@st.composite
def _routing_inputs(draw):
    num_src = draw(st.integers(1, 4))
    num_dst = draw(st.integers(1, 4))
    n = draw(st.integers(0, 25))
    src = draw(st.lists(st.integers(0, num_src - 1), min_size=n, max_size=n))
    dst = draw(st.lists(st.integers(0, num_dst - 1), min_size=n, max_size=n))
    rows = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    ids = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n, unique=True))
    return num_src, num_dst, np.array(src), np.array(dst), np.array(rows), np.array(ids)


@settings(max_examples=150, deadline=None)
@given(_routing_inputs())
def test_plan_routes_every_item_exactly_once(case) -> None:
    num_src, num_dst, src, dst, rows, ids = case
    plan = plan_routing(
        src.astype(np.int64),
        dst.astype(np.int64),
        rows.astype(np.int64),
        num_src=num_src,
        num_dst=num_dst,
        item_ids=ids.astype(np.int64),
    )
    assert plan.send_counts.shape == (num_src, num_dst)
    position = {int(s): p for p, s in enumerate(ids)}
    routed = []
    for s in range(num_src):
        expected_send = []
        for d in range(num_dst):
            pair = plan.pair_items(s, d).tolist()
            routed += pair
            expected_send += pair
            assert [position[i] for i in pair] == sorted(position[i] for i in pair)
            assert all(src[position[i]] == s and dst[position[i]] == d for i in pair)
            assert plan.send_counts[s, d] == sum(rows[position[i]] for i in pair)
        assert plan.send_order[s].tolist() == expected_send
        assert plan.send_rows(s) == rows[src == s].sum()
    assert sorted(routed) == sorted(ids.tolist())
    for d in range(num_dst):
        assert plan.recv_order[d].tolist() == ids[dst == d].tolist()
        assert plan.recv_rows(d) == rows[dst == d].sum()
        # Rows arrive pair by pair (src ascending); the arrival index puts them in recv order.
        arrived = [i for s in range(num_src) for i in plan.pair_items(s, d).tolist()]
        arrived_rows = np.array([i for i in arrived for _ in range(rows[position[i]])], np.int64)
        wanted = [i for i in plan.recv_order[d].tolist() for _ in range(rows[position[i]])]
        assert arrived_rows[plan.recv_arrival_index(d)].tolist() == wanted


def test_plan_errors_name_argument_and_index() -> None:
    with pytest.raises(ValueError, match=r"rows\[2\]=-1"):
        plan_routing([0, 0, 0], [0, 0, 0], [1, 2, -1])
    with pytest.raises(ValueError, match=r"src_replica\[1\]=3"):
        plan_routing([0, 3], [0, 0], [1, 1], num_src=2)
    with pytest.raises(ValueError, match=r"dst_replica\[0\]=-1"):
        plan_routing([0], [-1], [1], num_dst=2)
    with pytest.raises(ValueError, match="rows has length 1"):
        plan_routing([0, 0], [0, 0], [1])
    with pytest.raises(ValueError, match="distinct"):
        plan_routing([0, 0], [0, 0], [1, 1], item_ids=[5, 5])
    with pytest.raises(TypeError, match="integer"):
        plan_routing([0.5], [0], [1])


def test_split_units_balances_each_microbatch_by_unit() -> None:
    rng = np.random.default_rng(3)
    units = rng.integers(0, 12, size=40)
    costs = units * 0.25  # every unit costs the same
    schedule = dflop.schedule(np.stack([costs, rng.pareto(1.5, 40)], 1), 4, dp_size=2)
    for mb in range(4):
        ids = schedule.microbatch(mb)
        split = split_units(units[ids], costs[ids], 3, sample_ids=ids)
        # Optimal with equal unit costs: ceil(units / replicas) units on the busiest.
        assert split.replica_units.max() == -(-units[ids].sum() // 3)
        assert split.makespan == pytest.approx(0.25 * split.replica_units.max())
        # Every unit of every sample exactly once, pieces in (sample, unit) order.
        for i in ids:
            mine = np.flatnonzero(split.sample_ids == i)
            starts = split.first_unit[mine]
            assert starts.tolist() == sorted(starts.tolist())
            assert split.num_units[mine].sum() == units[i]
        assert np.array_equal(np.unique(split.sample_ids), np.sort(ids[units[ids] > 0]))
        for r in range(3):
            assert split.num_units[split.pieces_of(r)].sum() == split.replica_units[r]
        again = split_units(units[ids], costs[ids], 3, sample_ids=ids)  # deterministic
        assert np.array_equal(again.replica, split.replica)
        whole = split_units(units[ids], costs[ids], 3, sample_ids=ids, granularity="sample")
        assert np.array_equal(whole.num_units, units[np.sort(ids[units[ids] > 0])])
        assert whole.makespan >= split.makespan
    with pytest.raises(ValueError, match=r"costs\[1\]=-1"):
        split_units([1, 1], [1.0, -1.0], 2)
    with pytest.raises(ValueError, match=r"units\[0\]=0"):
        split_units([0], [1.0], 2)
    with pytest.raises(ValueError, match="one entry per sample"):
        split_units([1, 2], [1.0], 2)
    with pytest.raises(ValueError, match="granularity"):
        split_units([1], [1.0], 2, granularity="tile")


# ---- the communicator on real processes --------------------------------------------------

# Microbatches for encoder dp=2 -> LLM dp=2: (sample ids, src, dst, rows). mb 1: encoder
# replica 0 sends nothing and LLM replica 1 receives nothing; mb 2: only zero-row samples.
MICROBATCHES = [
    ([10, 11, 12, 13, 14, 15], [0, 1, 0, 1, 1, 0], [1, 0, 0, 1, 1, 0], [3, 0, 5, 2, 4, 1]),
    ([20, 21, 22], [1, 1, 1], [0, 0, 0], [2, 0, 7]),
    ([30, 31, 32, 33], [0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]),
    (
        [40, 41, 42, 43, 44, 45, 46],
        [1, 0, 0, 1, 0, 1, 1],
        [1, 1, 0, 0, 1, 0, 1],
        [1, 6, 2, 3, 0, 4, 5],
    ),
]


def _plan(mb: int):
    ids, src, dst, rows = MICROBATCHES[mb]
    return plan_routing(src, dst, rows, num_src=2, num_dst=2, item_ids=ids)


def _feature(sample_id: int, rows: int) -> torch.Tensor:
    """Features that say where they come from: sample id, row and column."""
    r = torch.arange(rows, dtype=torch.float32).unsqueeze(1)
    c = torch.arange(HIDDEN, dtype=torch.float32).unsqueeze(0)
    return sample_id * 100.0 + r + c / 8.0


def _grad(feature: torch.Tensor) -> torch.Tensor:
    return 2.0 * feature + 1.0


def _encoder_side(comm, src: int, debug_round: bool) -> list[str]:
    checks = []
    pending = []
    order = [0, 1, 2, 3] if not debug_round else [0, 3]
    # Gloo sends complete only once the receive is posted, so, like a 1F1B stage, post the
    # gradient receives before blocking on sends.
    grad_recvs = {
        mb: comm.recv_grads(mb, _plan(mb), as_tensor=mb % 2 == 1, wait=False) for mb in order
    }
    for mb in order:
        plan = _plan(mb)
        ids = plan.send_order[src].tolist()
        feats = {i: _feature(i, int(plan.rows_of([i])[0])) for i in ids}
        if mb % 2 == 0:  # dict form, asynchronous
            pending.append(comm.send_features(mb, plan, feats, wait=False))
        else:  # one tensor in send order
            tensor = torch.cat([feats[i] for i in ids] + [torch.zeros(0, HIDDEN)])
            comm.send_features(mb, plan, tensor)
    for transfer in pending:
        transfer.wait()
    # Gradients in another order than the LLM sends them (the transfers are tagged).
    for mb in reversed(order):
        plan = _plan(mb)
        ids = plan.send_order[src].tolist()
        as_tensor = mb % 2 == 1
        grads = grad_recvs[mb].wait()
        expected = {i: _grad(_feature(i, int(plan.rows_of([i])[0]))) for i in ids}
        if as_tensor:
            want = torch.cat([expected[i] for i in ids] + [torch.zeros(0, HIDDEN)])
            ok = torch.equal(grads, want)
        else:
            ok = list(grads) == ids and all(torch.equal(grads[i], expected[i]) for i in ids)
        checks.append(f"enc{src} mb{mb} grads {'ok' if ok else 'WRONG'}")
    return checks


def _llm_side(comm, dst: int, debug_round: bool) -> list[str]:
    checks = []
    order = [0, 1, 2, 3] if not debug_round else [0, 3]
    # Post every receive first (asynchronous), then consume in order.
    pending = {
        mb: comm.recv_features(mb, _plan(mb), as_tensor=mb % 2 == 1, wait=False) for mb in order
    }
    for mb in order:
        plan = _plan(mb)
        ids = plan.recv_order[dst].tolist()
        got = pending[mb].wait()
        expected = {i: _feature(i, int(plan.rows_of([i])[0])) for i in ids}
        if mb % 2 == 1:
            want = torch.cat([expected[i] for i in ids] + [torch.zeros(0, HIDDEN)])
            ok = torch.equal(got, want)
            grads = _grad(got)
        else:
            ok = list(got) == ids and all(torch.equal(got[i], expected[i]) for i in ids)
            grads = {i: _grad(t) for i, t in got.items()}
        checks.append(f"llm{dst} mb{mb} features {'ok' if ok else 'WRONG'}")
        comm.send_grads(mb, plan, grads)
    return checks


def _communicator_worker(rank: int, world_size: int, layout: RuntimeLayout) -> dict:
    from dflop.runtime import BridgeCommunicator

    topo = Topology.create(layout, timeout_s=30)
    out: dict = {"checks": []}
    side = _encoder_side if topo.info.is_bridge_sender else _llm_side
    replica = topo.info.dp_rank

    # 1. Roundtrip, then again with debug headers.
    for debug in (False, True):
        comm = BridgeCommunicator(topo, HIDDEN, torch.float32, debug=debug, timeout_s=20)
        out["checks"] += side(comm, replica, debug)

    # 2. Debug mismatch: LLM replica 0 believes sample 11 (from encoder 1) has 4 rows, not 0.
    comm = BridgeCommunicator(topo, HIDDEN, torch.float32, debug=True, timeout_s=20)
    mb = 7
    ids, src, dst, rows = MICROBATCHES[0]
    plan = plan_routing(src, dst, rows, num_src=2, num_dst=2, item_ids=ids)
    if topo.info.is_bridge_sender:
        feats = {i: _feature(i, int(plan.rows_of([i])[0])) for i in plan.send_order[replica]}
        # LLM 0 rejects the header but drains the data, so this send completes.
        comm.send_features(mb, plan, feats)
    elif replica == 0:
        wrong = plan_routing(src, dst, [3, 4, 5, 2, 4, 1], num_src=2, num_dst=2, item_ids=ids)
        try:
            comm.recv_features(mb, wrong)
            out["mismatch"] = "no error"
        except RuntimeError as error:
            out["mismatch"] = str(error)
    else:
        comm.recv_features(mb, plan)

    # 3. A receive nobody answers times out with a clear message instead of hanging.
    comm = BridgeCommunicator(topo, HIDDEN, torch.float32, timeout_s=1.0)
    if rank == world_size - 1:
        start = time.monotonic()
        try:
            comm.recv_features(99, _plan(0))
            out["timeout"] = "no error"
        except RuntimeError as error:
            out["timeout"] = str(error)
        out["timeout_s"] = time.monotonic() - start
    # Nobody may leave while the last rank still waits on its (unanswered) receive.
    torch.distributed.barrier()
    return out


def test_communicator_roundtrip_debug_and_timeout() -> None:
    layout = RuntimeLayout.simple(
        encoder_dp=2, llm_dp=2, encoder_layers=1, llm_layers=1, num_microbatches=4, global_batch=8
    )
    results = spawn_local(_communicator_worker, 4, args=(layout,), timeout_s=SPAWN_TIMEOUT_S)
    checks = [c for r in results for c in r["checks"]]
    assert checks and all(c.endswith("ok") for c in checks), checks
    assert len(checks) == 2 * 2 * (4 + 2)  # 2 ranks per side x 2 sides x (4 + 2) microbatches

    mismatch = results[2]["mismatch"]
    assert "mismatch" in mismatch and "microbatch 7" in mismatch, mismatch
    assert "rank 1 (encoder replica 1)" in mismatch and "rank 2 (LLM replica 0)" in mismatch
    assert "shape: sent (0, 4), expected (4, 4)" in mismatch

    timeout = results[3]["timeout"]
    assert "rank 3" in timeout and "microbatch 99" in timeout and "timed out" in timeout, timeout
    assert results[3]["timeout_s"] < 10


def test_communicator_rejects_non_bridge_rank_and_bad_inputs() -> None:
    results = spawn_local(_misuse_worker, 3, timeout_s=SPAWN_TIMEOUT_S)
    assert "not a bridge rank" in results[2]
    assert "shape (2, 4), the plan expects (3, 4)" in results[0]


def _misuse_worker(rank: int, world_size: int) -> str:
    from dflop.runtime import BridgeCommunicator

    # Encoder 1 rank, LLM pp=2: rank 2 (second LLM stage) is not on the bridge.
    layout = RuntimeLayout.simple(
        llm_pp=2, encoder_layers=1, llm_layers=2, num_microbatches=1, global_batch=2
    )
    topo = Topology.create(layout, timeout_s=30)
    if rank == 2:
        try:
            BridgeCommunicator(topo, HIDDEN)
        except ValueError as error:
            return str(error)
        return "no error"
    comm = BridgeCommunicator(topo, HIDDEN)
    if rank == 0:
        plan = plan_routing([0, 0], [0, 0], [1, 2])
        try:
            comm.send_features(0, plan, torch.zeros(2, HIDDEN))
        except ValueError as error:
            return str(error)
    return ""


# ---- spawn_local failure handling ---------------------------------------------------------


def _failing_worker(rank: int, world_size: int, how: str) -> int:
    import torch.distributed as dist

    if rank == 1:
        if how == "raise":
            raise ValueError("boom from rank 1")
        if how == "exit":
            os._exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":
        time.sleep(60)
    dist.barrier()  # the healthy ranks wait here for the failed one, until killed
    return rank


@pytest.mark.parametrize(
    ("how", "needle"),
    [
        ("raise", "rank 1 of 3 failed:\nValueError: boom from rank 1"),
        ("exit", "rank 1 of 3 exited with code 3"),
        ("kill", "rank 1 of 3 was killed by SIGKILL"),
        ("hang", "timed out after 2 s"),
    ],
)
def test_spawn_local_fails_fast_and_clearly(how: str, needle: str) -> None:
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn_local(_failing_worker, 3, args=(how,), timeout_s=2.0 if how == "hang" else 30.0)
    assert needle in str(info.value)
    assert time.monotonic() - start < 15
    if how != "hang":
        assert info.value.rank == 1


def test_spawn_local_returns_results_in_rank_order() -> None:
    assert spawn_local(_failing_worker, 2, args=("none",), timeout_s=30) == [0, 1]


# ---- a local run listens on loopback only -------------------------------------------------


def _listening_addresses(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process ``pid`` listens on (what ``ss -ltn``
    lists for it), read from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                # /proc prints the address as host-order 32-bit words.
                words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
                addr = b"".join(words)
                if width == 8:
                    text = socket.inet_ntop(socket.AF_INET, addr)
                else:
                    text = socket.inet_ntop(socket.AF_INET6, addr)
                out.append(f"{text}:{int(hex_port, 16)}")
    return out


def _listening_worker(rank: int, world_size: int, launcher_pid: int) -> dict[int, list[str]]:
    import torch
    import torch.distributed as dist

    tensor = torch.ones(4)
    dist.all_reduce(tensor)  # gloo's pairs are connected: its listeners exist
    dist.barrier()
    mine = {os.getpid(): _listening_addresses(os.getpid())}
    if rank == 0:
        mine[launcher_pid] = _listening_addresses(launcher_pid)
    dist.barrier()  # every rank read its sockets while all are up
    return mine


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")


@pytest.mark.skipif(not os.path.isdir("/proc/self/net"), reason="reads /proc (Linux)")
def test_a_local_run_listens_on_loopback_only() -> None:
    """The rendezvous store (hosted by the launcher) and gloo's sockets (in the ranks)
    accept no connection from another machine: every listening socket of the run is on
    127.0.0.0/8."""
    results = spawn_local(_listening_worker, 2, args=(os.getpid(),), timeout_s=60)
    sockets = {pid: addrs for result in results for pid, addrs in result.items()}
    assert sockets[os.getpid()], "the launcher's rendezvous store should be listening"
    outside = {pid: [a for a in addrs if not _is_loopback(a)] for pid, addrs in sockets.items()}
    assert not any(outside.values()), f"listening outside loopback: {outside}"
