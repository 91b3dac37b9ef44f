"""dflop.dp.BalancedBatchSampler: every sample once per epoch, the same batches on every
rank and after a resume, balanced ranks, memory limits, errors naming the sample, and (2
real gloo ranks under DDP, FSDP1 and FSDP2) the gradient of a balanced step equal to one process's
gradient of the same global batch."""

from __future__ import annotations

import numpy as np
import pytest
from dflop.dp import BalancedBatchSampler
from dflop.errors import InputTypeError


def _costs(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(0.0, 1.0, n)


def _rank_epoch(sampler) -> list[tuple[list[int], bool]]:
    """A rank's microbatches of one epoch, each with whether it is padding."""
    out, position, info = [], 0, None
    for mb in sampler:
        position = position + 1 if sampler.step_info is info else 0
        info = sampler.step_info
        out.append((mb, position < info.num_padding))
    return out


def _epoch(n, global_batch, m, world, **kw):
    """Every rank's microbatches of one epoch, each with whether it is padding."""
    return [
        _rank_epoch(
            BalancedBatchSampler(_costs(n), global_batch, m, rank=r, world_size=world, **kw)
        )
        for r in range(world)
    ]


@pytest.mark.parametrize(
    "n,global_batch,m,world",
    [(103, 16, 2, 2), (64, 16, 4, 4), (50, 24, 3, 2), (9, 8, 1, 3), (10, 3, 1, 2), (17, 8, 2, 2)],
)
def test_every_sample_once_per_epoch_and_same_on_every_rank(n, global_batch, m, world):
    """Every sample once, even a remainder too small to give each rank one (9 = 8 + 1 on
    3 ranks, 10 = 3 x 3 + 1 on 2): it joins the step before it; drop_last drops it."""
    per_rank = _epoch(n, global_batch, m, world, seed=3)
    seen = [i for mbs in per_rank for mb, padding in mbs if not padding for i in mb]
    assert sorted(seen) == list(range(n))
    dropped = _epoch(n, global_batch, m, world, seed=3, drop_last=True)
    kept = [i for mbs in dropped for mb, padding in mbs if not padding for i in mb]
    assert len(kept) == n - n % global_batch and len(set(kept)) == len(kept)
    # Every rank yields the same number of microbatches (each step the same count).
    assert len({len(mbs) for mbs in per_rank}) == 1
    assert all(mb for mbs in per_rank for mb, _ in mbs)  # no empty microbatch by default
    # Padding (the step's cheapest sample again) comes first: the last is real.
    assert all(len(mb) == 1 for mbs in per_rank for mb, pad in mbs if pad)
    assert not any(mbs[-1][1] for mbs in per_rank)
    assert per_rank == _epoch(n, global_batch, m, world, seed=3)  # deterministic
    assert per_rank != _epoch(n, global_batch, m, world, seed=4)


def test_balances_ranks_better_than_an_even_split():
    costs = _costs(512, 1)
    world, m, global_batch = 4, 2, 64
    samplers = [
        BalancedBatchSampler(costs, global_batch, m, rank=r, world_size=world, seed=0)
        for r in range(world)
    ]
    loads = np.array([[costs[mb].sum() for mb in s] for s in samplers])  # (world, steps*m)
    per_step = loads.reshape(world, -1, m).sum(axis=2)  # (world, steps)
    dflop_imbalance = (per_step.max(axis=0) / per_step.mean(axis=0)).mean()
    # DistributedSampler's way: the same global batch, split by position.
    order = np.random.default_rng([0, 0]).permutation(len(costs))
    even = costs[order].reshape(-1, world, global_batch // world).sum(axis=2)  # (steps, world)
    even_imbalance = (even.max(axis=1) / even.mean(axis=1)).mean()
    assert dflop_imbalance < 1.05 < even_imbalance


def test_resume_mid_epoch_gives_the_same_batches():
    costs = _costs(96)
    full = list(BalancedBatchSampler(costs, 16, 2, rank=1, world_size=2, seed=5))
    first = BalancedBatchSampler(costs, 16, 2, rank=1, world_size=2, seed=5)
    it = iter(first)
    done = [next(it) for _ in range(4)]  # two steps of two microbatches
    state = first.state_dict()
    assert state == {"epoch": 0, "step": 2, "seed": 5}
    resumed = BalancedBatchSampler(costs, 16, 2, rank=1, world_size=2, seed=5)
    resumed.load_state_dict(state)
    assert done + list(resumed) == full
    assert resumed.epoch == 1  # the epoch ended: the next iteration draws epoch 1
    with pytest.raises(ValueError, match="saved with seed=5"):
        BalancedBatchSampler(costs, 16, 2, rank=1, world_size=2, seed=6).load_state_dict(state)


def test_limits_keep_heavy_samples_apart_and_name_the_one_that_cannot_fit():
    rng = np.random.default_rng(2)
    tokens = rng.integers(100, 1000, 80)
    tokens[[3, 17]] = 3500  # long videos
    limit = 4000
    for rank in range(2):
        sampler = BalancedBatchSampler(
            tokens.astype(float), 16, 4, rank=rank, world_size=2, resources=tokens[:, None],
            limits=[limit],
        )  # fmt: skip
        for mb in sampler:
            assert tokens[mb].sum() <= limit
    tokens[17] = 5000
    with pytest.raises(ValueError, match=r"sample 17 alone needs 5000 of resource 0"):
        BalancedBatchSampler(tokens.astype(float), 16, 4, resources=tokens[:, None], limits=[limit])


def test_a_dataset_smaller_than_the_world_is_refused_unless_dropped():
    with pytest.raises(ValueError, match="num_samples=3 is fewer than world_size=4"):
        BalancedBatchSampler(_costs(3), 4, 1, rank=0, world_size=4)
    assert len(BalancedBatchSampler(_costs(3), 4, 1, rank=0, world_size=4, drop_last=True)) == 0


def test_bad_input_is_named():
    costs = _costs(32)
    costs[7] = np.nan
    with pytest.raises(ValueError, match=r"costs of sample 7 is \[nan\]"):
        BalancedBatchSampler(costs, 8)
    with pytest.raises(ValueError, match=r"costs of sample \d+ is \[-1.0\]"):
        sampler = BalancedBatchSampler(lambda idx: -np.ones(len(idx)), 8, num_samples=32)
        next(iter(sampler))
    with pytest.raises(InputTypeError, match="num_samples"):
        BalancedBatchSampler(lambda idx: np.ones(len(idx)), 8)
    with pytest.raises(ValueError, match="smaller than num_microbatches x world_size = 16"):
        BalancedBatchSampler(_costs(32), 8, 4, rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"rank=2 is out of range \[0, world_size=2\)"):
        BalancedBatchSampler(_costs(32), 8, rank=2, world_size=2)
    sampler = BalancedBatchSampler(_costs(32), 8)
    _, first = next(sampler.batches(iter(sampler)))
    with pytest.raises(ValueError, match="loss_scale needs the sampler's target_tokens"):
        first.loss_scale  # noqa: B018


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.integration)])
def test_batches_carry_their_step_even_with_workers_reading_ahead(workers):
    import torch

    costs = _costs(40)
    targets = np.arange(40) % 7 + 1
    sampler = BalancedBatchSampler(costs, 16, 2, rank=1, world_size=2, target_tokens=targets)
    loader = torch.utils.data.DataLoader(
        np.arange(40), batch_sampler=sampler, num_workers=workers, prefetch_factor=4 if workers
        else None,
    )  # fmt: skip
    seen = []
    for batch, mb in sampler.batches(loader):
        assert batch.tolist() == list(mb.step.microbatches[mb.index])  # the batch's own step
        assert mb.loss_scale == 2 / targets[mb.step.indices].sum()
        seen.append((mb.step.step, mb.index, mb.is_last))
    assert seen == [(s, k, k == 1) for s in range(3) for k in range(2)]


