// Routing of one microbatch's encoder features between the encoder's and the LLM's
// data-parallel replicas (the inter-model communicator's plan).
//
// The items routed are the pieces of the microbatch's encoder split (split_units: a
// contiguous unit range of one sample, ordered by (sample, first unit)). Each is encoded
// by one encoder DP replica (`src_replica`) and consumed by the LLM DP replica that the
// Schedule gave its sample (`dst_replica`); its features are `rows` rows of the LLM's
// hidden size. The plan says how many rows each (src, dst) pair moves and in which order
// the pieces travel, so that both ends derive every message shape without a handshake.
//
// Orders (all by item index = position in the microbatch's arrays):
// - pair (s, d): the items with src s and dst d, ascending;
// - send order of src s: its pairs (s, 0), (s, 1), ..., (s, D-1) concatenated, i.e. its
//   items grouped by dst, ascending within a group (one contiguous slice per dst);
// - recv order of dst d: its items ascending: for pieces in (sample, unit) order, every
//   sample's units in order, samples in the order of Schedule.bin, which is how the LLM
//   replica lays out its packed sequence.
#pragma once

#include <cstdint>
#include <vector>

namespace dflop {

struct RoutingPlan {
  int64_t num_samples = 0;
  int64_t num_src = 0;  // encoder DP replicas
  int64_t num_dst = 0;  // LLM DP replicas
  // num_src x num_dst, row-major: feature rows that src s sends to dst d.
  std::vector<int64_t> send_rows;
  // CSR over the num_src x num_dst pairs (row-major, num_src * num_dst + 1 offsets):
  // pair_samples[pair_offsets[s * D + d] .. pair_offsets[s * D + d + 1]) are pair (s, d).
  std::vector<int64_t> pair_offsets;
  std::vector<int64_t> pair_samples;
  // CSR per src (num_src + 1 offsets): each src's send order.
  std::vector<int64_t> send_offsets;
  std::vector<int64_t> send_order;
  // CSR per dst (num_dst + 1 offsets): each dst's receive order.
  std::vector<int64_t> recv_offsets;
  std::vector<int64_t> recv_order;
};

// The most replicas per side (its S x D pair arrays hold at most 2^24 (+1) entries).
constexpr int64_t kMaxRoutingReplicas = int64_t{1} << 12;

// Validates and builds the plan in O(N + S * D). Throws InvalidArgument naming the
// argument and the first offending index when num_src or num_dst is outside [1,
// kMaxRoutingReplicas], a replica is out of [0, num_src) / [0, num_dst), rows[i] < 0, or
// a pair's rows overflow int64.
RoutingPlan plan_routing(const int64_t* src_replica, const int64_t* dst_replica,
                         const int64_t* rows, int64_t num_samples, int64_t num_src,
                         int64_t num_dst);

}  // namespace dflop
