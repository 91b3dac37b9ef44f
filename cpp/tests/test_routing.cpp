// Unit tests of the communicator's routing plan: hand-computed plans, invariants on
// random instances, errors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "check.hpp"
#include "dflop/errors.hpp"
#include "dflop/routing.hpp"

namespace {

using dflop::InvalidArgument;
using dflop::plan_routing;
using dflop::RoutingPlan;
using Ints = std::vector<int64_t>;

RoutingPlan plan(const Ints& src, const Ints& dst, const Ints& rows, int64_t s, int64_t d) {
  return plan_routing(src.data(), dst.data(), rows.data(), static_cast<int64_t>(src.size()), s, d);
}

Ints slice(const Ints& v, const Ints& offsets, int64_t k) {
  return Ints(v.begin() + offsets[k], v.begin() + offsets[k + 1]);
}

TEST_CASE(hand_computed_plan) {
  // 6 samples, 2 encoder replicas, 3 LLM replicas.
  const Ints src = {1, 0, 1, 0, 1, 0};
  const Ints dst = {2, 0, 0, 2, 2, 1};
  const Ints rows = {5, 3, 0, 7, 2, 4};
  const RoutingPlan p = plan(src, dst, rows, 2, 3);
  CHECK_EQ(p.send_rows, (Ints{3, 4, 7, 0, 0, 7}));
  CHECK_EQ(slice(p.pair_samples, p.pair_offsets, 0 * 3 + 0), (Ints{1}));
  CHECK_EQ(slice(p.pair_samples, p.pair_offsets, 0 * 3 + 2), (Ints{3}));
  CHECK_EQ(slice(p.pair_samples, p.pair_offsets, 1 * 3 + 0), (Ints{2}));  // zero rows, routed
  CHECK_EQ(slice(p.pair_samples, p.pair_offsets, 1 * 3 + 1), (Ints{}));
  CHECK_EQ(slice(p.pair_samples, p.pair_offsets, 1 * 3 + 2), (Ints{0, 4}));
  CHECK_EQ(slice(p.send_order, p.send_offsets, 0), (Ints{1, 5, 3}));
  CHECK_EQ(slice(p.send_order, p.send_offsets, 1), (Ints{2, 0, 4}));
  CHECK_EQ(slice(p.recv_order, p.recv_offsets, 0), (Ints{1, 2}));
  CHECK_EQ(slice(p.recv_order, p.recv_offsets, 1), (Ints{5}));
  CHECK_EQ(slice(p.recv_order, p.recv_offsets, 2), (Ints{0, 3, 4}));
}

TEST_CASE(empty_microbatch) {
  const RoutingPlan p = plan({}, {}, {}, 2, 2);
  CHECK_EQ(p.send_rows, (Ints{0, 0, 0, 0}));
  CHECK_EQ(p.pair_offsets, (Ints{0, 0, 0, 0, 0}));
  CHECK_EQ(p.recv_offsets, (Ints{0, 0, 0}));
}

TEST_CASE(random_plans_route_every_sample_once) {
  std::mt19937_64 gen(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t s = 1 + gen() % 4, d = 1 + gen() % 4, n = gen() % 30;
    Ints src(n), dst(n), rows(n);
    for (int64_t i = 0; i < n; ++i) {
      src[i] = gen() % s;
      dst[i] = gen() % d;
      rows[i] = gen() % 3 == 0 ? 0 : gen() % 50;
    }
    const RoutingPlan p = plan(src, dst, rows, s, d);
    Ints seen(n, 0);
    for (int64_t a = 0; a < s; ++a) {
      for (int64_t b = 0; b < d; ++b) {
        const Ints pair = slice(p.pair_samples, p.pair_offsets, a * d + b);
        CHECK(std::is_sorted(pair.begin(), pair.end()));
        int64_t total = 0;
        for (const int64_t i : pair) {
          CHECK_EQ(src[i], a);
          CHECK_EQ(dst[i], b);
          total += rows[i];
          ++seen[i];
        }
        CHECK_EQ(total, p.send_rows[a * d + b]);
      }
      Ints expected;  // send order = pairs (a, 0..d-1) concatenated
      for (int64_t b = 0; b < d; ++b) {
        const Ints pair = slice(p.pair_samples, p.pair_offsets, a * d + b);
        expected.insert(expected.end(), pair.begin(), pair.end());
      }
      CHECK_EQ(slice(p.send_order, p.send_offsets, a), expected);
    }
    for (int64_t b = 0; b < d; ++b) {
      Ints expected;
      for (int64_t i = 0; i < n; ++i)
        if (dst[i] == b) expected.push_back(i);
      CHECK_EQ(slice(p.recv_order, p.recv_offsets, b), expected);
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int64_t c) { return c == 1; }));
  }
}

TEST_CASE(plan_errors_name_argument_and_index) {
  CHECK_THROWS_WITH(plan({0, 2}, {0, 0}, {1, 1}, 2, 1), InvalidArgument, "src_replica[1]=2");
  CHECK_THROWS_WITH(plan({0, 0}, {0, -1}, {1, 1}, 1, 1), InvalidArgument, "dst_replica[1]=-1");
  CHECK_THROWS_WITH(plan({0, 0}, {0, 0}, {1, -4}, 1, 1), InvalidArgument, "rows[1]=-4");
  CHECK_THROWS_WITH(plan({}, {}, {}, 0, 1), InvalidArgument, "num_src");
  CHECK_THROWS_WITH(plan({}, {}, {}, 1, 0), InvalidArgument, "num_dst");
}

}  // namespace

int main(int argc, char** argv) { return dflop_test::run_all(argc, argv); }
