// Unit tests of the pipeline-aware schedule refinement: the simulated step against
// simulate_pipeline() fed by hand-built stage times, a hand-made case the refinement must
// fix, invariants (never worse, bins non-empty, growth bound, capacities) on random
// instances, determinism, budgets, errors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "check.hpp"
#include "dflop/balance.hpp"
#include "dflop/errors.hpp"
#include "dflop/pipeline_schedule.hpp"
#include "dflop/simulator.hpp"

namespace {

using dflop::InvalidArgument;
using dflop::PipelineScheduleOptions;
using Ints = std::vector<int64_t>;
using Doubles = std::vector<double>;

PipelineScheduleOptions two_modules(int64_t m, int64_t dp = 1) {
  PipelineScheduleOptions o;
  o.num_microbatches = m;
  o.dp_size = dp;
  o.stages = {1, 1};
  o.forward_fraction = {1.0 / 3.0, 1.0 / 3.0};
  o.microbatch_constant_s = {0.0, 0.0};
  return o;
}

double step(const Doubles& costs, const Ints& a, const PipelineScheduleOptions& o) {
  return dflop::simulated_step_time(costs.data(), static_cast<int64_t>(a.size()),
                                    static_cast<int64_t>(o.stages.size()), a, o);
}

// The same step, built independently: stage loads per replica, then simulate_pipeline().
double reference_step(const Doubles& costs, const Ints& a, const PipelineScheduleOptions& o) {
  const int64_t d = static_cast<int64_t>(o.stages.size()), m = o.num_microbatches, dp = o.dp_size,
                n = static_cast<int64_t>(a.size());
  std::vector<char> shared(d, 0);
  for (int64_t c : o.microbatch_dims) shared[c] = 1;
  Doubles bin(m * dp * d, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < d; ++c) bin[a[i] * d + c] += costs[i * d + c];
  }
  dflop::PipelineSimInput in;
  in.num_replicas = dp;
  for (int64_t s : o.stages) in.num_stages += s;
  in.num_stages -= 1;  // starts at 1
  in.num_microbatches = m;
  const int64_t S = in.num_stages;
  in.forward_s.assign(dp * S * m, 0.0);
  in.backward_s.assign(dp * S * m, 0.0);
  for (int64_t r = 0; r < dp; ++r) {
    int64_t s = 0;
    for (int64_t c = 0; c < d; ++c) {
      for (int64_t k = 0; k < o.stages[c]; ++k, ++s) {
        for (int64_t j = 0; j < m; ++j) {
          double load = 0.0;
          if (shared[c]) {
            for (int64_t q = 0; q < dp; ++q) load += bin[(j * dp + q) * d + c];
          } else {
            load = bin[(j * dp + r) * d + c];
          }
          if (load > 0) load += o.microbatch_constant_s[c];
          const size_t at = static_cast<size_t>((r * S + s) * m + j);
          in.forward_s[at] = o.forward_fraction[c] * load;
          in.backward_s[at] = load - in.forward_s[at];
        }
      }
    }
  }
  in.link_latency_s.assign(S - 1, o.link_latency_s);
  in.link_bandwidth_bytes_per_s.assign(S - 1, std::numeric_limits<double>::infinity());
  in.record_events = false;
  return dflop::simulate_pipeline(in).step_time_s;
}

// Random two-kind workload: "images" (encoder-heavy) and "texts" (LLM-heavy).
Doubles skewed_costs(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  Doubles costs(n * 2);
  for (int64_t i = 0; i < n; ++i) {
    const bool image = u(rng) < 0.45;
    costs[i * 2] = image ? 0.5 + u(rng) : 0.0;
    costs[i * 2 + 1] = image ? 0.1 + 0.2 * u(rng) : 0.3 + 1.2 * u(rng);
  }
  return costs;
}

Ints balanced(const Doubles& costs, const PipelineScheduleOptions& o, uint64_t seed) {
  dflop::BalanceOptions b;
  b.num_microbatches = o.num_microbatches;
  b.dp_size = o.dp_size;
  b.microbatch_dims = o.microbatch_dims;
  b.capacity = o.capacity;
  b.seed = seed;
  return dflop::balance(costs.data(), static_cast<int64_t>(costs.size() / 2), 2, b).assignment;
}

