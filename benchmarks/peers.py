"""The balancers and packers that training frameworks ship, re-implemented from their
published descriptions (not copied), for the benchmarks to compare dflop against:

- verl's sequence-length balancing: Karmarkar-Karp's largest differencing method for k
  subsets (with or without equal counts) and a greedy partition; its dynamic batch size
  takes k = ceil(total tokens / token cap) and partitions the lengths into k.
- NeMo's sequence packing: first-fit decreasing into bins of the token cap.
- LLaMA-Factory's greedy knapsack: each knapsack filled with the longest remaining
  sequences that still fit, until none is left.

Every function returns a list of bins, each a list of sample indices.
"""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np


def karmarkar_karp(values: np.ndarray, k: int, equal_size: bool = False) -> list[list[int]]:
    """k-way largest differencing: every item starts as a k-subset state holding it alone;
    the two states with the largest spread (largest - smallest subset sum) are merged,
    pairing one's largest subset with the other's smallest, until one state is left.
    ``equal_size``: items are first grouped k at a time (in sorted order), one per subset,
    so every subset gets the same count (len(values) must be a multiple of k)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    states = []
    if equal_size:
        if len(values) % k:
            raise ValueError("equal_size needs len(values) to be a multiple of k")
        for start in range(0, len(order), k):
            subsets = [[order[start + j]] for j in range(k)]
            states.append(subsets)
    else:
        states = [[[i]] + [[] for _ in range(k - 1)] for i in order]
    heap = []
    for n, subsets in enumerate(states):
        sums = [float(sum(values[i] for i in s)) for s in subsets]
        heapq.heappush(heap, (-(max(sums) - min(sums)), n, subsets, sums))
    counter = len(states)
    while len(heap) > 1:
        _, _, a, sa = heapq.heappop(heap)
        _, _, b, sb = heapq.heappop(heap)
        ia = sorted(range(k), key=lambda j: -sa[j])  # a's largest first
        ib = sorted(range(k), key=lambda j: sb[j])  # b's smallest first
        merged = [a[ia[j]] + b[ib[j]] for j in range(k)]
        sums = [sa[ia[j]] + sb[ib[j]] for j in range(k)]
        heapq.heappush(heap, (-(max(sums) - min(sums)), counter, merged, sums))
        counter += 1
    return [list(s) for s in heap[0][2]]


def greedy_partition(values: np.ndarray, k: int) -> list[list[int]]:
    """Longest first, each into the subset with the smallest sum."""
    bins: list[list[int]] = [[] for _ in range(k)]
    sums = [(0.0, j) for j in range(k)]
    for i in sorted(range(len(values)), key=lambda i: -values[i]):
        total, j = heapq.heappop(sums)
        bins[j].append(i)
        heapq.heappush(sums, (total + float(values[i]), j))
    return bins


def verl_dynamic_batch(tokens: np.ndarray, token_cap: float) -> list[list[int]]:
    """k = ceil(total tokens / cap) microbatches, the lengths partitioned into k by
    Karmarkar-Karp (the cap is not checked after the partition)."""
    k = min(len(tokens), max(1, math.ceil(float(tokens.sum()) / token_cap)))
    return karmarkar_karp(tokens, k)


def first_fit_decreasing(tokens: np.ndarray, token_cap: float) -> list[list[int]]:
    """Longest first, each into the first bin with room."""
    bins: list[list[int]] = []
    room: list[float] = []
    for i in sorted(range(len(tokens)), key=lambda i: -tokens[i]):
        for j, r in enumerate(room):
            if tokens[i] <= r:
                bins[j].append(i)
                room[j] -= float(tokens[i])
                break
        else:
            bins.append([i])
            room.append(token_cap - float(tokens[i]))
    return bins


def greedy_knapsack(tokens: np.ndarray, token_cap: float) -> list[list[int]]:
    """Knapsack after knapsack, each filled with the longest remaining sequence that still
    fits, until none fits; then the next."""
    remaining = sorted(range(len(tokens)), key=lambda i: tokens[i])  # ascending
    lengths = [float(tokens[i]) for i in remaining]
    bins = []
    while remaining:
        room, knapsack = token_cap, []
        while True:
            pos = bisect.bisect_right(lengths, room) - 1
            if pos < 0:
                break
            room -= lengths.pop(pos)
            knapsack.append(remaining.pop(pos))
        if not knapsack:  # a sequence over the cap: alone (as the frameworks truncate it)
            knapsack.append(remaining.pop())
            lengths.pop()
        bins.append(knapsack)
    return bins