@pytest.mark.integration  # DataLoader worker processes
def test_resume_under_workers_reading_ahead_continues_after_the_trained_step():
    import torch

    def make():
        return BalancedBatchSampler(_costs(64), 8, 2, rank=0, world_size=2, seed=9)

    def loader(sampler):
        return torch.utils.data.DataLoader(
            np.arange(64), batch_sampler=sampler, num_workers=2, prefetch_factor=4
        )

    reference = make()
    full = [b.tolist() for b, _ in reference.batches(loader(reference))]
    first = make()
    done = []
    for batch, mb in first.batches(loader(first)):
        done.append(batch.tolist())
        if mb.is_last and mb.step.step == 2:
            state = first.state_dict()  # workers have drawn steps 3.. already
            break
    assert state["step"] == 3 and first.step_info.step > 2
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b.tolist() for b, _ in resumed.batches(loader(resumed))]
    assert done + rest == full


# ---- 2 real ranks under DDP -------------------------------------------------------------

VOCAB, DIM, SAMPLES = 50, 16, 24


def _data(heavy: bool = False):
    rng = np.random.default_rng(11)
    lengths = rng.integers(2, 30, SAMPLES)
    if heavy:  # a sample so long that its rank's balanced share holds it alone
        lengths[0] = 400
    tokens = [rng.integers(0, VOCAB, n) for n in lengths]
    return lengths, tokens


