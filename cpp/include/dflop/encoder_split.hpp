// How the encoder's data-parallel replicas share one microbatch: by visual unit (an
// anyres tile, a video frame, one image of a multi-image sample), the granularity at which
// an encoder works independently. This is the ONE split function: the runtime executes it,
// the planner scores layouts with it and the pipeline-aware scheduler simulates it.
//
// A sample with u > 0 units and encoder cost w (all of its units; every unit of a sample
// costs w / u) is cut into pieces, contiguous unit ranges, each computed by one replica.
// Objective, in order: the largest replica cost (the microbatch's encoder stage time is
// that of its slowest replica); then few pieces (each piece is one more message range and
// splits a sample whose per-sample operations then wait for every replica that holds a
// part of it).
//
// Unit granularity (the default):
// 1. Target M: the smallest capacity at which "next fit" (units in canonical order:
//    samples by unit cost descending, then index; each replica filled up to M before the
//    next is opened) places every unit; below max(total / R, largest unit) + largest unit.
//    With equal unit costs c (up to rounding: the usual case) it is c * ceil(U / R), the
//    optimum, and steps 1-3 run in whole units, exactly.
//    If plain LPT of whole samples already reaches M, it is the split (no piece is cut),
//    so the unit split is never worse than whole-sample LPT.
// 2. Whole samples first, costliest first, each onto the fullest replica it still fits in
//    under M (best fit: a sample fits whole wherever that costs nothing).
// 3. The samples that fit nowhere whole are poured, costliest first, into the replicas
//    with the most room, in unit order: each replica takes as many units as fit under M.
// 4. Should 3 leave units over (possible only with unequal unit costs), the whole
//    microbatch is placed by next fit at M instead (always succeeds by the choice of M).
// Samples of cost 0 with units go whole to the replica with the fewest units.
// Sample granularity (an ablation: what whole-sample placement costs): every sample whole,
// by LPT plus a bounded local search of moves and swaps out of the costliest replica.
//
// Deterministic (ties by index); O(n log n + n log R + R) for n samples.
#pragma once

#include <cstdint>
#include <vector>

namespace dflop {

enum class SplitGranularity : int8_t { Unit = 0, Sample = 1 };

struct UnitSplit {
  int64_t num_replicas = 1;
  // Pieces ordered by (sample, first_unit): piece p is units [first_unit[p], first_unit[p] +
  // num_units[p]) of sample[p] (its position in the inputs), computed by replica[p]. Samples
  // without units have no piece; the pieces of a sample cover its units exactly once.
  std::vector<int64_t> sample, first_unit, num_units, replica;
  std::vector<double> replica_cost;    // per replica: sum of its pieces' costs
  std::vector<int64_t> replica_units;  // per replica: units it computes
  double makespan = 0.0;               // max of replica_cost (0 without units)
};

// The largest num_replicas and total units (over all samples) split_units accepts: far
// above any microbatch, and small enough that its work and memory stay bounded.
constexpr int64_t kMaxSplitReplicas = int64_t{1} << 20;
constexpr int64_t kMaxSplitUnits = int64_t{1} << 24;

// Throws InvalidArgument naming the argument and the first offending index for
// num_replicas outside [1, kMaxSplitReplicas], units[i] < 0, units summing to more than
// kMaxSplitUnits, a negative or non-finite costs[i], or costs[i] > 0 with units[i] == 0
// (encoder work without visual units).
UnitSplit split_units(const int64_t* units, const double* costs, int64_t num_samples,
                      int64_t num_replicas, SplitGranularity granularity = SplitGranularity::Unit);

}  // namespace dflop
