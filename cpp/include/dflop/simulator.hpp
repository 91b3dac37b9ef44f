// Discrete-event simulation of one training step of one or more pipelines (data-parallel
// replicas), each running a pipeline program (pipeline_program.hpp: 1F1B, GPipe,
// interleaved 1F1B, or any valid action list) over m microbatches, followed by a
// per-stage gradient all-reduce across the replicas and a step barrier.
//
// Model (the runtime's behaviour the planner relies on):
// - Every physical stage runs its actions strictly in the program's order, one at a time.
//   An action starts when its stage is free and its input has arrived: the forward of
//   microbatch k at virtual stage v needs the activation of forward k at v - 1; the
//   backward (or input-gradient backward) of k at v needs the gradient of k from v + 1 (the
//   last virtual stage's needs only its own forward, which precedes it in the order); a
//   weight-gradient backward needs nothing beyond its stage's order.
// - gradient_links[l] = 0: boundary l sends no gradient; v = l's backward needs only its forward.
// - A transfer from virtual stage v to v + 1 (or back) of b bytes occupies the link between
//   their physical stages in that direction for b / bandwidth seconds, FIFO in the order the
//   sends are made (links are full duplex; the boundaries of several chunk pairs that join
//   the same two stages share one link), and arrives latency seconds after it leaves the
//   link. Gradients are as large as the activations. Transfers run asynchronously: they
//   never occupy the sending stage's compute.
// - After its last action, physical stage s waits for the same stage of every replica and
//   then all-reduces gradients for allreduce_s[s] seconds (not overlapped with backward).
//   step time = max over stages of (max over replicas of last action end + allreduce_s).
// - busy = compute seconds; idle = step time - busy: time spent waiting, in pipeline
//   bubbles, and in the all-reduce and the barrier.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dflop/pipeline_program.hpp"

namespace dflop {

enum class EventKind : int8_t {
  Forward = 0,
  Backward = 1,
  Send = 2,
  AllReduce = 3,
  BackwardInput = 4,
  BackwardWeight = 5,
};

struct SimEvent {
  int64_t replica = 0;
  int64_t stage = 0;  // the physical stage computing, sending, or all-reducing
  EventKind kind = EventKind::Forward;
  int64_t microbatch = -1;  // -1 for AllReduce
  int64_t peer_stage = -1;  // Send: the receiving physical stage; else -1
  double start_s = 0.0;
  double end_s = 0.0;  // Send: arrival at the peer (after bandwidth time and latency)
  // The virtual stage computing (a Send: the sending one); -1 for AllReduce.
  int64_t virtual_stage = -1;
};

struct PipelineSimInput {
  int64_t num_replicas = 1;
  int64_t num_stages = 1;  // physical stages
  int64_t num_microbatches = 1;
  PipelineOrder order = PipelineOrder::OneFOneB;
  // Empty: one segment of num_stages stages, one chunk each. Else its physical stages must
  // sum to num_stages; V = num_virtual_stages(shape) below.
  PipelineShape shape;
  // Empty: pipeline_program(order, shape, m)'s. Else one action list per physical stage
  // (validate_program() checks it with the shape's owners); order is then ignored.
  std::vector<std::vector<PipelineAction>> actions;
  // The share of backward_s a BackwardWeight action takes (its BackwardInput the rest);
  // in [0, 1]. Used only by programs that split backwards, where weight_s is empty.
  double weight_grad_fraction = 0.5;
  // num_replicas x V x num_microbatches, row-major; finite and >= 0.
  std::vector<double> forward_s;
  std::vector<double> backward_s;
  // Empty, or like backward_s: the seconds of backward_s (at most it) a BackwardWeight
  // action takes, its BackwardInput the rest (a stage whose input takes no gradient
  // defers all of its backward; a frozen one that passes gradients on, none).
  std::vector<double> weight_s;
  // V - 1 each, boundary l joins virtual stage l and l + 1. Latency finite and >= 0;
  // bandwidth > 0 (+inf: transfers take only the latency).
  std::vector<double> link_latency_s;
  std::vector<double> link_bandwidth_bytes_per_s;
  // Empty (nothing to send), or num_replicas x (V - 1) x num_microbatches: bytes of
  // microbatch k's activation over boundary l; finite and >= 0.
  std::vector<double> activation_bytes;
  // Empty (every boundary carries gradients back), or V - 1 values of 0 or 1: 0 = boundary
  // l sends no gradient back (e.g. virtual stages 0..l are frozen: their backwards compute
  // nothing and need no gradient). Virtual stage l's backward (B or I) then needs only its
  // own forward, and l + 1's makes no Send over boundary l (the link is not charged).
  std::vector<uint8_t> gradient_links;
  // Empty (no all-reduce), or num_stages: all-reduce seconds per physical stage; finite
  // and >= 0.
  std::vector<double> allreduce_s;
  // false: leave PipelineSimResult::events empty (the planner's hot loop needs only times).
  bool record_events = true;
};

struct PipelineSimResult {
  double step_time_s = 0.0;
  std::vector<double> compute_end_s;  // num_replicas x num_stages: end of the last action
  std::vector<double> busy_s;         // num_replicas x num_stages: compute seconds
  std::vector<double> idle_s;         // num_replicas x num_stages: step_time_s - busy_s
  // Every compute action, send and all-reduce, sorted by (start_s, replica, stage, kind,
  // microbatch, peer_stage, virtual_stage).
  std::vector<SimEvent> events;
};

// The shape an input describes (its own, or one segment of num_stages stages).
PipelineShape input_shape(const PipelineSimInput& input);

// Throws InvalidArgument naming the first problem (argument, index, value).
void validate_pipeline_input(const PipelineSimInput& input);

// Validates, then simulates one step.
PipelineSimResult simulate_pipeline(const PipelineSimInput& input);

}  // namespace dflop