def _model(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM), torch.nn.Linear(DIM, VOCAB))


def _sum_loss(model, sequences):
    """Summed next-token loss of the sequences, packed into one forward."""
    import torch

    inputs = torch.cat([torch.as_tensor(x[:-1]) for x in sequences])
    targets = torch.cat([torch.as_tensor(x[1:]) for x in sequences])
    return torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum")


def _wrap(model, wrapper: str):
    """The model under DDP, FSDP1 (FullyShardedDataParallel) or FSDP2 (fully_shard)."""
    import torch

    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if wrapper == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def _full_grads(model, wrapper: str) -> dict:
    if wrapper == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        # writeback=False: the summoned full parameters' gradients are read, not written.
        with FullyShardedDataParallel.summon_full_params(model, with_grads=True, writeback=False):
            return {
                n.replace("_fsdp_wrapped_module.", ""): p.grad.numpy().copy()
                for n, p in model.named_parameters()
            }
    module = model.module if wrapper == "ddp" else model
    grads = {}
    for name, param in module.named_parameters():
        grad = param.grad.full_tensor() if wrapper == "fsdp2" else param.grad
        grads[name] = grad.numpy().copy()
    return grads


def _dp_step(rank: int, world_size: int, wrapper: str, padding: str | None) -> dict:
    """One balanced step of the whole dataset (one global batch) under DDP or FSDP."""
    import torch

    torch.set_num_threads(1)
    lengths, tokens = _data(heavy=padding is not None)
    sampler = BalancedBatchSampler(
        lengths.astype(float) ** 1.5, SAMPLES, 3, target_tokens=lengths - 1, seed=1,
        padding=padding or "sample",
    )  # fmt: skip
    model = _wrap(_model(), wrapper)
    synced = []  # DDP: the microbatches whose backward reduced gradients over the ranks
    if wrapper == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_hook(state, bucket):
            synced.append(mb.index)
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_hook)
    loader = torch.utils.data.DataLoader(
        range(SAMPLES), batch_sampler=sampler, collate_fn=lambda ids: list(ids)
    )
    samples = []
    for batch, mb in sampler.batches(loader):
        with mb.gradient_sync(model):
            # One forward per microbatch (FSDP needs the same count on every rank): the
            # samples packed into one sequence (the model has no attention); a padding
            # microbatch runs a two-token dummy, scaled by 0.
            sequences = [tokens[int(i)] for i in batch] if batch else [np.zeros(2, int)]
            loss = _sum_loss(model, sequences) * mb.loss_scale
            loss.backward()
        if not mb.is_padding:
            samples += batch
    assert mb.is_last and mb.step.num_microbatches == 3
    return {
        "samples": sorted(samples),
        "grads": _full_grads(model, wrapper),
        "synced": synced,
        "padding": mb.step.num_padding,
    }


