// Routing plan of the inter-model communicator and the per-microbatch encoder split.
#include "dflop/routing.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <string>

#include "dflop/errors.hpp"

namespace dflop {
namespace {

// Relative slack for "strictly better": loads are sums of doubles, so an exchange that
// only reorders the same summands must not count as an improvement (it would cycle).
constexpr double kRelEps = 1e-12;

[[noreturn]] void invalid(const std::string& what) { throw InvalidArgument(what); }

template <typename T>
std::string str(const T& v) {
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

}  // namespace

RoutingPlan plan_routing(const int64_t* src_replica, const int64_t* dst_replica,
                         const int64_t* rows, int64_t num_samples, int64_t num_src,
                         int64_t num_dst) {
  if (num_samples < 0) invalid("num_samples must be >= 0, got " + str(num_samples));
  if (num_src < 1) invalid("num_src must be >= 1, got " + str(num_src));
  if (num_dst < 1) invalid("num_dst must be >= 1, got " + str(num_dst));
  for (int64_t i = 0; i < num_samples; ++i) {
    if (src_replica[i] < 0 || src_replica[i] >= num_src)
      invalid("src_replica[" + str(i) + "]=" + str(src_replica[i]) + " is out of range [0, " +
              str(num_src) + ")");
    if (dst_replica[i] < 0 || dst_replica[i] >= num_dst)
      invalid("dst_replica[" + str(i) + "]=" + str(dst_replica[i]) + " is out of range [0, " +
              str(num_dst) + ")");
    if (rows[i] < 0) invalid("rows[" + str(i) + "]=" + str(rows[i]) + " must be >= 0");
  }

  RoutingPlan plan;
  plan.num_samples = num_samples;
  plan.num_src = num_src;
  plan.num_dst = num_dst;
  const int64_t num_pairs = num_src * num_dst;
  plan.send_rows.assign(num_pairs, 0);
  plan.pair_offsets.assign(num_pairs + 1, 0);
  plan.recv_offsets.assign(num_dst + 1, 0);

  // Counting sort by pair: visiting samples in ascending index keeps each pair ascending.
  for (int64_t i = 0; i < num_samples; ++i) {
    const int64_t pair = src_replica[i] * num_dst + dst_replica[i];
    plan.send_rows[pair] += rows[i];
    ++plan.pair_offsets[pair + 1];
    ++plan.recv_offsets[dst_replica[i] + 1];
  }
  std::partial_sum(plan.pair_offsets.begin(), plan.pair_offsets.end(), plan.pair_offsets.begin());
  std::partial_sum(plan.recv_offsets.begin(), plan.recv_offsets.end(), plan.recv_offsets.begin());
  plan.pair_samples.assign(num_samples, 0);
  plan.recv_order.assign(num_samples, 0);
  std::vector<int64_t> pair_fill(plan.pair_offsets.begin(), plan.pair_offsets.end() - 1);
  std::vector<int64_t> recv_fill(plan.recv_offsets.begin(), plan.recv_offsets.end() - 1);
  for (int64_t i = 0; i < num_samples; ++i) {
    plan.pair_samples[pair_fill[src_replica[i] * num_dst + dst_replica[i]]++] = i;
    plan.recv_order[recv_fill[dst_replica[i]]++] = i;
  }
  // The pairs are laid out src-major, so each src's send order (grouped by dst) is its
  // contiguous run of pairs.
  plan.send_order = plan.pair_samples;
  plan.send_offsets.assign(num_src + 1, 0);
  for (int64_t s = 0; s <= num_src; ++s) plan.send_offsets[s] = plan.pair_offsets[s * num_dst];
  return plan;
}

std::vector<int64_t> split_for_encoder(const double* costs, int64_t num_samples,
                                       int64_t num_replicas) {
  if (num_samples < 0) invalid("num_samples must be >= 0, got " + str(num_samples));
  if (num_replicas < 1) invalid("num_replicas must be >= 1, got " + str(num_replicas));
  for (int64_t i = 0; i < num_samples; ++i)
    if (!(costs[i] >= 0.0) || !std::isfinite(costs[i]))
      invalid("encoder_costs[" + str(i) + "]=" + str(costs[i]) + " must be finite and >= 0");

  std::vector<int64_t> replica(num_samples, -1);
  std::vector<double> load(num_replicas, 0.0);
  std::vector<int64_t> count(num_replicas, 0);

  // LPT over the samples with a cost, costliest first (ties: lower index first).
  std::vector<int64_t> order;
  for (int64_t i = 0; i < num_samples; ++i)
    if (costs[i] > 0.0) order.push_back(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  for (const int64_t i : order) {
    int64_t best = 0;
    for (int64_t r = 1; r < num_replicas; ++r)
      if (load[r] < load[best] || (load[r] == load[best] && count[r] < count[best])) best = r;
    replica[i] = best;
    load[best] += costs[i];
    ++count[best];
  }

  // Local search: move one sample, or swap two, between the most loaded replica and
  // another one whenever that lowers the larger of the two loads. Each accepted step
  // lowers the sorted load vector lexicographically, so it terminates; the iteration cap
  // only bounds the cost on large microbatches (LPT is already within 4/3 of optimal).
  if (num_replicas > 1 && !order.empty()) {
    const int64_t max_steps = 4 * static_cast<int64_t>(order.size()) + 16;
    for (int64_t step = 0; step < max_steps; ++step) {
      const int64_t top =
          static_cast<int64_t>(std::max_element(load.begin(), load.end()) - load.begin());
      const double top_load = load[top];
      const double threshold = top_load * (1.0 - kRelEps);
      double best_pair_max = threshold;
      int64_t best_a = -1, best_b = -1, best_r = -1;  // best_b = -1: a move
      for (const int64_t a : order) {
        if (replica[a] != top) continue;
        for (int64_t r = 0; r < num_replicas; ++r) {
          if (r == top) continue;
          const double moved = std::max(top_load - costs[a], load[r] + costs[a]);
          if (moved < best_pair_max) {
            best_pair_max = moved;
            best_a = a, best_b = -1, best_r = r;
          }
        }
        for (const int64_t b : order) {
          const int64_t r = replica[b];
          if (r == top || costs[b] >= costs[a]) continue;
          const double delta = costs[a] - costs[b];
          const double swapped = std::max(top_load - delta, load[r] + delta);
          if (swapped < best_pair_max) {
            best_pair_max = swapped;
            best_a = a, best_b = b, best_r = r;
          }
        }
      }
      if (best_a < 0) break;
      load[top] -= costs[best_a];
      load[best_r] += costs[best_a];
      replica[best_a] = best_r;
      --count[top];
      ++count[best_r];
      if (best_b >= 0) {
        load[best_r] -= costs[best_b];
        load[top] += costs[best_b];
        replica[best_b] = top;
        --count[best_r];
        ++count[top];
      }
    }
  }

  // Zero-cost samples cost the encoder nothing but still need an owner (their features
  // are empty): spread them by count so no replica's bookkeeping grows lopsided.
  for (int64_t i = 0; i < num_samples; ++i) {
    if (replica[i] >= 0) continue;
    const int64_t fewest =
        static_cast<int64_t>(std::min_element(count.begin(), count.end()) - count.begin());
    replica[i] = fewest;
    ++count[fewest];
  }
  return replica;
}

}  // namespace dflop
