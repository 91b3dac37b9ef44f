"""Pipeline-aware refinement of a schedule for an encoder stage feeding an LLM stage.

``dflop.schedule()`` minimises the largest microbatch load of every dimension (encoder
seconds, LLM seconds) separately. A pipeline in which the encoder's stages feed the LLM's
runs, in steady state, at the pace of ``max(E_j, L_j)`` per microbatch ``j`` (the slower
module's share of it), so its step is about

    fill + sum_j max(E_j, L_j) + drain,  with  sum_j max(E_j, L_j)
        = (W_E + W_L) / 2 + sum_j |E_j - L_j| / 2,

and the totals ``W_E``, ``W_L`` do not depend on the assignment. Two schedules with the
same per-dimension makespan can therefore differ a lot: the minimax objective is happy to
put two encoder-heavy samples (images) in one microbatch and two LLM-heavy ones (long
texts) in another, as long as neither exceeds the makespan, and the pipeline then idles
on both. :func:`pair_microbatches` starts from dflop's schedule and moves and swaps
samples between microbatches to shrink ``sum_j |E_j - L_j|`` (pairing encoder-heavy with
LLM-heavy samples), never letting a microbatch's load grow past ``slack`` times the
starting schedule's largest one (so dflop's balance and memory bound are kept).
:func:`johnson_order` orders microbatches by Johnson's rule for a two-machine flow shop
(encoder-light microbatches first by increasing encoder load, then the rest by decreasing
LLM load), which minimises the fill and drain bubbles of the encoder -> LLM flow.
"""

from __future__ import annotations

import numpy as np

__all__ = ["johnson_order", "pair_microbatches", "pipeline_imbalance"]


def _loads(costs: np.ndarray, assignment: np.ndarray, m: int, constants: np.ndarray):
    encoder = np.bincount(assignment, costs[:, 0], minlength=m) + constants[0]
    llm = np.bincount(assignment, costs[:, 1], minlength=m) + constants[1]
    return encoder, llm


def pipeline_imbalance(
    costs: np.ndarray, assignment: np.ndarray, num_microbatches: int, constants=(0.0, 0.0)
) -> float:
    """``sum_j |E_j - L_j|`` (seconds) of an assignment; per-microbatch constants included."""
    costs = np.asarray(costs, dtype=np.float64)
    encoder, llm = _loads(
        costs, np.asarray(assignment), num_microbatches, np.asarray(constants, dtype=float)
    )
    return float(np.abs(encoder - llm).sum())


def pair_microbatches(
    costs: np.ndarray,
    assignment: np.ndarray,
    num_microbatches: int,
    *,
    constants=(0.0, 0.0),
    slack: float = 1.05,
    max_moves: int = 500,
) -> np.ndarray:
    """Improve ``assignment`` (sample -> microbatch) by best-improvement moves and swaps
    that reduce ``sum_j |E_j - L_j|``.

    Args:
        costs: (N, 2) per-sample seconds of the encoder stage and the LLM stage.
        assignment: (N,) the starting microbatch of every sample (e.g. dflop's schedule).
        num_microbatches: m.
        constants: per-microbatch seconds of each stage independent of its samples.
        slack: no microbatch's encoder or LLM load may exceed ``slack`` x the starting
            assignment's largest microbatch load (over both stages).
        max_moves: bound on the number of improving steps.

    Returns:
        (N,) int64: the new assignment; every microbatch non-empty if it was before.
    """
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    if costs.ndim != 2 or costs.shape[1] != 2:
        raise ValueError(f"costs must be (N, 2) (encoder, LLM), got shape {costs.shape}")
    a = np.array(assignment, dtype=np.int64)
    m = int(num_microbatches)
    const = np.asarray(constants, dtype=np.float64)
    n = a.shape[0]
    if n < 2 or m < 2:
        return a
    enc_c, llm_c = costs[:, 0], costs[:, 1]
    delta = enc_c - llm_c
    encoder, llm = _loads(costs, a, m, const)
    cap = slack * max(encoder.max(), llm.max()) + 1e-12
    bins = np.arange(m)
    for _ in range(max_moves):
        diff = encoder - llm
        counts = np.bincount(a, minlength=m)
        # Swap i (in p = a[i]) with k (in q = a[k]): d_p -= delta_i - delta_k, d_q += same.
        p, q = a[:, None], a[None, :]
        shift = delta[:, None] - delta[None, :]
        swap_gain = (
            np.abs(diff[p]) + np.abs(diff[q]) - np.abs(diff[p] - shift) - np.abs(diff[q] + shift)
        )
        enc_shift = enc_c[None, :] - enc_c[:, None]
        llm_shift = llm_c[None, :] - llm_c[:, None]
        within = (
            (encoder[p] + enc_shift <= cap)
            & (llm[p] + llm_shift <= cap)
            & (encoder[q] - enc_shift <= cap)
            & (llm[q] - llm_shift <= cap)
        )
        swap_gain = np.where((p != q) & within, swap_gain, -np.inf)
        # Move i from p = a[i] to r (p keeps at least one sample).
        r = bins[None, :]
        move_gain = (
            np.abs(diff[a])[:, None]
            + np.abs(diff[r])
            - np.abs(diff[a] - delta)[:, None]
            - np.abs(diff[r] + delta[:, None])
        )
        move_ok = (
            (a[:, None] != r)
            & (counts[a] > 1)[:, None]
            & (encoder[r] + enc_c[:, None] <= cap)
            & (llm[r] + llm_c[:, None] <= cap)
        )
        move_gain = np.where(move_ok, move_gain, -np.inf)
        i, k = np.unravel_index(int(np.argmax(swap_gain)), swap_gain.shape)
        mi, mr = np.unravel_index(int(np.argmax(move_gain)), move_gain.shape)
        best = max(swap_gain[i, k], move_gain[mi, mr])
        if not best > 1e-12:
            break
        if swap_gain[i, k] >= move_gain[mi, mr]:
            a[i], a[k] = a[k], a[i]
        else:
            a[mi] = mr
        encoder, llm = _loads(costs, a, m, const)
    return a


def johnson_order(encoder: np.ndarray, llm: np.ndarray) -> list[int]:
    """Johnson's rule for a two-machine flow shop (encoder, then LLM): microbatches with
    ``E < L`` first by increasing ``E``, then the others by decreasing ``L``."""
    encoder = np.asarray(encoder, dtype=float)
    llm = np.asarray(llm, dtype=float)
    first = sorted(
        (j for j in range(len(encoder)) if encoder[j] < llm[j]), key=lambda j: encoder[j]
    )
    rest = sorted((j for j in range(len(encoder)) if encoder[j] >= llm[j]), key=lambda j: -llm[j])
    return first + rest