@pytest.mark.integration
@pytest.mark.parametrize("padding", [None, "sample", "empty"], ids=["mixed", "heavy", "empty"])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp1", "fsdp2"])
def test_balanced_step_has_the_single_process_gradient(wrapper, padding):
    """Each rank's microbatches differ in size and token count; with loss_scale and
    gradient_sync the averaged gradient is the global batch's mean loss gradient. With a
    heavy sample its rank runs it alone and pads with 2 microbatches of loss scale 0 (the
    cheapest sample again, or empty: a two-token dummy)."""
    from dflop.runtime import spawn_local

    results = spawn_local(_dp_step, 2, (wrapper, padding), timeout_s=120.0, num_threads=1)
    if wrapper == "ddp":  # linear, so syncing every microbatch would give the same grads
        assert all(set(r["synced"]) == {2} for r in results)  # only after the last of 3
    assert sorted(r["padding"] for r in results) == ([0, 0] if padding is None else [0, 2])
    lengths, tokens = _data(heavy=padding is not None)
    assert sorted(results[0]["samples"] + results[1]["samples"]) == list(range(SAMPLES))
    assert results[0]["samples"] != results[1]["samples"]
    model = _model()
    total = _sum_loss(model, tokens) / float((lengths - 1).sum())
    total.backward()
    for name, param in model.named_parameters():
        want = param.grad.numpy()
        for r in results:
            np.testing.assert_allclose(r["grads"][name], want, rtol=1e-5, atol=1e-7)


def _disagreeing_ranks(rank: int, world_size: int) -> list[str]:
    """What the sampler says when rank 1 priced the samples differently, then when it
    resumed from another step."""
    messages = []
    costs = _costs(32) * (1.0 + 1e-9 * rank)  # e.g. each rank profiled its own cost model
    for case in ("costs", "state"):
        sampler = BalancedBatchSampler(costs if case == "costs" else _costs(32), 8, 2)
        if case == "state" and rank == 1:
            sampler.load_state_dict({"epoch": 0, "step": 1, "seed": 0})
        try:
            next(iter(sampler))
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    sampler = BalancedBatchSampler(_costs(32), 8, 2)
    assert len(list(sampler)) == 8  # the same on every rank: no error
    return messages


@pytest.mark.integration
def test_ranks_that_would_split_differently_are_named():
    from dflop.runtime import spawn_local

    results = spawn_local(_disagreeing_ranks, 2, timeout_s=120.0, num_threads=1)
    for costs, state in results:  # every rank raises the same error
        assert "rank 1 differs from rank 0 in its costs" in costs
        assert "rank 1 differs from rank 0 in its settings" in state
        assert "False, 0, 1) vs (32, 8, 2, 0, True, False, 0, 0)" in state  # the steps