TEST_CASE(simulated_step_matches_simulator) {
  const Doubles costs = skewed_costs(40, 1);
  for (int64_t dp : {1, 2}) {
    for (bool shared_encoder : {false, true}) {
      PipelineScheduleOptions o = two_modules(5, dp);
      o.stages = {2, 3};
      o.forward_fraction = {0.3, 0.4};
      o.microbatch_constant_s = {0.05, 0.02};
      o.link_latency_s = 0.01;
      if (shared_encoder) o.microbatch_dims = {0};
      Ints a(40);
      for (int64_t i = 0; i < 40; ++i) a[i] = (i * 7) % (5 * dp);
      CHECK_NEAR(step(costs, a, o), reference_step(costs, a, o), 1e-12);
    }
  }
}

TEST_CASE(pairs_images_with_texts) {
  // Eight images (encoder 1 s) and eight long texts (LLM 1 s) in eight microbatches,
  // starting with images together and texts together: the pipeline idles one module in
  // every microbatch until each microbatch pairs an image with a text.
  Doubles costs;
  for (int64_t i = 0; i < 16; ++i) {
    costs.push_back(i < 8 ? 1.0 : 0.0);
    costs.push_back(i < 8 ? 0.1 : 1.0);
  }
  Ints start(16);
  for (int64_t i = 0; i < 16; ++i) start[i] = i / 2;
  PipelineScheduleOptions o = two_modules(8);
  o.max_growth = std::numeric_limits<double>::infinity();
  const auto r = dflop::pipeline_schedule(costs.data(), 16, 2, start, o);
  CHECK_LT(r.step_time_s, 0.8 * r.stats.start_step_time_s);
  CHECK_NEAR(r.step_time_s, step(costs, r.assignment, o), 1e-12);
  // At least as good as pairing image k with text k in microbatch k (the search may do
  // better still by shaping the fill and the drain).
  Ints paired(16);
  for (int64_t i = 0; i < 16; ++i) paired[i] = i % 8;
  CHECK_LE(r.step_time_s, step(costs, paired, o));
}

TEST_CASE(invariants_on_random_instances) {
  for (uint64_t seed = 0; seed < 12; ++seed) {
    const int64_t n = 24 + static_cast<int64_t>(seed) * 3, m = 4 + static_cast<int64_t>(seed % 5);
    const int64_t dp = 1 + static_cast<int64_t>(seed % 2);
    const Doubles costs = skewed_costs(n, seed);
    PipelineScheduleOptions o = two_modules(m, dp);
    o.microbatch_dims = {0};
    o.microbatch_constant_s = {0.01, 0.02};
    o.link_latency_s = 0.005;
    o.seed = seed;
    const Ints start = balanced(costs, o, seed);
    const auto r = dflop::pipeline_schedule(costs.data(), n, 2, start, o);
    CHECK_LE(r.step_time_s, r.stats.ordered_step_time_s);
    CHECK_LE(r.stats.ordered_step_time_s, r.stats.start_step_time_s);
    CHECK_NEAR(r.stats.start_step_time_s, step(costs, start, o), 1e-12);
    CHECK_NEAR(r.step_time_s, step(costs, r.assignment, o), 1e-12);
    CHECK_LE(r.stats.work_used, r.stats.work_budget);
    // Every bin non-empty; loads within max_growth x the start's makespan per dimension.
    Ints count(m * dp, 0);
    Doubles start_load(m * dp * 2, 0.0), load(m * dp * 2, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      ++count[r.assignment[i]];
      for (int64_t c = 0; c < 2; ++c) {
        start_load[start[i] * 2 + c] += costs[i * 2 + c];
        load[r.assignment[i] * 2 + c] += costs[i * 2 + c];
      }
    }
    CHECK(std::all_of(count.begin(), count.end(), [](int64_t k) { return k > 0; }));
    for (int64_t c = 0; c < 2; ++c) {
      // Dimension 0 is shared by a microbatch's replicas: compare microbatch sums.
      auto unit = [&](const Doubles& l, int64_t b) {
        if (c == 1) return l[b * 2 + c];
        double v = 0.0;
        for (int64_t q = 0; q < dp; ++q) v += l[((b / dp) * dp + q) * 2 + c];
        return v;
      };
      double start_max = 0.0, new_max = 0.0;
      for (int64_t b = 0; b < m * dp; ++b) {
        start_max = std::max(start_max, unit(start_load, b));
        new_max = std::max(new_max, unit(load, b));
      }
      CHECK_LE(new_max, o.max_growth * start_max * (1 + 1e-9));
    }
  }
}

