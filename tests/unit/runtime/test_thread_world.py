"""The thread world (dflop.runtime.thread_world / dist / launch.spawn_threads): ranks as
threads of one process, for ranks that share one GPU. The pipeline engine and the bridge
run on it unchanged; a step gives the single-process loss and gradients, as over gloo."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dflop.runtime import SpawnError, dist, spawn_threads  # noqa: E402
from dflop.runtime.thread_world import ThreadWorld  # noqa: E402
from dflop.runtime.topology import Topology  # noqa: E402
from engine_harness import (  # noqa: E402
    ASSIGN_A,
    ASSIGN_B,
    ASSIGN_C,
    CONFIG,
    DEEP_CONFIG,
    LAYOUT_A,
    LAYOUT_B,
    LAYOUT_C,
    LAYOUT_D,
    NEWLINE_CONFIG,
    _check_against_reference,
    _layout,
    _rank_step,
)

TIMEOUT_S = 60.0


@pytest.mark.parametrize(
    "spec, assignment, debug, config",
    [
        (LAYOUT_A, ASSIGN_A, False, None),
        (LAYOUT_B, ASSIGN_B, True, None),
        (LAYOUT_C, ASSIGN_C, False, NEWLINE_CONFIG),
        (LAYOUT_D, ASSIGN_A, False, DEEP_CONFIG),
        (dict(encoder_pp=2, llm_dp=2, llm_pp=2, num_microbatches=2), ASSIGN_B, True, None),
    ],
    ids=["enc_dp2_llm_pp2", "llm_dp2_debug", "enc_dp3_newline", "interleaved", "6_ranks_debug"],
)
def test_pipeline_step_on_threads_matches_single_process(spec, assignment, debug, config):
    extra = () if config is None else (config,)
    world_size = _layout(spec, *extra).world_size
    results = spawn_threads(
        _rank_step, world_size, args=(spec, assignment, debug, False, *extra), timeout_s=TIMEOUT_S
    )
    _check_against_reference(results, *extra)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec, assignment", [(LAYOUT_A, ASSIGN_A), (LAYOUT_C, ASSIGN_C)])
def test_pipeline_step_of_ranks_sharing_one_gpu_matches_single_process(
    spec, assignment, monkeypatch
):
    """Every rank on the one GPU, each computing on its own stream, messages copied on the
    world's stream. (torch's CUDA sanitizer only sees the thread that enabled it, not the
    rank threads: the stream order is tested directly below.)"""
    world_size = _layout(spec).world_size
    # Full fp32 (cuDNN would use TF32 for the patch embedding): compared with the CPU.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    results = spawn_threads(
        _rank_step, world_size, args=(spec, assignment, False, False, CONFIG, "cuda:0"),
        timeout_s=TIMEOUT_S, device="cuda:0",
    )  # fmt: skip
    _check_against_reference(results)


def _producer_behind_a_sleep(rank: int, world_size: int) -> list:
    """Rank 0 makes what it sends and reduces behind a long GPU sleep on its own stream:
    a copy or reduction not ordered after the producer would read stale values."""
    device = torch.device("cuda:0")
    if rank == 0:
        sent = torch.zeros(1 << 20, device=device)
        reduced = torch.ones(4, device=device)
        torch.cuda._sleep(300_000_000)  # ~0.2 s of GPU cycles on this rank's stream
        sent.fill_(3.0)
        reduced.add_(1.0)
        work = dist.isend(sent, 1, tag=0)
        dist.all_reduce(reduced)
        work.wait()
        return reduced.cpu().tolist()
    got = torch.empty(1 << 20, device=device)
    dist.irecv(got, 0, tag=0).wait()
    reduced = torch.full((4,), 5.0, device=device)
    dist.all_reduce(reduced)
    return [got.min().item(), got.max().item(), *reduced.cpu().tolist()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_transfers_and_reductions_wait_for_the_producers_stream():
    results = spawn_threads(_producer_behind_a_sleep, 2, timeout_s=TIMEOUT_S, device="cuda:0")
    assert results == [[7.0] * 4, [3.0, 3.0, *[7.0] * 4]]


def test_thread_world_reports_a_plan_mismatch():
    spec = dict(encoder_pp=2, num_microbatches=2)
    assignment = [0, 0, 1, 1, 0, 1, 1, 0]
    with pytest.raises(
        SpawnError, match=r"rank 1 of 3 failed:\n.*rank 1 expected the activation of microbatch 0"
    ):
        spawn_threads(_rank_step, 3, args=(spec, assignment, True, True), timeout_s=TIMEOUT_S)


def _collectives(rank: int, world_size: int) -> dict:
    group = dist.new_group([1, 0])  # torch orders a group's ranks ascending
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    peak = torch.tensor([rank * 10])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    source = torch.full((3,), float(rank))
    dist.broadcast(source, src=2)
    in_group = torch.tensor([float(rank)]) if rank < 2 else None
    if in_group is not None:
        dist.all_reduce(in_group, group=group)
    objects = [None, None, None]
    dist.all_gather_object(objects, {"rank": rank})
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(rank * 2, gathered, dst=0)
    payload = [None]
    if rank == 1:
        payload = [["from", 1]]
    dist.broadcast_object_list(payload, src=1)
    # Point to point: a ring, sends posted before receives, and a receive posted first.
    out = torch.arange(4, dtype=torch.float32) + rank
    got = torch.empty(4)
    send = dist.isend(out, (rank + 1) % world_size, tag=5)
    dist.irecv(got, (rank - 1) % world_size, tag=5).wait()
    send.wait()
    # The same tag in two groups: each message reaches its own group's receive.
    by_group = []
    if rank < 2:
        mine, theirs = torch.tensor([rank * 1.0]), torch.tensor([rank + 10.0])
        sends = [dist.isend(mine, 1 - rank, tag=1), dist.isend(theirs, 1 - rank, group, tag=1)]
        got_world, got_group = torch.empty(1), torch.empty(1)
        dist.irecv(got_group, 1 - rank, group, tag=1).wait()
        dist.irecv(got_world, 1 - rank, tag=1).wait()
        for work in sends:
            work.wait()
        by_group = [got_world.item(), got_group.item()]
    dist.barrier()
    return {
        "sum": value.item(),
        "max": peak.item(),
        "broadcast": source.tolist(),
        "group": None if in_group is None else in_group.item(),
        "group_rank": dist.get_rank(group) if rank < 2 else None,
        "objects": objects,
        "gathered": gathered,
        "payload": payload,
        "ring": got.tolist(),
        "by_group": by_group,
        "backend": dist.get_backend(),
    }


def test_collectives_and_transfers_follow_torch_distributed():
    results = spawn_threads(_collectives, 3, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["sum"] == 6.0 and r["max"] == 20
        assert r["broadcast"] == [2.0, 2.0, 2.0]
        assert r["objects"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert r["payload"] == [["from", 1]]
        assert r["ring"] == (np.arange(4) + (rank - 1) % 3).tolist()
        assert r["backend"] == dist.THREADS
    assert [r["group"] for r in results] == [1.0, 1.0, None]
    assert [r["group_rank"] for r in results] == [0, 1, None]
    assert [r["by_group"] for r in results] == [[1.0, 11.0], [0.0, 10.0], []]
    assert results[0]["gathered"] == [0, 2, 4] and results[1]["gathered"] is None
    # Objects cross ranks as copies, as between processes.
    assert results[0]["objects"][1] is not results[2]["objects"][1]


def _fails_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one's bad input")
    dist.barrier()  # the others wait here until the world is aborted


def test_a_failing_rank_stops_the_others_and_is_named():
    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"rank 1 of 3 failed:\nValueError: rank one's bad input"):
        spawn_threads(_fails_on_rank_one, 3, timeout_s=TIMEOUT_S)
    assert time.monotonic() - start < 10


def _mismatched(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.isend(torch.zeros(3), 1, tag=1).wait()
    else:
        dist.irecv(torch.zeros(4), 0, tag=1).wait()


def _silent_peer(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.irecv(torch.zeros(1), 1, tag=0).wait()
    else:
        time.sleep(0.3)  # its own wait would time out 0.3 s after rank 0's
        dist.barrier()  # woken when rank 0 times out: a consequence, not the cause


def _different_collectives(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()
    else:
        dist.all_reduce(torch.zeros(1))


def test_transport_errors_are_named_not_hangs():
    with pytest.raises(SpawnError, match=r"rank 0 sent \(3,\) torch.float32 to rank 1 \(tag 1\)"):
        spawn_threads(_mismatched, 2, timeout_s=TIMEOUT_S)
    with pytest.raises(
        SpawnError,
        match=r"rank 0 of 2 failed:\nRuntimeError: rank 0 receiving from rank 1 \(tag 0\) timed",
    ):
        spawn_threads(_silent_peer, 2, timeout_s=TIMEOUT_S, collective_timeout_s=0.5)
    with pytest.raises(SpawnError, match=r"is a (barrier|all_reduce\(sum\)) on another rank"):
        spawn_threads(_different_collectives, 2, timeout_s=TIMEOUT_S)


def test_thread_world_validates_its_arguments():
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        ThreadWorld(0)
    world = ThreadWorld(2)
    with pytest.raises(ValueError, match=r"rank 0: dst=0 must be another rank of ThreadGroup"):
        world.isend(0, torch.zeros(1), 0, 0, world.world_group)
    with pytest.raises(ValueError, match=r"rank 0: isend needs a contiguous tensor, got shape"):
        world.isend(0, torch.zeros(2, 3).t(), 1, 0, world.world_group)
    with pytest.raises(ValueError, match=r"group ranks \[0, 2\] must be in \[0, 2\)"):
        world.new_group(0, [0, 2])
    with pytest.raises(ValueError, match="rank must be in"):
        world.join(2)


def test_topology_groups_on_threads():
    layout = _layout(LAYOUT_A)

    def create(rank: int, world_size: int):
        topology = Topology.create(layout, rank)
        return topology.dp_ranks, topology.bridge_group is not None

    results = spawn_threads(create, layout.world_size, timeout_s=TIMEOUT_S)
    assert [r[0] for r in results] == [(0, 1), (0, 1), (2,), (3,)]
    assert [r[1] for r in results] == [True, True, True, False]


def test_hf_stages_built_on_rank_threads_get_the_seeds_weights():
    """A Hugging Face model is built from the process's seeded RNG: rank threads building
    at once must each get the seed's weights, and leave the RNG as they found it. (A
    thread drawing from torch's global RNG during a build would still change it; the
    runtime draws none: dflop's own models seed a generator per parameter.)"""
    pytest.importorskip("transformers")
    import threading

    from dflop.models.hf import spec_from_config
    from dflop.models.hf.tiny import tiny_llava_onevision_config
    from dflop.runtime.topology import RuntimeLayout, rank_info

    spec = spec_from_config(tiny_llava_onevision_config())
    layout = RuntimeLayout.simple(
        encoder_layers=2, llm_layers=2, global_batch=4, num_microbatches=1
    )
    info = rank_info(layout, 0)
    states: list[dict] = []

    def build() -> None:
        stage = spec.build_stage(info, seed=5)
        states.append({k: v.clone() for k, v in stage.state_dict().items()})

    torch.manual_seed(123)
    before = torch.get_rng_state()
    builders = [threading.Thread(target=build) for _ in range(4)]
    for thread in builders:
        thread.start()
    for thread in builders:
        thread.join(120)
    assert torch.equal(torch.get_rng_state(), before)
    alone = spec.build_stage(info, seed=5).state_dict()
    assert len(states) == 4
    for state in states:
        assert state.keys() == alone.keys()
        assert all(torch.equal(state[k], alone[k]) for k in alone)