@pytest.mark.parametrize("padding", ["sample", "empty"])
def test_a_share_smaller_than_its_microbatches_is_padded_and_stays_balanced(padding):
    """A heavy sample's rank holds it alone and runs 3 padding microbatches first (the
    dataset's cheapest sample, or empty; loss scale 0): every rank runs 4 forwards (FSDP) and
    the ranks' totals are dflop.schedule's (plus the padding's), not a joint schedule's."""
    import dflop
    from dflop.dp import Microbatch, PackingCollator

    costs = np.ones(16)
    costs[0] = 100.0  # its rank's balanced share holds this sample alone
    targets = np.ones(16, dtype=int)
    samplers = [
        BalancedBatchSampler(
            costs, 16, 4, rank=r, world_size=2, shuffle=False, target_tokens=targets,
            padding=padding,
        )
        for r in range(2)
    ]  # fmt: skip
    per_rank = [_rank_epoch(s) for s in samplers]
    assert [len(mbs) for mbs in per_rank] == [4, 4]  # equal forward counts (FSDP)
    real = sorted(i for mbs in per_rank for mb, pad in mbs if not pad for i in mb)
    assert real == list(range(16))
    heavy = 0 if per_rank[0][-1][0] == [0] else 1
    pad = [1] if padding == "sample" else []  # sample 1: the first of the cheapest
    assert per_rank[heavy] == [(pad, True)] * 3 + [([0], False)]
    step = samplers[heavy].plan_step(0, 0)
    assert step.num_padding == 3 and samplers[1 - heavy].plan_step(0, 0).num_padding == 0
    # The ranks' totals: the free optimum's (dflop.schedule: 100 | 15), plus the padding
    # samples' 3 x 1.0.
    assert sorted(dflop.schedule(costs, 1, 2).loads[:, 0]) == [15.0, 100.0]
    assert sorted(step.rank_costs[:, 0]) == [15.0, 103.0 if padding == "sample" else 100.0]
    assert [Microbatch(step, k, 2).loss_scale for k in range(4)] == [0.0, 0.0, 0.0, 2 / 16]
    # PackingCollator makes an empty microbatch a two-token row with one target.
    row = PackingCollator()([])
    assert row["input_ids"].tolist() == [[0, 0]] and row["labels"].tolist() == [[-100, 0]]


def test_sample_padding_runs_the_datasets_cheapest_sample():
    """With a cost array the padding is the dataset's cheapest sample (here a 0.01 s one
    outside the step), so a short share pays almost nothing for it; with a cost function
    (the dataset is not priced up front) the step's cheapest."""
    costs = np.ones(32)
    costs[0] = 100.0  # step 0 (samples 0-15): its rank holds it alone, 3 padding microbatches
    costs[20] = 0.01  # in step 1
    for given, pad, pad_cost in ((costs, 20, 0.01), (lambda ids: costs[ids], 1, 1.0)):
        steps = [
            BalancedBatchSampler(
                given, 16, 4, rank=r, world_size=2, num_samples=32, shuffle=False
            ).plan_step(0, 0)
            for r in range(2)
        ]
        heavy = int(np.argmax(steps[0].rank_costs[:, 0]))
        assert steps[heavy].rank_costs[heavy, 0] == pytest.approx(100.0 + 3 * pad_cost)
        assert steps[heavy].microbatches == ((pad,),) * 3 + ((0,),)
        assert steps[heavy].num_padding == 3 and steps[1 - heavy].num_padding == 0


def test_unpadded_short_shares_fall_back_to_one_joint_schedule_on_every_rank():
    """padding=None (the Hugging Face Trainer's): no sample runs twice; such a
    step is one joint schedule of every rank's microbatches."""
    costs = np.ones(16)
    costs[0] = 100.0
    per_rank = [
        _rank_epoch(
            BalancedBatchSampler(costs, 16, 4, rank=r, world_size=2, shuffle=False, padding=None)
        )
        for r in range(2)
    ]
    assert [len(mbs) for mbs in per_rank] == [4, 4]
    assert not any(pad for mbs in per_rank for _, pad in mbs)
    assert sorted(i for mbs in per_rank for mb, _ in mbs for i in mb) == list(range(16))


def test_empty_padding_with_torch_default_collate_is_refused_in_one_line():
    import torch

    sampler = BalancedBatchSampler(np.ones(8), 8, 2, rank=0, world_size=2, padding="empty")
    loader = torch.utils.data.DataLoader(range(8), batch_sampler=sampler)
    with pytest.raises(ValueError, match="default collate function cannot take"):
        next(sampler.batches(loader))
    with pytest.raises(ValueError, match="padding='pad': give one of 'sample', 'empty' or None"):
        BalancedBatchSampler(np.ones(8), 8, 2, rank=0, world_size=2, padding="pad")