TEST_CASE(improves_a_skewed_workload) {
  // 48 samples in 24 microbatches, the bench's shape: the refinement must clearly beat
  // the balanced schedule run in index order.
  const Doubles costs = skewed_costs(48, 7);
  PipelineScheduleOptions o = two_modules(24);
  o.microbatch_dims = {0};
  const auto r = dflop::pipeline_schedule(costs.data(), 48, 2, balanced(costs, o, 0), o);
  CHECK_LT(r.step_time_s, 0.9 * r.stats.start_step_time_s);
  CHECK_GT(r.stats.improving_moves, 0);
}

TEST_CASE(deterministic_and_budgeted) {
  const Doubles costs = skewed_costs(60, 3);
  PipelineScheduleOptions o = two_modules(10);
  o.seed = 5;
  const Ints start = balanced(costs, o, 0);
  const auto a = dflop::pipeline_schedule(costs.data(), 60, 2, start, o);
  const auto b = dflop::pipeline_schedule(costs.data(), 60, 2, start, o);
  CHECK(a.assignment == b.assignment);
  CHECK_EQ(a.step_time_s, b.step_time_s);
  // No budget: only the constructive orders are tried, and the start's bins are kept.
  o.work_budget = 0;
  const auto c = dflop::pipeline_schedule(costs.data(), 60, 2, start, o);
  CHECK_EQ(c.step_time_s, c.stats.ordered_step_time_s);
  CHECK_LE(c.stats.evaluations, 3);
  Ints sizes_start(10, 0), sizes_c(10, 0);
  for (int64_t i = 0; i < 60; ++i) {
    ++sizes_start[start[i]];
    ++sizes_c[c.assignment[i]];
  }
  std::sort(sizes_start.begin(), sizes_start.end());
  std::sort(sizes_c.begin(), sizes_c.end());
  CHECK(sizes_start == sizes_c);
}

TEST_CASE(an_interrupt_check_stops_the_search) {
  const Doubles costs = skewed_costs(60, 3);
  PipelineScheduleOptions o = two_modules(10);
  o.work_budget = 1000000000;
  const Ints start = balanced(costs, o, 0);
  int polls = 0;
  o.interrupted = [&polls] { return ++polls >= 2; };
  CHECK_THROWS_AS(dflop::pipeline_schedule(costs.data(), 60, 2, start, o), dflop::Interrupted);
  CHECK_EQ(polls, 2);
  o.work_budget = 20000;  // a check that never fires changes nothing
  o.interrupted = [] { return false; };
  const auto checked = dflop::pipeline_schedule(costs.data(), 60, 2, start, o);
  o.interrupted = nullptr;
  CHECK(dflop::pipeline_schedule(costs.data(), 60, 2, start, o).assignment == checked.assignment);
}

TEST_CASE(capacity_is_respected) {
  const Doubles costs = skewed_costs(40, 11);
  PipelineScheduleOptions o = two_modules(8);
  o.max_growth = std::numeric_limits<double>::infinity();
  const Ints start = balanced(costs, o, 0);
  Doubles load(8 * 2, 0.0);
  for (int64_t i = 0; i < 40; ++i) {
    for (int64_t c = 0; c < 2; ++c) load[start[i] * 2 + c] += costs[i * 2 + c];
  }
  double cap_llm = 0.0;
  for (int64_t b = 0; b < 8; ++b) cap_llm = std::max(cap_llm, load[b * 2 + 1]);
  o.capacity = {std::numeric_limits<double>::infinity(), cap_llm};
  const auto r = dflop::pipeline_schedule(costs.data(), 40, 2, start, o);
  Doubles after(8, 0.0);
  for (int64_t i = 0; i < 40; ++i) after[r.assignment[i]] += costs[i * 2 + 1];
  CHECK_LE(*std::max_element(after.begin(), after.end()), cap_llm * (1 + 1e-9));
}

