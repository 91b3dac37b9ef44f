// One replica's pipeline, simulated (private to the core). simulate_pipeline() runs it
// per replica and records events; the pipeline-aware scheduler runs it thousands of times
// per step on buffers it reuses, so the orders and the state are allocated once here.
//
// Each physical stage runs its fixed action order, so an action's start time depends only on its
// stage's previous action and on its input's arrival: the simulation advances each stage
// as far as its inputs allow and wakes the neighbour that a finished action sends to (a
// worklist instead of a global clock; the times are the same as a time-ordered event
// loop's, and the cost is linear in the number of actions).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dflop/simulator.hpp"

namespace dflop::detail {

class ReplicaSimulator {
 public:
  // `program` must be valid (validate_program()).
  explicit ReplicaSimulator(PipelineProgram program)
      : program_(std::move(program)),
        num_stages_(int64_t(program_.actions.size())),
        num_virtual_(int64_t(program_.owner.size())),
        m_(program_.num_microbatches),
        fwd_arrival_(static_cast<size_t>(num_virtual_ * m_)),
        bwd_arrival_(static_cast<size_t>(num_virtual_ * m_)),
        stage_free_s_(static_cast<size_t>(num_stages_)),
        busy_s_(static_cast<size_t>(num_stages_)),
        next_action_(static_cast<size_t>(num_stages_)),
        queued_(static_cast<size_t>(num_stages_)) {
    // One link per direction between two physical stages, shared by every boundary that
    // joins them.
    std::map<std::pair<int64_t, int64_t>, size_t> links;
    auto link_of = [&](int64_t from, int64_t to) {
      return links.emplace(std::pair{from, to}, links.size()).first->second;
    };
    for (int64_t b = 0; b + 1 < num_virtual_; ++b) {
      const int64_t lo = program_.owner[size_t(b)], hi = program_.owner[size_t(b + 1)];
      fwd_link_.push_back(link_of(lo, hi));
      bwd_link_.push_back(link_of(hi, lo));
    }
    link_free_s_.assign(links.size(), 0.0);
  }

  // The plain pipeline of a pipeline order.
  ReplicaSimulator(PipelineOrder kind, int64_t num_stages, int64_t num_microbatches)
      : ReplicaSimulator(
            pipeline_program(kind, PipelineShape::plain(num_stages), num_microbatches)) {}

