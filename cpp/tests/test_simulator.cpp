// Hand-computed cases for the pipeline simulator. Plain main, no framework: each failed
// CHECK prints its location and the run exits non-zero.
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "dflop/errors.hpp"
#include "dflop/simulator.hpp"

namespace {

int g_failures = 0;

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::printf("%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                        \
    }                                                                      \
  } while (0)

#define CHECK_NEAR(a, b)                                                                        \
  do {                                                                                          \
    const double va = (a), vb = (b);                                                            \
    if (!(std::fabs(va - vb) <= 1e-9 * (1.0 + std::fabs(vb)))) {                                \
      std::printf("%s:%d: CHECK_NEAR failed: %s = %.17g, %s = %.17g\n", __FILE__, __LINE__, #a, \
                  va, #b, vb);                                                                  \
      ++g_failures;                                                                             \
    }                                                                                           \
  } while (0)

using dflop::EventKind;
using dflop::PipelineAction;
using dflop::PipelineOrder;
using dflop::PipelineSimInput;
using dflop::PipelineSimResult;

// Calls f, expects dflop::InvalidArgument whose message contains `needle`.
void check_invalid(const std::function<void()>& f, const std::string& needle, int line) {
  try {
    f();
    std::printf("line %d: expected InvalidArgument containing \"%s\"\n", line, needle.c_str());
    ++g_failures;
  } catch (const dflop::InvalidArgument& e) {
    if (std::string(e.what()).find(needle) == std::string::npos) {
      std::printf("line %d: message \"%s\" lacks \"%s\"\n", line, e.what(), needle.c_str());
      ++g_failures;
    }
  }
}

// One replica, zero-latency infinite-bandwidth links, the given per-stage times.
PipelineSimInput make_input(PipelineOrder kind, int64_t num_stages, int64_t num_microbatches,
                            double forward_s, double backward_s) {
  PipelineSimInput in;
  in.num_stages = num_stages;
  in.num_microbatches = num_microbatches;
  in.order = kind;
  in.forward_s.assign(static_cast<size_t>(num_stages * num_microbatches), forward_s);
  in.backward_s.assign(static_cast<size_t>(num_stages * num_microbatches), backward_s);
  in.link_latency_s.assign(static_cast<size_t>(num_stages - 1), 0.0);
  in.link_bandwidth_bytes_per_s.assign(static_cast<size_t>(num_stages - 1),
                                       std::numeric_limits<double>::infinity());
  return in;
}

const dflop::SimEvent* find_event(const PipelineSimResult& res, int64_t replica, int64_t stage,
                                  EventKind kind, int64_t microbatch) {
  for (const auto& e : res.events) {
    if (e.replica == replica && e.stage == stage && e.kind == kind && e.microbatch == microbatch) {
      return &e;
    }
  }
  return nullptr;
}

void check_compute(const PipelineSimResult& res, int64_t stage, EventKind kind, int64_t microbatch,
                   double start_s, double end_s) {
  const auto* e = find_event(res, 0, stage, kind, microbatch);
  CHECK(e != nullptr);
  if (e == nullptr) return;
  CHECK_NEAR(e->start_s, start_s);
  CHECK_NEAR(e->end_s, end_s);
}

std::string order_string(const std::vector<PipelineAction>& actions) {
  std::string s;
  for (const auto& a : actions) {
    if (!s.empty()) s += ' ';
    s += dflop::action_kind_name(a.kind) + std::to_string(a.microbatch);
  }
  return s;
}

void test_action_orders() {
  CHECK(order_string(dflop::pipeline_actions(PipelineOrder::OneFOneB, 4, 6, 1)) ==
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5");
  CHECK(order_string(dflop::pipeline_actions(PipelineOrder::OneFOneB, 4, 6, 3)) ==
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  // Fewer microbatches than warm-up slots: all forwards, then all backwards.
  CHECK(order_string(dflop::pipeline_actions(PipelineOrder::OneFOneB, 4, 2, 0)) == "F0 F1 B0 B1");
  CHECK(order_string(dflop::pipeline_actions(PipelineOrder::GPipe, 3, 3, 2)) ==
        "F0 F1 F2 B0 B1 B2");
  CHECK(dflop::parse_pipeline_order("1F1B") == PipelineOrder::OneFOneB);
  CHECK(dflop::parse_pipeline_order("gpipe") == PipelineOrder::GPipe);
  check_invalid([] { dflop::parse_pipeline_order("zb"); }, "pipeline order", __LINE__);
  check_invalid([] { dflop::pipeline_actions(PipelineOrder::GPipe, 3, 3, 3); }, "stage", __LINE__);
  check_invalid([] { dflop::pipeline_actions(PipelineOrder::GPipe, 3, 0, 0); }, "num_microbatches",
                __LINE__);
}

// Equal stages, zero latency: (m + S - 1) (f + b) for both schedules, including m < S.
void test_uniform_makespan() {
  for (PipelineOrder kind : {PipelineOrder::OneFOneB, PipelineOrder::GPipe}) {
    for (int64_t s : {1, 2, 4, 7}) {
      for (int64_t m : {1, 3, 4, 8, 16}) {
        const double f = 1.0, b = 2.0;
        const auto res = dflop::simulate_pipeline(make_input(kind, s, m, f, b));
        CHECK_NEAR(res.step_time_s, static_cast<double>(m + s - 1) * (f + b));
        for (int64_t st = 0; st < s; ++st) {
          CHECK_NEAR(res.busy_s[st], static_cast<double>(m) * (f + b));
          CHECK_NEAR(res.idle_s[st], static_cast<double>(s - 1) * (f + b));
        }
        // Every compute and send event, no all-reduce events.
        CHECK(res.events.size() == static_cast<size_t>(2 * s * m + 2 * (s - 1) * m));
        for (size_t i = 1; i < res.events.size(); ++i) {
          CHECK(res.events[i - 1].start_s <= res.events[i].start_s);
        }
      }
    }
  }
}

// S = 2, m = 3, f = b = 1, but microbatch 1's forward on stage 0 takes 3 s.
void test_single_slow_microbatch() {
  auto in = make_input(PipelineOrder::OneFOneB, 2, 3, 1.0, 1.0);
  in.forward_s[1] = 3.0;
  auto res = dflop::simulate_pipeline(in);
  CHECK_NEAR(res.step_time_s, 9.0);
  check_compute(res, 0, EventKind::Forward, 1, 1.0, 4.0);
  check_compute(res, 0, EventKind::Backward, 0, 4.0, 5.0);  // waits for F1, not B0's input
  check_compute(res, 1, EventKind::Forward, 1, 4.0, 5.0);
  check_compute(res, 0, EventKind::Backward, 2, 8.0, 9.0);
  CHECK_NEAR(res.busy_s[0], 8.0);
  CHECK_NEAR(res.idle_s[0], 1.0);
  CHECK_NEAR(res.busy_s[1], 6.0);
  CHECK_NEAR(res.idle_s[1], 3.0);

  in.order = PipelineOrder::GPipe;
  res = dflop::simulate_pipeline(in);
  CHECK_NEAR(res.step_time_s, 10.0);
  check_compute(res, 1, EventKind::Backward, 0, 6.0, 7.0);
  check_compute(res, 0, EventKind::Backward, 2, 9.0, 10.0);
}

// The slow stage sets the pace: 1 + 2 m (f + b) of stage 1 + 1.
void test_unequal_stages() {
  auto in = make_input(PipelineOrder::OneFOneB, 2, 2, 1.0, 1.0);
  for (int64_t k = 0; k < 2; ++k) {
    in.forward_s[2 + k] = 2.0;
    in.backward_s[2 + k] = 2.0;
  }
  const auto res = dflop::simulate_pipeline(in);
  CHECK_NEAR(res.step_time_s, 10.0);
  check_compute(res, 1, EventKind::Forward, 1, 5.0, 7.0);
  check_compute(res, 0, EventKind::Backward, 0, 5.0, 6.0);
  check_compute(res, 0, EventKind::Backward, 1, 9.0, 10.0);
  CHECK_NEAR(res.busy_s[0], 4.0);
  CHECK_NEAR(res.busy_s[1], 8.0);
}

void test_latency() {
  // One round trip (2 x 0.5 s) lands on the critical path: 6 -> 7.
  auto in = make_input(PipelineOrder::OneFOneB, 2, 2, 1.0, 1.0);
  in.link_latency_s[0] = 0.5;
  const auto res = dflop::simulate_pipeline(in);
  CHECK_NEAR(res.step_time_s, 7.0);
  check_compute(res, 1, EventKind::Forward, 0, 1.5, 2.5);
  check_compute(res, 1, EventKind::Forward, 1, 3.5, 4.5);
  check_compute(res, 0, EventKind::Backward, 0, 4.0, 5.0);
  check_compute(res, 0, EventKind::Backward, 1, 6.0, 7.0);
  const auto* send = find_event(res, 0, 1, EventKind::Send, 0);
  CHECK(send != nullptr);
  if (send != nullptr) {
    CHECK(send->peer_stage == 0);
    CHECK_NEAR(send->start_s, 3.5);
    CHECK_NEAR(send->end_s, 4.0);
  }
}

// 1 GB over 1 GB/s: transfers of 1 s queue on the link (FIFO per direction).
void test_bandwidth_serialises_transfers() {
  auto in = make_input(PipelineOrder::GPipe, 2, 2, 0.5, 0.5);
  in.link_bandwidth_bytes_per_s[0] = 1e9;
  in.activation_bytes.assign(2, 1e9);
  const auto res = dflop::simulate_pipeline(in);
  CHECK_NEAR(res.step_time_s, 6.0);
  check_compute(res, 1, EventKind::Forward, 1, 2.5, 3.0);
  check_compute(res, 0, EventKind::Backward, 0, 4.5, 5.0);
  check_compute(res, 0, EventKind::Backward, 1, 5.5, 6.0);
}

// Two replicas with a straggler, then per-stage all-reduce across both.
void test_replicas_allreduce() {
  PipelineSimInput in = make_input(PipelineOrder::OneFOneB, 2, 1, 1.0, 1.0);
  in.num_replicas = 2;
  in.forward_s = {1.0, 1.0, 1.0, 3.0};  // replica 1, stage 1 is slow
  in.backward_s = {1.0, 1.0, 1.0, 1.0};
  in.allreduce_s = {1.0, 3.0};
  const auto res = dflop::simulate_pipeline(in);
  // compute ends: replica 0 (4, 3), replica 1 (6, 5); stage 1's all-reduce 5 -> 8.
  CHECK_NEAR(res.compute_end_s[0], 4.0);
  CHECK_NEAR(res.compute_end_s[1], 3.0);
  CHECK_NEAR(res.compute_end_s[2], 6.0);
  CHECK_NEAR(res.compute_end_s[3], 5.0);
  CHECK_NEAR(res.step_time_s, 8.0);
  CHECK_NEAR(res.busy_s[0], 2.0);
  CHECK_NEAR(res.idle_s[0], 6.0);
  CHECK_NEAR(res.idle_s[3], 4.0);
  const auto* ar = find_event(res, 0, 0, EventKind::AllReduce, -1);
  CHECK(ar != nullptr);
  if (ar != nullptr) {
    CHECK_NEAR(ar->start_s, 6.0);  // waits for replica 1's stage 0
    CHECK_NEAR(ar->end_s, 7.0);
  }
  CHECK(res.events.size() == 2u * 2u * 2u + 2u * 2u + 4u);

  // Without the timeline: the same times, no events.
  in.record_events = false;
  const auto quiet = dflop::simulate_pipeline(in);
  CHECK(quiet.events.empty());
  CHECK_NEAR(quiet.step_time_s, 8.0);
  CHECK(quiet.busy_s == res.busy_s);
  CHECK(quiet.compute_end_s == res.compute_end_s);
}

void test_validation() {
  const auto base = make_input(PipelineOrder::OneFOneB, 3, 4, 1.0, 1.0);
  check_invalid(
      [&] {
        auto in = base;
        in.forward_s[1 * 4 + 2] = std::nan("");
        dflop::simulate_pipeline(in);
      },
      "forward_s[replica 0, stage 1, microbatch 2]", __LINE__);
  check_invalid(
      [&] {
        auto in = base;
        in.backward_s[5] = -1.0;
        dflop::simulate_pipeline(in);
      },
      "backward_s[replica 0, stage 1, microbatch 1]", __LINE__);
  check_invalid(
      [&] {
        auto in = base;
        in.forward_s.pop_back();
        dflop::simulate_pipeline(in);
      },
      "forward_s has 11 values", __LINE__);
  check_invalid(
      [&] {
        auto in = base;
        in.link_latency_s[1] = -0.1;
        dflop::simulate_pipeline(in);
      },
      "link_latency_s[link 1]", __LINE__);
  check_invalid(
      [&] {
        auto in = base;
        in.link_bandwidth_bytes_per_s[0] = 0.0;
        dflop::simulate_pipeline(in);
      },
      "link_bandwidth_bytes_per_s[link 0]", __LINE__);
  check_invalid(
      [&] {
        auto in = base;
        in.activation_bytes.assign(7, 1.0);
        dflop::simulate_pipeline(in);
      },
      "activation_bytes has 7 values", __LINE__);
  check_invalid(
      [&] {
        auto in = base;
        in.activation_bytes.assign(8, 1.0);
        in.activation_bytes[7] = std::numeric_limits<double>::infinity();
        dflop::simulate_pipeline(in);
      },
      "activation_bytes[replica 0, link 1, microbatch 3]", __LINE__);
  check_invalid(
      [&] {
        auto in = base;
        in.allreduce_s = {1.0, 2.0};
        dflop::simulate_pipeline(in);
      },
      "allreduce_s has 2 values", __LINE__);
  check_invalid(
      [&] {
        auto in = base;
        in.num_replicas = 0;
        dflop::simulate_pipeline(in);
      },
      "num_replicas", __LINE__);
  check_invalid(
      [&] {
        auto in = base;
        in.num_microbatches = int64_t{1} << 40;
        dflop::simulate_pipeline(in);
      },
      "num_microbatches must be in [1, 10000000]", __LINE__);
}

}  // namespace

int main() {
  test_action_orders();
  test_uniform_makespan();
  test_single_slow_microbatch();
  test_unequal_stages();
  test_latency();
  test_bandwidth_serialises_transfers();
  test_replicas_allreduce();
  test_validation();
  if (g_failures != 0) {
    std::printf("test_simulator: %d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("test_simulator: all passed\n");
  return 0;
}