TEST_CASE(bad_input_is_named) {
  const Doubles costs = {1.0, 0.1, 0.0, 1.0, 0.5, 0.5};
  const Ints start = {0, 1, 1};
  auto run = [&](PipelineScheduleOptions o, const Ints& a) {
    dflop::pipeline_schedule(costs.data(), 3, 2, a, o);
  };
  PipelineScheduleOptions o = two_modules(2);
  CHECK_THROWS_WITH(run(o, {0, 1}), InvalidArgument, "one per sample");
  CHECK_THROWS_WITH(run(o, {0, 2, 1}), InvalidArgument, "assignment[1] = 2");
  CHECK_THROWS_WITH(run(o, {0, 0, 0}), InvalidArgument, "bin 1");
  auto bad = o;
  bad.stages = {1};
  CHECK_THROWS_WITH(run(bad, start), InvalidArgument, "stages");
  bad = o;
  bad.stages = {1, 0};
  CHECK_THROWS_WITH(run(bad, start), InvalidArgument, "stages[1]");
  bad = o;
  bad.forward_fraction = {0.5, 1.5};
  CHECK_THROWS_WITH(run(bad, start), InvalidArgument, "forward_fraction[1]");
  bad = o;
  bad.microbatch_constant_s = {-1.0, 0.0};
  CHECK_THROWS_WITH(run(bad, start), InvalidArgument, "microbatch_constant_s[0]");
  bad = o;
  bad.link_latency_s = std::nan("");
  CHECK_THROWS_WITH(run(bad, start), InvalidArgument, "link_latency_s");
  bad = o;
  bad.max_growth = 0.5;
  CHECK_THROWS_WITH(run(bad, start), InvalidArgument, "max_growth");
  bad = o;
  bad.capacity = {1.2, 10.0};  // every sample fits, the start's bin 0 does not
  CHECK_THROWS_WITH(run(bad, {0, 1, 0}), InvalidArgument, "capacity[0]");
  CHECK_THROWS_WITH(dflop::pipeline_work_budget_for_ms(-1.0), InvalidArgument, "time_budget_ms");
  bad = o;
  bad.work_budget = -2;
  CHECK_THROWS_WITH(run(bad, start), InvalidArgument, "work_budget");
  bad = o;
  bad.time_limit_s = std::nan("");
  CHECK_THROWS_WITH(run(bad, start), InvalidArgument, "time_limit_s");
  bad = o;
  bad.last_stage_weight_extra = {0.0, std::nan("")};
  CHECK_THROWS_WITH(run(bad, start), InvalidArgument, "last_stage_weight_extra[1]");
  bad.last_stage_weight_extra = {0.0};
  CHECK_THROWS_WITH(run(bad, start), InvalidArgument, "last_stage_weight_extra");
  // Stage x microbatch pairs beyond what one simulation may hold.
  const int64_t n = 4096;
  const Doubles many(n * 2, 1.0);
  Ints spread(n);
  for (int64_t i = 0; i < n; ++i) spread[i] = i;
  bad = two_modules(n);
  bad.stages = {2048, 2048};
  CHECK_THROWS_WITH(dflop::pipeline_schedule(many.data(), n, 2, spread, bad), InvalidArgument,
                    "stage-microbatch pairs");
}

TEST_CASE(rejected_candidates_count_against_the_budget) {
  // One microbatch on two replicas, no growth allowed: every move and swap is rejected
  // without a simulation. The budget must still bound the search.
  const int64_t n = 300;
  Doubles costs(n, 1.0);
  costs[0] = n - 1.0;
  Ints start(n, 1);
  start[0] = 0;
  PipelineScheduleOptions o;
  o.num_microbatches = 1;
  o.dp_size = 2;
  o.stages = {1};
  o.forward_fraction = {1.0 / 3.0};
  o.max_growth = 1.0;
  const auto r = dflop::pipeline_schedule(costs.data(), n, 1, start, o);
  CHECK_LE(r.stats.work_used, r.stats.work_budget);
  CHECK_GT(r.stats.perturbations, 0);
}

}  // namespace

int main(int argc, char** argv) { return dflop_test::run_all(argc, argv); }
