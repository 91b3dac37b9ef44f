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

// Every field of every event, exactly.
bool same_events(const PipelineSimResult& a, const PipelineSimResult& b) {
  if (a.events.size() != b.events.size()) return false;
  for (size_t i = 0; i < a.events.size(); ++i) {
    const auto &x = a.events[i], &y = b.events[i];
    if (x.replica != y.replica || x.stage != y.stage || x.kind != y.kind ||
        x.microbatch != y.microbatch || x.peer_stage != y.peer_stage || x.start_s != y.start_s ||
        x.end_s != y.end_s || x.virtual_stage != y.virtual_stage) {
      return false;
    }
  }
  return true;
}

// Empty gradient_links and all ones are the same model: bit-identical results.
void test_gradient_links_default() {
  std::vector<PipelineSimInput> inputs;
  auto in = make_input(PipelineOrder::OneFOneB, 3, 5, 1.0, 2.0);
  in.num_replicas = 2;
  in.forward_s.clear();
  in.backward_s.clear();
  for (int i = 0; i < 2 * 3 * 5; ++i) {
    in.forward_s.push_back(0.25 + 0.37 * (i % 7));
    in.backward_s.push_back(0.5 + 0.61 * (i % 5));
  }
  in.link_latency_s = {0.1, 0.3};
  in.link_bandwidth_bytes_per_s = {1e9, 2e9};
  in.activation_bytes.assign(2 * 2 * 5, 3e8);
  in.allreduce_s = {0.5, 1.0, 0.25};
  inputs.push_back(in);
  in.order = PipelineOrder::GPipe;
  inputs.push_back(in);
  auto inter = make_input(PipelineOrder::Interleaved1F1B, 2, 4, 1.0, 2.0);
  inter.shape = {{2}, {2}};  // 2 stages x 2 chunks: 4 virtual stages, 3 boundaries
  inter.forward_s.assign(4 * 4, 1.0);
  inter.backward_s.assign(4 * 4, 2.0);
  inter.link_latency_s.assign(3, 0.2);
  inter.link_bandwidth_bytes_per_s.assign(3, 1e9);
  inter.activation_bytes.assign(3 * 4, 5e8);
  inputs.push_back(inter);
  for (const auto& base : inputs) {
    const auto before = dflop::simulate_pipeline(base);
    auto ones = base;
    ones.gradient_links.assign(base.link_latency_s.size(), 1);
    const auto after = dflop::simulate_pipeline(ones);
    CHECK(before.step_time_s == after.step_time_s);
    CHECK(before.compute_end_s == after.compute_end_s);
    CHECK(before.busy_s == after.busy_s);
    CHECK(before.idle_s == after.idle_s);
    CHECK(same_events(before, after));
  }
}

