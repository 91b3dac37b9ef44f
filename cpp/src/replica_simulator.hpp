// One replica's pipeline, simulated (private to the core). simulate_pipeline() runs it
// per replica and records events; the pipeline-aware scheduler runs it thousands of times
// per step on buffers it reuses, so the orders and the state are allocated once here.
//
// Each stage runs its fixed action order, so an action's start time depends only on its
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
#include <stdexcept>
#include <string>
#include <vector>

#include "dflop/simulator.hpp"

namespace dflop::detail {

class ReplicaSimulator {
 public:
  ReplicaSimulator(ScheduleKind kind, int64_t num_stages, int64_t num_microbatches)
      : num_stages_(num_stages),
        m_(num_microbatches),
        fwd_arrival_(static_cast<size_t>(num_stages * num_microbatches)),
        bwd_arrival_(static_cast<size_t>(num_stages * num_microbatches)),
        stage_free_s_(static_cast<size_t>(num_stages)),
        busy_s_(static_cast<size_t>(num_stages)),
        next_action_(static_cast<size_t>(num_stages)),
        link_fwd_free_s_(static_cast<size_t>(num_stages - 1)),
        link_bwd_free_s_(static_cast<size_t>(num_stages - 1)),
        queued_(static_cast<size_t>(num_stages)) {
    orders_.reserve(static_cast<size_t>(num_stages));
    for (int64_t s = 0; s < num_stages; ++s) {
      orders_.push_back(pipeline_actions(kind, num_stages, num_microbatches, s));
    }
  }

  // Simulates one step. forward_s/backward_s: num_stages x m (row-major) seconds;
  // latency_s and bandwidth: num_stages - 1 (bandwidth may be null: infinite); bytes:
  // (num_stages - 1) x m or null (nothing to send). Inputs are trusted (validated by the
  // caller). on_event(stage, kind, microbatch, peer_stage, start_s, end_s) sees every
  // compute and send. Returns the time the last stage's compute ends.
  template <class OnEvent>
  double run(const double* forward_s, const double* backward_s, const double* latency_s,
             const double* bandwidth, const double* bytes, OnEvent&& on_event) {
    const int64_t S = num_stages_, m = m_;
    std::fill(fwd_arrival_.begin(), fwd_arrival_.end(), kUnknown);
    std::fill(bwd_arrival_.begin(), bwd_arrival_.end(), kUnknown);
    std::fill(stage_free_s_.begin(), stage_free_s_.end(), 0.0);
    std::fill(busy_s_.begin(), busy_s_.end(), 0.0);
    std::fill(next_action_.begin(), next_action_.end(), size_t{0});
    std::fill(link_fwd_free_s_.begin(), link_fwd_free_s_.end(), 0.0);
    std::fill(link_bwd_free_s_.begin(), link_bwd_free_s_.end(), 0.0);
    std::fill(queued_.begin(), queued_.end(), char{1});
    worklist_.clear();
    for (int64_t s = 0; s < S; ++s) worklist_.push_back(s);

    // Sends microbatch k's tensor from stage `from` to `to`; returns the arrival time.
    auto send = [&](int64_t from, int64_t to, int64_t k, double ready_s) {
      const int64_t link = std::min(from, to);
      const double size = bytes == nullptr ? 0.0 : bytes[link * m + k];
      const double transfer_s =
          (bandwidth == nullptr || size == 0.0) ? 0.0 : size / bandwidth[link];
      double& link_free_s = (to > from ? link_fwd_free_s_ : link_bwd_free_s_)[link];
      const double start_s = std::max(ready_s, link_free_s);
      link_free_s = start_s + transfer_s;
      const double arrival_s = link_free_s + latency_s[link];
      on_event(from, EventKind::Send, k, to, start_s, arrival_s);
      if (!queued_[to]) {
        queued_[to] = 1;
        worklist_.push_back(to);
      }
      return arrival_s;
    };

    while (!worklist_.empty()) {
      const int64_t s = worklist_.front();
      worklist_.pop_front();
      queued_[s] = 0;
      const auto& order = orders_[static_cast<size_t>(s)];
      while (next_action_[s] < order.size()) {
        const PipelineAction action = order[next_action_[s]];
        const int64_t k = action.microbatch;
        const size_t sk = static_cast<size_t>(s * m + k);
        // The first stage's forwards and the last stage's backwards (whose forward came
        // earlier in this stage's order) have no input to wait for.
        double input_s = 0.0;
        if (action.is_forward && s > 0) input_s = fwd_arrival_[sk];
        if (!action.is_forward && s < S - 1) input_s = bwd_arrival_[sk];
        if (std::isnan(input_s)) break;  // woken again when the input is sent
        const double duration_s = action.is_forward ? forward_s[sk] : backward_s[sk];
        const double start_s = std::max(stage_free_s_[s], input_s);
        const double end_s = start_s + duration_s;
        stage_free_s_[s] = end_s;
        busy_s_[s] += duration_s;
        on_event(s, action.is_forward ? EventKind::Forward : EventKind::Backward, k, int64_t{-1},
                 start_s, end_s);
        ++next_action_[s];
        if (action.is_forward && s < S - 1) {
          fwd_arrival_[static_cast<size_t>((s + 1) * m + k)] = send(s, s + 1, k, end_s);
        } else if (!action.is_forward && s > 0) {
          bwd_arrival_[static_cast<size_t>((s - 1) * m + k)] = send(s, s - 1, k, end_s);
        }
      }
    }
    double end_s = 0.0;
    for (int64_t s = 0; s < S; ++s) {
      // Unreachable for the schedules pipeline_actions() gives (each is deadlock-free).
      if (next_action_[s] != orders_[static_cast<size_t>(s)].size()) {
        throw std::logic_error("pipeline simulation deadlocked at stage " + std::to_string(s));
      }
      end_s = std::max(end_s, stage_free_s_[s]);
    }
    return end_s;
  }

  // Without events.
  double run(const double* forward_s, const double* backward_s, const double* latency_s) {
    return run(forward_s, backward_s, latency_s, nullptr, nullptr,
               [](int64_t, EventKind, int64_t, int64_t, double, double) {});
  }

  // After run(): the end of each stage's last action, and its compute seconds.
  const std::vector<double>& stage_end_s() const { return stage_free_s_; }
  const std::vector<double>& busy_s() const { return busy_s_; }

 private:
  static constexpr double kUnknown = std::numeric_limits<double>::quiet_NaN();
  int64_t num_stages_, m_;
  std::vector<std::vector<PipelineAction>> orders_;
  std::vector<double> fwd_arrival_, bwd_arrival_;  // input arrival per (stage, mb); NaN = not sent
  std::vector<double> stage_free_s_, busy_s_;
  std::vector<size_t> next_action_;
  std::vector<double> link_fwd_free_s_, link_bwd_free_s_;
  std::vector<char> queued_;
  std::deque<int64_t> worklist_;
};

}  // namespace dflop::detail
