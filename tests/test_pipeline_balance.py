"""dflop.train.pipeline_balance: pairing encoder-heavy with LLM-heavy samples."""

import numpy as np
from dflop.scheduler import data_blind_schedule, schedule
from dflop.train.pipeline_balance import johnson_order, pair_microbatches, pipeline_imbalance


def _anticorrelated(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    image = rng.random(n) < 0.5
    size = rng.lognormal(0.0, 0.5, n)
    return np.stack([np.where(image, size, 0.0), np.where(image, 0.1 * size, size)], axis=1)


def test_pairing_reduces_imbalance_and_keeps_bounds():
    costs = _anticorrelated(48)
    m = 16
    start = schedule(costs, m, 1, microbatch_dims=(0,))
    before = pipeline_imbalance(costs, start.assignment, m)
    paired = pair_microbatches(costs, start.assignment, m, slack=1.05)
    after = pipeline_imbalance(costs, paired, m)
    assert after < 0.9 * before
    assert sorted(set(paired.tolist())) == list(range(m))  # no microbatch emptied
    loads = np.zeros((m, 2))
    np.add.at(loads, paired, costs)
    assert loads.max() <= 1.05 * start.loads.max() + 1e-9


def test_pairing_never_worse_than_its_start():
    for seed in range(5):
        costs = _anticorrelated(24, seed)
        start = data_blind_schedule(costs, 8, 1, microbatch_dims=(0,))
        paired = pair_microbatches(costs, start.assignment, 8, constants=(0.1, 0.05))
        assert pipeline_imbalance(costs, paired, 8, (0.1, 0.05)) <= pipeline_imbalance(
            costs, start.assignment, 8, (0.1, 0.05)
        )


def test_johnson_order():
    encoder = np.array([3.0, 1.0, 2.0, 5.0])
    llm = np.array([2.0, 4.0, 3.0, 1.0])
    # E < L: 1 (E=1), 2 (E=2); then E >= L by decreasing L: 0 (L=2), 3 (L=1).
    assert johnson_order(encoder, llm) == [1, 2, 0, 3]