  // Simulates one step. forward_s/backward_s: V x m (row-major, V virtual stages) seconds;
  // latency_s and bandwidth: V - 1 (bandwidth may be null: infinite); bytes: (V - 1) x m or
  // null (nothing to send); weight_s: V x m, the seconds of backward_s a BackwardWeight takes
  // (its BackwardInput the rest), or null (weight_grad_fraction of it); gradient_links: V - 1 (0 =
  // no gradient back over that boundary) or null (every boundary carries one). Inputs are trusted
  // (validated by the caller). on_event(stage, kind, microbatch, peer_stage, start_s, end_s,
  // virtual_stage) sees every compute and send. Returns the time the last stage's compute ends.
  template <class OnEvent>
  double run(const double* forward_s, const double* backward_s, const double* latency_s,
             const double* bandwidth, const double* bytes, const double* weight_s,
             double weight_grad_fraction, const uint8_t* gradient_links, OnEvent&& on_event) {
    const int64_t V = num_virtual_, m = m_;
    std::fill(fwd_arrival_.begin(), fwd_arrival_.end(), kUnknown);
    std::fill(bwd_arrival_.begin(), bwd_arrival_.end(), kUnknown);
    std::fill(stage_free_s_.begin(), stage_free_s_.end(), 0.0);
    std::fill(busy_s_.begin(), busy_s_.end(), 0.0);
    std::fill(next_action_.begin(), next_action_.end(), size_t{0});
    std::fill(link_free_s_.begin(), link_free_s_.end(), 0.0);
    std::fill(queued_.begin(), queued_.end(), char{1});
    worklist_.clear();
    for (int64_t s = 0; s < num_stages_; ++s) worklist_.push_back(s);

    // Sends microbatch k's tensor from virtual stage `from` to `to` (a neighbour); returns
    // the arrival time.
    auto send = [&](int64_t from, int64_t to, int64_t k, double ready_s) {
      const int64_t boundary = std::min(from, to);
      const double size = bytes == nullptr ? 0.0 : bytes[boundary * m + k];
      const double transfer_s =
          (bandwidth == nullptr || size == 0.0) ? 0.0 : size / bandwidth[boundary];
      double& link_free_s = link_free_s_[(to > from ? fwd_link_ : bwd_link_)[size_t(boundary)]];
      const double start_s = std::max(ready_s, link_free_s);
      link_free_s = start_s + transfer_s;
      const double arrival_s = link_free_s + latency_s[boundary];
      const int64_t peer = program_.owner[size_t(to)];
      on_event(program_.owner[size_t(from)], EventKind::Send, k, peer, start_s, arrival_s, from);
      if (!queued_[peer]) {
        queued_[peer] = 1;
        worklist_.push_back(peer);
      }
      return arrival_s;
    };

    auto carries_grad = [gradient_links](int64_t boundary) {
      return gradient_links == nullptr || gradient_links[boundary] != 0;
    };

    while (!worklist_.empty()) {
      const int64_t s = worklist_.front();
      worklist_.pop_front();
      queued_[s] = 0;
      const auto& order = program_.actions[static_cast<size_t>(s)];
      while (next_action_[s] < order.size()) {
        const PipelineAction action = order[next_action_[s]];
        const int64_t v = action.stage, k = action.microbatch;
        const size_t vk = static_cast<size_t>(v * m + k);
        const bool is_forward = action.kind == ActionKind::Forward;
        const bool sends_grad =
            action.kind == ActionKind::Backward || action.kind == ActionKind::BackwardInput;
        // The first virtual stage's forwards, the backwards of the last one and of those with
        // no gradient link after them (their forward came earlier in this stage's order) and
        // weight gradients wait for no input.
        double input_s = 0.0;
        if (is_forward && v > 0) input_s = fwd_arrival_[vk];
        if (sends_grad && v < V - 1 && carries_grad(v)) input_s = bwd_arrival_[vk];
        if (std::isnan(input_s)) break;  // woken again when the input is sent
        double duration_s = is_forward ? forward_s[vk] : backward_s[vk];
        if (action.kind == ActionKind::BackwardWeight || action.kind == ActionKind::BackwardInput) {
          const double weight = weight_s ? weight_s[vk] : duration_s * weight_grad_fraction;
          duration_s = action.kind == ActionKind::BackwardWeight ? weight : duration_s - weight;
        }
        const double start_s = std::max(stage_free_s_[s], input_s);
        const double end_s = start_s + duration_s;
        stage_free_s_[s] = end_s;
        busy_s_[s] += duration_s;
        on_event(s, event_kind(action.kind), k, int64_t{-1}, start_s, end_s, v);
        ++next_action_[s];
        if (is_forward && v < V - 1) {
          fwd_arrival_[static_cast<size_t>((v + 1) * m + k)] = send(v, v + 1, k, end_s);
        } else if (sends_grad && v > 0 && carries_grad(v - 1)) {
          bwd_arrival_[static_cast<size_t>((v - 1) * m + k)] = send(v, v - 1, k, end_s);
        }
      }
    }
    double end_s = 0.0;
    for (int64_t s = 0; s < num_stages_; ++s) {
      // Unreachable for valid programs (validate_program() proves they run to the end).
      if (next_action_[s] != program_.actions[static_cast<size_t>(s)].size()) {
        throw std::logic_error("pipeline simulation deadlocked at stage " + std::to_string(s));
      }
      end_s = std::max(end_s, stage_free_s_[s]);
    }
    return end_s;
  }

  // Without events (and without transfers).
  double run(const double* forward_s, const double* backward_s, const double* latency_s,
             const uint8_t* gradient_links = nullptr, const double* weight_s = nullptr) {
    return run(forward_s, backward_s, latency_s, nullptr, nullptr, weight_s, 0.5, gradient_links,
               [](int64_t, EventKind, int64_t, int64_t, double, double, int64_t) {});
  }

  // After run(): the end of each physical stage's last action, and its compute seconds.
  const std::vector<double>& stage_end_s() const { return stage_free_s_; }
  const std::vector<double>& busy_s() const { return busy_s_; }
  const PipelineProgram& program() const { return program_; }

  static EventKind event_kind(ActionKind kind) {
    switch (kind) {
      case ActionKind::Forward:
        return EventKind::Forward;
      case ActionKind::Backward:
        return EventKind::Backward;
      case ActionKind::BackwardInput:
        return EventKind::BackwardInput;
      case ActionKind::BackwardWeight:
        return EventKind::BackwardWeight;
    }
    return EventKind::Backward;
  }

 private:
  static constexpr double kUnknown = std::numeric_limits<double>::quiet_NaN();
  PipelineProgram program_;
  int64_t num_stages_, num_virtual_, m_;
  std::vector<double> fwd_arrival_, bwd_arrival_;  // input arrival per (vstage, mb); NaN = not sent
  std::vector<double> stage_free_s_, busy_s_;
  std::vector<size_t> next_action_;
  std::vector<size_t> fwd_link_, bwd_link_;  // per boundary: its link in each direction
  std::vector<double> link_free_s_;
  std::vector<char> queued_;
  std::deque<int64_t> worklist_;
};

}  // namespace dflop::detail
