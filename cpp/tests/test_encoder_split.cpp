// Unit tests of the encoder's split by visual unit: hand-computed splits, optimality with
// equal unit costs, coverage and bounds on random instances, determinism, errors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "check.hpp"
#include "dflop/encoder_split.hpp"
#include "dflop/errors.hpp"

namespace {

using dflop::InvalidArgument;
using dflop::split_units;
using dflop::SplitGranularity;
using dflop::UnitSplit;
using Ints = std::vector<int64_t>;
using Doubles = std::vector<double>;

UnitSplit split(const Ints& units, const Doubles& costs, int64_t r,
                SplitGranularity g = SplitGranularity::Unit) {
  return split_units(units.data(), costs.data(), static_cast<int64_t>(units.size()), r, g);
}

// Every sample's units are covered exactly once, by pieces in (sample, unit) order; the
// per-replica sums match the pieces.
void check_consistent(const Ints& units, const Doubles& costs, const UnitSplit& s) {
  const size_t p = s.sample.size();
  CHECK_EQ(s.first_unit.size(), p);
  CHECK_EQ(s.num_units.size(), p);
  CHECK_EQ(s.replica.size(), p);
  Ints next(units.size(), 0), replica_units(s.num_replicas, 0);
  Doubles replica_cost(s.num_replicas, 0.0);
  int64_t last_sample = -1;
  for (size_t k = 0; k < p; ++k) {
    const int64_t i = s.sample[k];
    CHECK(i >= last_sample);
    last_sample = i;
    CHECK_EQ(s.first_unit[k], next[i]);  // contiguous, in unit order
    CHECK(s.num_units[k] >= 1);
    CHECK(s.replica[k] >= 0 && s.replica[k] < s.num_replicas);
    next[i] += s.num_units[k];
    replica_units[s.replica[k]] += s.num_units[k];
    replica_cost[s.replica[k]] += costs[i] * double(s.num_units[k]) / double(units[i]);
  }
  CHECK_EQ(next, units);
  CHECK_EQ(replica_units, s.replica_units);
  double makespan = 0.0;
  for (int64_t r = 0; r < s.num_replicas; ++r) {
    CHECK_NEAR(replica_cost[r], s.replica_cost[r], 1e-9 * (1.0 + replica_cost[r]));
    makespan = std::max(makespan, s.replica_cost[r]);
  }
  CHECK_EQ(makespan, s.makespan);
}

// Makespan of plain LPT over whole samples (costliest first onto the least loaded).
double lpt(Doubles costs, int64_t r) {
  std::sort(costs.rbegin(), costs.rend());
  Doubles load(r, 0.0);
  for (double c : costs) *std::min_element(load.begin(), load.end()) += c;
  return *std::max_element(load.begin(), load.end());
}

TEST_CASE(hand_computed_split) {
  // 3 + 5 equal units on 2 replicas: 4 each; the 3-unit sample stays whole.
  const UnitSplit s = split({3, 5}, {3.0, 5.0}, 2);
  CHECK_EQ(s.sample, (Ints{0, 1, 1}));
  CHECK_EQ(s.first_unit, (Ints{0, 0, 4}));
  CHECK_EQ(s.num_units, (Ints{3, 4, 1}));
  CHECK_EQ(s.replica, (Ints{0, 1, 0}));
  CHECK_EQ(s.replica_units, (Ints{4, 4}));
  CHECK_EQ(s.makespan, 4.0);
  // A 32-frame video alone over 3 replicas: 11 + 11 + 10 frames.
  const UnitSplit v = split({32}, {64.0}, 3);
  Ints sorted = v.replica_units;
  std::sort(sorted.begin(), sorted.end());
  CHECK_EQ(sorted, (Ints{10, 11, 11}));
  CHECK_EQ(v.makespan, 22.0);
  CHECK_EQ(v.sample.size(), size_t{3});
}

TEST_CASE(whole_samples_when_that_costs_nothing) {
  // 2 + 2 + 4 on 2 replicas: 4 each without cutting anything.
  const UnitSplit s = split({2, 2, 4}, {2.0, 2.0, 4.0}, 2);
  CHECK_EQ(s.sample.size(), size_t{3});
  CHECK_EQ(s.makespan, 4.0);
  // Text-only samples (no units) get no piece; one replica takes everything whole.
  const UnitSplit t = split({0, 3, 0, 2}, {0.0, 3.0, 0.0, 2.0}, 1);
  CHECK_EQ(t.sample, (Ints{1, 3}));
  CHECK_EQ(t.num_units, (Ints{3, 2}));
  CHECK_EQ(t.replica, (Ints{0, 0}));
}

TEST_CASE(fewer_units_than_replicas) {
  const UnitSplit s = split({1, 2, 0}, {1.0, 2.0, 0.0}, 5);
  check_consistent({1, 2, 0}, {1.0, 2.0, 0.0}, s);
  CHECK_EQ(s.makespan, 1.0);  // one unit per replica, three replicas idle or not
  CHECK_EQ(std::count(s.replica_units.begin(), s.replica_units.end(), 0), 2);
  const UnitSplit none = split({0, 0}, {0.0, 0.0}, 3);
  CHECK(none.sample.empty());
  CHECK_EQ(none.makespan, 0.0);
  CHECK(split({}, {}, 2).sample.empty());
}

TEST_CASE(zero_cost_units_go_to_fewest_units) {
  const UnitSplit s = split({4, 3}, {4.0, 0.0}, 2);
  check_consistent({4, 3}, {4.0, 0.0}, s);
  CHECK_EQ(s.makespan, 2.0);
  CHECK_EQ(s.replica_units[0] + s.replica_units[1], 7);
}

TEST_CASE(equal_unit_costs_are_optimal) {
  std::mt19937_64 gen(3);
  for (int trial = 0; trial < 500; ++trial) {
    const int64_t n = gen() % 20, r = 1 + gen() % 9;
    const double c = 0.25 + double(gen() % 100) / 17.0;
    Ints units(n);
    Doubles costs(n);
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      units[i] = gen() % 3 == 0 ? 0 : int64_t(1 + gen() % 37);
      costs[i] = c * double(units[i]);
      total += units[i];
    }
    const UnitSplit s = split(units, costs, r);
    check_consistent(units, costs, s);
    CHECK_NEAR(s.makespan, c * double((total + r - 1) / r), 1e-9 * (1.0 + s.makespan));
    const UnitSplit again = split(units, costs, r);
    CHECK_EQ(again.replica, s.replica);
    CHECK_EQ(again.num_units, s.num_units);
    // Cutting happens only where balance needs it: at most r - 1 more pieces than samples.
    const int64_t visual =
        std::count_if(units.begin(), units.end(), [](int64_t u) { return u > 0; });
    CHECK_LE(int64_t(s.sample.size()), visual + r - 1);
  }
}