// 2 stages, 1F1B, m = 3, latency 0.5 s; stage 0 is frozen (backward 0 s, no gradient
// back): its order F0 F1 B0 F2 B1 B2 runs without waiting for stage 1, so its forwards
// run back to back at 0, 1, 2 (with a gradient link F2 would wait for B0's gradient, at 5).
// Stage 1 (f = 2, b = 1): F0 at 1.5 (F0's end + latency), B0 3.5, F1 4.5, B1 6.5, F2 7.5,
// B2 9.5 -> 10.5.
void test_gradient_links_frozen_first_stage() {
  auto in = make_input(PipelineOrder::OneFOneB, 2, 3, 1.0, 0.0);
  for (int64_t k = 0; k < 3; ++k) {
    in.forward_s[size_t(3 + k)] = 2.0;
    in.backward_s[size_t(3 + k)] = 1.0;
  }
  in.link_latency_s[0] = 0.5;
  in.gradient_links = {0};
  const auto res = dflop::simulate_pipeline(in);
  check_compute(res, 0, EventKind::Forward, 0, 0.0, 1.0);
  check_compute(res, 0, EventKind::Forward, 1, 1.0, 2.0);
  check_compute(res, 0, EventKind::Backward, 0, 2.0, 2.0);
  check_compute(res, 0, EventKind::Forward, 2, 2.0, 3.0);
  check_compute(res, 0, EventKind::Backward, 1, 3.0, 3.0);
  check_compute(res, 0, EventKind::Backward, 2, 3.0, 3.0);
  check_compute(res, 1, EventKind::Forward, 0, 1.5, 3.5);
  check_compute(res, 1, EventKind::Backward, 0, 3.5, 4.5);
  check_compute(res, 1, EventKind::Forward, 1, 4.5, 6.5);
  check_compute(res, 1, EventKind::Backward, 1, 6.5, 7.5);
  check_compute(res, 1, EventKind::Forward, 2, 7.5, 9.5);
  check_compute(res, 1, EventKind::Backward, 2, 9.5, 10.5);
  CHECK(res.step_time_s == 10.5);
  CHECK(res.compute_end_s[0] == 3.0);
  CHECK(res.compute_end_s[1] == 10.5);
  CHECK(res.busy_s[0] == 3.0);
  CHECK(res.busy_s[1] == 9.0);
  // Only the three activations cross boundary 0 (stage 0 -> 1); no gradient comes back.
  int sends = 0;
  for (const auto& e : res.events) {
    if (e.kind != EventKind::Send) continue;
    ++sends;
    CHECK(e.stage == 0 && e.peer_stage == 1 && e.virtual_stage == 0);
  }
  CHECK(sends == 3);
  CHECK(res.events.size() == 12u + 3u);

  // The same input with the gradient link: stage 0's B0 waits for stage 1's (4.5 + 0.5).
  in.gradient_links.clear();
  const auto linked = dflop::simulate_pipeline(in);
  check_compute(linked, 0, EventKind::Backward, 0, 5.0, 5.0);
  check_compute(linked, 0, EventKind::Forward, 2, 5.0, 6.0);
}

// A split backward (I then W) of a stage with no gradient link waits only for its forward.
// f = 1, b = 2 (I and W 1 s each), m = 1: stage 0's I runs at 1 (else at 3, when stage 1's
// I gradient arrives), stage 1 makes no Send back.
void test_gradient_links_backward_input() {
  auto in = make_input(PipelineOrder::OneFOneB, 2, 1, 1.0, 2.0);
  using dflop::ActionKind;
  in.actions = {{{0, ActionKind::Forward, 0},
                 {0, ActionKind::BackwardInput, 0},
                 {0, ActionKind::BackwardWeight, 0}},
                {{1, ActionKind::Forward, 0},
                 {1, ActionKind::BackwardInput, 0},
                 {1, ActionKind::BackwardWeight, 0}}};
  in.gradient_links = {0};
  const auto res = dflop::simulate_pipeline(in);
  check_compute(res, 0, EventKind::BackwardInput, 0, 1.0, 2.0);
  check_compute(res, 0, EventKind::BackwardWeight, 0, 2.0, 3.0);
  check_compute(res, 1, EventKind::BackwardInput, 0, 2.0, 3.0);
  CHECK(res.step_time_s == 4.0);
  CHECK(find_event(res, 0, 1, EventKind::Send, 0) == nullptr);
  in.gradient_links.clear();
  const auto linked = dflop::simulate_pipeline(in);
  check_compute(linked, 0, EventKind::BackwardInput, 0, 3.0, 4.0);
  CHECK(linked.step_time_s == 5.0);
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
  check_invalid(
      [&] {
        auto in = base;
        in.gradient_links = {1};
        dflop::simulate_pipeline(in);
      },
      "gradient_links has 1 values, expected virtual stages - 1 (or empty) = 2", __LINE__);
  check_invalid(
      [&] {
        auto in = base;
        in.gradient_links = {1, 2};
        dflop::simulate_pipeline(in);
      },
      "gradient_links[link 1] must be 0 or 1, got 2", __LINE__);
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
  test_gradient_links_default();
  test_gradient_links_frozen_first_stage();
  test_gradient_links_backward_input();
  test_validation();
  if (g_failures != 0) {
    std::printf("test_simulator: %d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("test_simulator: all passed\n");
  return 0;
}
