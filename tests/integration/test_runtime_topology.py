"""Runtime layout: pure rank placement on several layouts, validation, serialisation, and
the process groups on real gloo processes (membership checked with all_reduce)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

torch = pytest.importorskip("torch")

from dflop.runtime import (  # noqa: E402
    ModuleLayout,
    RuntimeLayout,
    Topology,
    rank_info,
    spawn_local,
    uniform_layer_ranges,
)

SPAWN_TIMEOUT_S = 60.0


def _layout(enc=(1, 1, 1), llm=(1, 1, 1), enc_layers=4, llm_layers=6, m=2, batch=8):
    """A layout from (tp, pp, dp) triples with uniform layer splits."""
    return RuntimeLayout(
        ModuleLayout(*enc, uniform_layer_ranges(enc_layers, enc[1])),
        ModuleLayout(*llm, uniform_layer_ranges(llm_layers, llm[1])),
        num_microbatches=m,
        global_batch=batch,
    )


LAYOUTS = [
    _layout(),
    _layout(enc=(1, 1, 2), llm=(1, 2, 1)),
    _layout(enc=(2, 2, 1), llm=(1, 3, 2), enc_layers=5, llm_layers=7),
    _layout(enc=(1, 3, 2), llm=(2, 2, 3), enc_layers=3, llm_layers=9, batch=12),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"world{lay.world_size}")
def test_rank_info_matches_the_documented_formula(layout: RuntimeLayout) -> None:
    seen = set()
    pe = layout.encoder.pp
    for name, first in (("encoder", 0), ("llm", layout.encoder.num_gpus)):
        mod = layout.module(name)
        for d, p, t in itertools.product(range(mod.dp), range(mod.pp), range(mod.tp)):
            rank = first + (d * mod.pp + p) * mod.tp + t
            assert layout.rank_of(name, d, p, t) == rank
            info = rank_info(layout, rank)
            seen.add(rank)
            assert (info.module, info.dp_rank, info.pp_rank, info.tp_rank) == (name, d, p, t)
            assert info.global_stage == (p if name == "encoder" else pe + p)
            assert info.num_global_stages == pe + layout.llm.pp
            assert info.layer_range == mod.layer_ranges[p]
            assert info.prev_rank == (rank - mod.tp if p > 0 else None)
            assert info.next_rank == (rank + mod.tp if p < mod.pp - 1 else None)
            if info.next_rank is not None:
                nxt = rank_info(layout, info.next_rank)
                assert (nxt.module, nxt.dp_rank, nxt.tp_rank) == (name, d, t)
                assert nxt.pp_rank == p + 1
            assert info.is_bridge_sender == (name == "encoder" and p == pe - 1 and t == 0)
            assert info.is_bridge_receiver == (name == "llm" and p == 0 and t == 0)
    assert seen == set(range(layout.world_size))
    senders = [r for r in range(layout.world_size) if rank_info(layout, r).is_bridge_sender]
    receivers = [r for r in range(layout.world_size) if rank_info(layout, r).is_bridge_receiver]
    assert layout.bridge_ranks == tuple(senders + receivers)
    assert len(senders) == layout.encoder.dp and len(receivers) == layout.llm.dp
    assert [layout.encoder_bridge_rank(d) for d in range(layout.encoder.dp)] == senders


@pytest.mark.parametrize("pp,v", [(2, 2), (3, 2), (2, 3)])
def test_chunk_neighbours_point_at_each_other(pp: int, v: int) -> None:
    """Interleaved LLM chunks: the next virtual stage of every chunk is a chunk whose
    previous one is it (rank and chunk index), across the last stage -> first wrap."""
    from dflop.runtime.topology import chunk_infos

    layout = RuntimeLayout(
        ModuleLayout(1, 1, 1, uniform_layer_ranges(2, 1)),
        ModuleLayout(1, pp, 1, uniform_layer_ranges(pp * v, pp * v), virtual_stages=v),
        num_microbatches=pp,
        global_batch=2 * pp,
    )
    chunks = {
        (ci.rank, ci.chunk): ci
        for r in range(1, layout.world_size)
        for ci in chunk_infos(layout, r)
    }
    by_stage = {ci.virtual_stage: ci for ci in chunks.values()}
    assert sorted(by_stage) == list(range(1, 1 + pp * v))  # after the encoder's stage 0
    for stage, ci in by_stage.items():
        if stage + 1 in by_stage:
            nxt = by_stage[stage + 1]
            assert (ci.next_rank, ci.next_chunk) == (nxt.rank, nxt.chunk)
            assert (nxt.prev_rank, nxt.prev_chunk) == (ci.rank, ci.chunk)


def test_rank_info_rejects_bad_ranks() -> None:
    layout = LAYOUTS[1]
    with pytest.raises(ValueError, match="rank=4"):
        rank_info(layout, 4)
    with pytest.raises(ValueError, match="rank=-1"):
        rank_info(layout, -1)
    with pytest.raises(TypeError):
        rank_info(layout, 1.0)  # type: ignore[arg-type]


def test_layout_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"ModuleLayout\.tp"):
        ModuleLayout(0, 1, 1, ((0, 1),))
    with pytest.raises(TypeError, match=r"ModuleLayout\.dp"):
        ModuleLayout(1, 1, 1.5, ((0, 1),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"layer_ranges has 1 ranges but pp=2"):
        ModuleLayout(1, 2, 1, ((0, 1),))
    with pytest.raises(ValueError, match=r"layer_ranges\[1\]=\(3, 4\)"):
        ModuleLayout(1, 2, 1, ((0, 2), (3, 4)))
    with pytest.raises(ValueError, match=r"layer_ranges\[0\]"):
        ModuleLayout(1, 1, 1, ((1, 4),))
    enc = ModuleLayout(1, 1, 1, ((0, 2),))
    llm = ModuleLayout(1, 1, 2, ((0, 2),))
    with pytest.raises(ValueError, match=r"RuntimeLayout\.num_microbatches"):
        RuntimeLayout(enc, llm, num_microbatches=0, global_batch=4)
    with pytest.raises(ValueError, match=r"RuntimeLayout\.global_batch=3"):
        RuntimeLayout(enc, llm, num_microbatches=2, global_batch=3)
    # An empty stage (a last encoder stage holding only the projector) is allowed.
    assert ModuleLayout(1, 2, 1, ((0, 2), (2, 2))).num_layers == 2


def test_simple_uniform_split_and_dict_roundtrip() -> None:
    layout = RuntimeLayout.simple(
        encoder_dp=2,
        llm_pp=3,
        encoder_layers=4,
        llm_layers=8,
        num_microbatches=4,
        global_batch=16,
    )
    assert layout.llm.layer_ranges == ((0, 3), (3, 6), (6, 8))
    assert layout.encoder.layer_ranges == ((0, 4),)
    assert layout.world_size == 5
    data = layout.to_dict()
    assert RuntimeLayout.from_dict(data) == layout
    import json

    assert RuntimeLayout.from_dict(json.loads(json.dumps(data))) == layout
    with pytest.raises(ValueError, match="lacks"):
        RuntimeLayout.from_dict({"encoder": data["encoder"]})
    assert uniform_layer_ranges(2, 3) == ((0, 1), (1, 2), (2, 2))


# ---- process groups on real gloo processes ----------------------------------------------


def _members(group: object, rank: int, world_size: int) -> list[int]:
    """Members of ``group`` as seen through an all_reduce of one-hot rank vectors."""
    import torch.distributed as dist

    onehot = torch.zeros(world_size)
    onehot[rank] = 1.0
    dist.all_reduce(onehot, group=group)
    return [r for r in range(world_size) if onehot[r] > 0]


def _groups_worker(rank: int, world_size: int, layouts: list[RuntimeLayout]) -> list[dict]:
    out = []
    for layout in layouts:
        topo = Topology.create(layout, timeout_s=30)
        out.append(
            {
                "dp": _members(topo.dp_group, rank, world_size),
                "dp_ranks": list(topo.dp_ranks),
                "tp": _members(topo.tp_group, rank, world_size),
                "tp_ranks": list(topo.tp_ranks),
                "bridge": (
                    _members(topo.bridge_group, rank, world_size)
                    if topo.bridge_group is not None
                    else None
                ),
                "info": topo.info,
            }
        )
    return out


def test_a_colocated_layout_has_no_encoder_ranks() -> None:
    """The encoder runs on the LLM's first-stage ranks (with its tp and dp): the world is
    the LLM's, the pipeline its stages, no bridge; a mismatched encoder layout or
    interleaving is refused, naming the field."""
    layout = RuntimeLayout.simple(
        llm_dp=2,
        llm_pp=2,
        llm_tp=2,
        encoder_layers=3,
        llm_layers=4,
        num_microbatches=2,
        global_batch=8,
        colocated=True,
    )
    assert layout.world_size == 8 and layout.num_global_stages == 2
    assert layout.pipeline_stages == ([2], [1]) and layout.bridge_ranks == ()
    assert layout.encoder == ModuleLayout(2, 1, 2, ((0, 3),))
    assert RuntimeLayout.from_dict(layout.to_dict()) == layout
    for rank in range(8):
        info = rank_info(layout, rank)
        assert info.module == "llm" and info.global_stage == info.pp_rank
        assert info.holds_encoder == (info.pp_rank == 0)
        assert not (info.is_bridge_sender or info.is_bridge_receiver)
        if info.holds_encoder:  # the encoder's rank of that replica and TP index
            assert layout.rank_of("encoder", info.dp_rank, 0, info.tp_rank) == rank
    with pytest.raises(ValueError, match=r"encoder \(pp=2, tp=1, dp=1\) must be pp=1, tp=2, dp=2"):
        RuntimeLayout(
            ModuleLayout(1, 2, 1, ((0, 1), (1, 3))),
            layout.llm,
            num_microbatches=2,
            global_batch=8,
            colocated=True,
        )
    with pytest.raises(ValueError, match=r"encoder.recompute=True must equal llm.recompute=False"):
        RuntimeLayout(
            dataclasses.replace(layout.encoder, recompute=True),
            layout.llm,
            num_microbatches=2,
            global_batch=8,
            colocated=True,
        )
    with pytest.raises(ValueError, match="virtual_stages=2: a colocated layout"):
        RuntimeLayout.simple(
            llm_pp=2,
            llm_virtual_stages=2,
            encoder_layers=3,
            llm_layers=4,
            num_microbatches=2,
            global_batch=8,
            colocated=True,
        )


def test_groups_on_four_processes() -> None:
    # Encoder dp=2 pp=1 (ranks 0, 1), LLM pp=2 (ranks 2, 3); then encoder tp=2 (ranks 0,
    # 1) with an LLM of dp=2 (ranks 2, 3), in the same processes (one spawn: it is slow).
    dp_pp = RuntimeLayout.simple(
        encoder_dp=2, llm_pp=2, encoder_layers=2, llm_layers=4, num_microbatches=2, global_batch=4
    )
    tp_dp = RuntimeLayout.simple(
        llm_dp=2,
        encoder_tp=2,
        encoder_layers=2,
        llm_layers=2,
        num_microbatches=2,
        global_batch=4,
    )
    # Colocated: LLM tp=2 x pp=2, the encoder on the first stage's ranks 0, 1.
    colocated = RuntimeLayout.simple(
        llm_tp=2,
        llm_pp=2,
        encoder_layers=2,
        llm_layers=2,
        num_microbatches=2,
        global_batch=4,
        colocated=True,
    )
    results = spawn_local(
        _groups_worker, 4, args=([dp_pp, tp_dp, colocated],), timeout_s=SPAWN_TIMEOUT_S
    )
    for rank, per_layout in enumerate(results):  # the LLM's groups, no bridge
        got = per_layout[2]
        assert got["dp"] == [rank] and got["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert got["bridge"] is None and got["info"].holds_encoder == (rank < 2)

    expected_dp_pp = {
        0: ([0, 1], [0], [0, 1, 2]),
        1: ([0, 1], [1], [0, 1, 2]),
        2: ([2], [2], [0, 1, 2]),
        3: ([3], [3], None),
    }
    expected_tp_dp = {
        0: ([0], [0, 1], [0, 2, 3]),
        1: ([1], [0, 1], None),
        2: ([2, 3], [2], [0, 2, 3]),
        3: ([2, 3], [3], [0, 2, 3]),
    }
    for rank, per_layout in enumerate(results):
        for got, expected in zip(per_layout, (expected_dp_pp[rank], expected_tp_dp[rank])):
            dp, tp, bridge = expected
            assert got["dp"] == dp == got["dp_ranks"], (rank, got)
            assert got["tp"] == tp == got["tp_ranks"], (rank, got)
            assert got["bridge"] == bridge, (rank, got)
            assert got["info"].rank == rank
    assert results[3][0]["info"].prev_rank == 2
    assert results[2][0]["info"].next_rank == 3
