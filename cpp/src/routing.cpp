// Routing plan of the inter-model communicator.
#include "dflop/routing.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>

#include "dflop/errors.hpp"

namespace dflop {
namespace {

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
  if (num_src < 1 || num_src > kMaxRoutingReplicas)
    invalid("num_src must be in [1, " + str(kMaxRoutingReplicas) + "], got " + str(num_src));
  if (num_dst < 1 || num_dst > kMaxRoutingReplicas)
    invalid("num_dst must be in [1, " + str(kMaxRoutingReplicas) + "], got " + str(num_dst));
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
    if (rows[i] > std::numeric_limits<int64_t>::max() - plan.send_rows[pair])
      invalid("rows of the (src " + str(src_replica[i]) + ", dst " + str(dst_replica[i]) +
              ") pair overflow int64 at rows[" + str(i) + "]=" + str(rows[i]));
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

}  // namespace dflop
