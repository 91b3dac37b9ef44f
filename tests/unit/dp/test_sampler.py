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


def _epoch(n, global_batch, m, world, **kw):
    """Every rank's microbatches of one epoch."""
    return [
        list(BalancedBatchSampler(_costs(n), global_batch, m, rank=r, world_size=world, **kw))
        for r in range(world)
    ]


@pytest.mark.parametrize(
    "n,global_batch,m,world", [(103, 16, 2, 2), (64, 16, 4, 4), (50, 24, 3, 2), (9, 8, 1, 3)]
)
def test_every_sample_once_per_epoch_and_same_on_every_rank(n, global_batch, m, world):
    per_rank = _epoch(n, global_batch, m, world, seed=3)
    seen = [i for mbs in per_rank for mb in mbs for i in mb]
    kept = n - (n % global_batch if n % global_batch < world else 0)
    assert sorted(seen) == sorted(set(seen)) and len(seen) == kept
    # Every rank yields the same number of microbatches (each step the same count).
    assert len({len(mbs) for mbs in per_rank}) == 1
    assert all(mb for mbs in per_rank for mb in mbs)  # no empty microbatch
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


def _data():
    rng = np.random.default_rng(11)
    lengths = rng.integers(2, 30, SAMPLES)
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


def _dp_step(rank: int, world_size: int, wrapper: str) -> dict:
    """One balanced step of the whole dataset (one global batch) under DDP or FSDP."""
    import torch

    torch.set_num_threads(1)
    lengths, tokens = _data()
    sampler = BalancedBatchSampler(
        lengths.astype(float) ** 1.5, SAMPLES, 3, target_tokens=lengths - 1, seed=1
    )
    model = _wrap(_model(), wrapper)
    synced = []  # DDP: the microbatches whose backward reduced gradients over the ranks
    if wrapper == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_hook(state, bucket):
            synced.append(mb.index)
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_hook)
    loader = torch.utils.data.DataLoader(range(SAMPLES), batch_sampler=sampler)
    samples = []
    for batch, mb in sampler.batches(loader):
        with mb.gradient_sync(model):
            # One forward per microbatch (FSDP needs the same count on every rank): the
            # samples packed into one sequence (the model has no attention).
            loss = _sum_loss(model, [tokens[int(i)] for i in batch]) * mb.loss_scale
            loss.backward()
        samples += batch.tolist()
    assert mb.is_last and mb.step.num_microbatches == 3
    return {"samples": sorted(samples), "grads": _full_grads(model, wrapper), "synced": synced}


@pytest.mark.integration
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp1", "fsdp2"])
def test_balanced_step_has_the_single_process_gradient(wrapper):
    """Each rank's microbatches differ in size and token count; with loss_scale and
    gradient_sync the averaged gradient is the global batch's mean loss gradient."""
    from dflop.runtime import spawn_local

    results = spawn_local(_dp_step, 2, (wrapper,), timeout_s=120.0, num_threads=1)
    if wrapper == "ddp":  # linear, so syncing every microbatch would give the same grads
        assert all(set(r["synced"]) == {2} for r in results)  # only after the last of 3
    lengths, tokens = _data()
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


def test_a_share_too_small_for_its_microbatches_falls_back_on_every_rank_alike():
    costs = np.ones(16)
    costs[0] = 100.0  # its rank's balanced share would hold this sample alone
    per_rank = [
        list(BalancedBatchSampler(costs, 16, 4, rank=r, world_size=2, shuffle=False))
        for r in range(2)
    ]
    assert [len(mbs) for mbs in per_rank] == [4, 4]  # equal forward counts (FSDP)
    assert sorted(i for mbs in per_rank for mb in mbs for i in mb) == list(range(16))
    sampler = BalancedBatchSampler(costs, 16, 4, rank=0, world_size=2, shuffle=False)
    info = sampler.plan_step(0, 0)
    assert info.rank_costs.shape == (2, 1) and info.rank_costs.sum() == costs.sum()