TEST_CASE(unequal_unit_costs_stay_near_the_bound) {
  std::mt19937_64 gen(5);
  for (int trial = 0; trial < 500; ++trial) {
    const int64_t n = 1 + gen() % 25, r = 1 + gen() % 7;
    Ints units(n);
    Doubles costs(n);
    double total = 0.0, largest_unit = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      units[i] = gen() % 4 == 0 ? 0 : int64_t(1 + gen() % 12);
      costs[i] = units[i] == 0 ? 0.0 : double(units[i]) * (0.5 + double(gen() % 1000) / 97.0);
      total += costs[i];
      if (units[i]) largest_unit = std::max(largest_unit, costs[i] / double(units[i]));
    }
    const UnitSplit s = split(units, costs, r);
    check_consistent(units, costs, s);
    CHECK_LE(s.makespan, std::max(total / double(r), largest_unit) + largest_unit + 1e-9);
    // Never worse than placing whole samples.
    const UnitSplit whole = split(units, costs, r, SplitGranularity::Sample);
    check_consistent(units, costs, whole);
    for (size_t k = 0; k < whole.sample.size(); ++k) {
      CHECK_EQ(whole.first_unit[k], 0);
      CHECK_EQ(whole.num_units[k], units[whole.sample[k]]);
    }
    CHECK_LE(s.makespan, lpt(costs, r) * (1 + 1e-9));
  }
}

TEST_CASE(whole_sample_granularity_keeps_samples_whole) {
  // LPT's 3-3-2-2-2 counterexample: the local search finds 6 / 6.
  const Ints units = {3, 3, 2, 2, 2};
  const Doubles costs = {3, 3, 2, 2, 2};
  const UnitSplit s = split(units, costs, 2, SplitGranularity::Sample);
  CHECK_EQ(s.makespan, 6.0);
  CHECK_EQ(s.sample.size(), size_t{5});
  // By unit: also 6, the optimum.
  CHECK_EQ(split(units, costs, 2).makespan, 6.0);
  // A single large sample cannot be shared whole.
  CHECK_EQ(split({8}, {8.0}, 4, SplitGranularity::Sample).makespan, 8.0);
  CHECK_EQ(split({8}, {8.0}, 4).makespan, 2.0);
}

TEST_CASE(split_errors_name_argument_and_index) {
  CHECK_THROWS_WITH(split({1, -2}, {1.0, 1.0}, 2), InvalidArgument, "units[1]=-2");
  CHECK_THROWS_WITH(split({1, 1}, {1.0, -2.0}, 2), InvalidArgument, "costs[1]=-2");
  CHECK_THROWS_WITH(split({1}, {std::numeric_limits<double>::quiet_NaN()}, 2), InvalidArgument,
                    "costs[0]=nan");
  CHECK_THROWS_WITH(split({1}, {std::numeric_limits<double>::infinity()}, 2), InvalidArgument,
                    "costs[0]=inf");
  CHECK_THROWS_WITH(split({0, 0}, {0.0, 3.0}, 2), InvalidArgument, "units[1]=0");
  CHECK_THROWS_WITH(split({1}, {1.0}, 0), InvalidArgument, "num_replicas");
}

}  // namespace

int main(int argc, char** argv) { return dflop_test::run_all(argc, argv); }
