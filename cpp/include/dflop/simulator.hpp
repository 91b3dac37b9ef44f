// Discrete-event simulation of one training step of one or more pipelines (data-parallel
// replicas), each with S stages running m microbatches under 1F1B or GPipe, followed by a
// per-stage gradient all-reduce across the replicas and a step barrier.
//
// Model (the runtime's behaviour the planner relies on):
// - Every stage runs its actions strictly in the order pipeline_actions() gives, one at a
//   time. An action starts when its stage is free and its input has arrived: the forward
//   of microbatch k at stage s needs the activation of forward k at stage s-1; the
//   backward of k at stage s needs the gradient of backward k at stage s+1 (the last
//   stage's backward needs only its own forward, which precedes it in the order).
// - A transfer over link l (stage l <-> l+1) of b bytes occupies that link direction for
//   b / bandwidth seconds, FIFO in the sender's order (activations forward and gradients
//   backward use separate directions: links are full duplex), and arrives latency seconds
//   after it leaves the link. Gradients are as large as the activations. Transfers run
//   asynchronously: they never occupy the sending stage's compute.
// - After its last backward, stage s waits for the same stage of every replica and then
//   all-reduces gradients for allreduce_s[s] seconds (not overlapped with backward).
//   step time = max over stages of (max over replicas of last backward end + allreduce_s).
// - busy = compute (forward + backward) seconds; idle = step time - busy: time spent
//   waiting, in pipeline bubbles, and in the all-reduce and the barrier.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflop {

enum class ScheduleKind : int8_t { OneFOneB = 0, GPipe = 1 };

// "1f1b" or "gpipe" (case-insensitive); throws InvalidArgument otherwise.
ScheduleKind parse_schedule_kind(const std::string& name);
const char* schedule_kind_name(ScheduleKind kind);

struct PipelineAction {
  bool is_forward = true;
  int64_t microbatch = 0;
};

// The exact order of actions of one stage (0-indexed) of an S-stage pipeline with m
// microbatches; the runtime executes the same order.
// - GPipe: F0, F1, ..., F(m-1), then B0, B1, ..., B(m-1).
// - 1F1B (non-interleaved, as in Megatron-LM): w = min(S - 1 - stage, m) warm-up
//   forwards F0..F(w-1); then for i = 0 .. m-w-1 the steady pair F(w+i), B(i); then the
//   cool-down backwards B(m-w)..B(m-1). Equivalently: run a forward while forwards
//   remain and fewer than S - stage microbatches are in flight, else the oldest backward.
// The most microbatches of one step (a stage lists 2 actions per microbatch).
constexpr int64_t kMaxPipelineMicrobatches = 10'000'000;

// Throws InvalidArgument for num_stages < 1, num_microbatches outside [1,
// kMaxPipelineMicrobatches] or stage out of range.
std::vector<PipelineAction> pipeline_actions(ScheduleKind kind, int64_t num_stages,
                                             int64_t num_microbatches, int64_t stage);

enum class EventKind : int8_t { Forward = 0, Backward = 1, Send = 2, AllReduce = 3 };

struct SimEvent {
  int64_t replica = 0;
  int64_t stage = 0;  // the stage computing, sending, or all-reducing
  EventKind kind = EventKind::Forward;
  int64_t microbatch = -1;  // -1 for AllReduce
  int64_t peer_stage = -1;  // Send: the receiving stage (stage + 1 or stage - 1); else -1
  double start_s = 0.0;
  double end_s = 0.0;  // Send: arrival at the peer (after bandwidth time and latency)
};

struct PipelineSimInput {
  int64_t num_replicas = 1;
  int64_t num_stages = 1;
  int64_t num_microbatches = 1;
  ScheduleKind schedule = ScheduleKind::OneFOneB;
  // num_replicas x num_stages x num_microbatches, row-major; finite and >= 0.
  std::vector<double> forward_s;
  std::vector<double> backward_s;
  // num_stages - 1 each, link l joins stage l and l + 1. Latency finite and >= 0;
  // bandwidth > 0 (+inf: transfers take only the latency).
  std::vector<double> link_latency_s;
  std::vector<double> link_bandwidth_bytes_per_s;
  // Empty (nothing to send), or num_replicas x (num_stages - 1) x num_microbatches:
  // bytes of microbatch k's activation over link l; finite and >= 0.
  std::vector<double> activation_bytes;
  // Empty (no all-reduce), or num_stages: all-reduce seconds per stage; finite and >= 0.
  std::vector<double> allreduce_s;
  // false: leave PipelineSimResult::events empty (the planner's hot loop needs only times).
  bool record_events = true;
};

struct PipelineSimResult {
  double step_time_s = 0.0;
  std::vector<double> compute_end_s;  // num_replicas x num_stages: end of the last backward
  std::vector<double> busy_s;         // num_replicas x num_stages: forward + backward seconds
  std::vector<double> idle_s;         // num_replicas x num_stages: step_time_s - busy_s
  // Every forward, backward, send and all-reduce, sorted by (start_s, replica, stage,
  // kind, microbatch, peer_stage).
  std::vector<SimEvent> events;
};

// Throws InvalidArgument naming the first problem (argument, index, value).
void validate_pipeline_input(const PipelineSimInput& input);

// Validates, then simulates one step.
PipelineSimResult simulate_pipeline(const PipelineSimInput& input);

}  // namespace dflop
