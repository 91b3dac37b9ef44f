// Pipeline step simulator. Each stage runs its fixed action order, so an action's start
// time depends only on its stage's previous action and on its input's arrival: the
// simulation advances each stage as far as its inputs allow and wakes the neighbour that
// a finished action sends to (a worklist instead of a global clock; the times are the
// same as a time-ordered event loop's, and the cost is linear in the number of actions).
#include "dflop/simulator.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <deque>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "dflop/errors.hpp"

namespace dflop {
namespace {

constexpr double kUnknown = std::numeric_limits<double>::quiet_NaN();

std::string fmt(double v) {
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

void check_count(const char* name, int64_t value) {
  if (value < 1) {
    throw InvalidArgument(std::string(name) + " must be >= 1, got " + std::to_string(value));
  }
}

// a * b, refusing sizes that overflow or could never be allocated.
int64_t checked_product(int64_t a, int64_t b, const char* what) {
  constexpr int64_t kMaxElements = int64_t{1} << 40;
  if (a != 0 && b > kMaxElements / a) {
    throw InvalidArgument(std::string(what) + " is too large (" + std::to_string(a) + " x " +
                          std::to_string(b) + " elements)");
  }
  return a * b;
}

void check_size(const char* name, const std::vector<double>& values, int64_t expected,
                const char* shape) {
  if (static_cast<int64_t>(values.size()) != expected) {
    throw InvalidArgument(std::string(name) + " has " + std::to_string(values.size()) +
                          " values, expected " + shape + " = " + std::to_string(expected));
  }
}

// Values of a (d0 x d1 x d2) array must be finite and >= 0; the message names the index.
void check_nonnegative_3d(const char* name, const std::vector<double>& values, int64_t d1,
                          int64_t d2, const char* axis1) {
  for (size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    if (std::isfinite(v) && v >= 0.0) continue;
    const int64_t flat = static_cast<int64_t>(i);
    throw InvalidArgument(std::string(name) + "[replica " + std::to_string(flat / (d1 * d2)) +
                          ", " + axis1 + " " + std::to_string((flat / d2) % d1) + ", microbatch " +
                          std::to_string(flat % d2) + "] must be finite and >= 0, got " + fmt(v));
  }
}

void check_nonnegative_1d(const char* name, const std::vector<double>& values, const char* axis) {
  for (size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    if (std::isfinite(v) && v >= 0.0) continue;
    throw InvalidArgument(std::string(name) + "[" + axis + " " + std::to_string(i) +
                          "] must be finite and >= 0, got " + fmt(v));
  }
}

void check_stage_args(int64_t num_stages, int64_t num_microbatches) {
  check_count("num_stages", num_stages);
  check_count("num_microbatches", num_microbatches);
}

}  // namespace

ScheduleKind parse_schedule_kind(const std::string& name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "1f1b") return ScheduleKind::OneFOneB;
  if (lower == "gpipe") return ScheduleKind::GPipe;
  throw InvalidArgument("schedule must be \"1f1b\" or \"gpipe\", got \"" + name + "\"");
}

const char* schedule_kind_name(ScheduleKind kind) {
  return kind == ScheduleKind::GPipe ? "gpipe" : "1f1b";
}

std::vector<PipelineAction> pipeline_actions(ScheduleKind kind, int64_t num_stages,
                                             int64_t num_microbatches, int64_t stage) {
  check_stage_args(num_stages, num_microbatches);
  if (stage < 0 || stage >= num_stages) {
    throw InvalidArgument("stage must be in [0, " + std::to_string(num_stages) + "), got " +
                          std::to_string(stage));
  }
  if (kind != ScheduleKind::OneFOneB && kind != ScheduleKind::GPipe) {
    throw InvalidArgument("schedule kind " + std::to_string(static_cast<int>(kind)) +
                          " is not a ScheduleKind");
  }
  const int64_t m = num_microbatches;
  std::vector<PipelineAction> actions;
  actions.reserve(static_cast<size_t>(2 * m));
  if (kind == ScheduleKind::GPipe) {
    for (int64_t k = 0; k < m; ++k) actions.push_back({true, k});
    for (int64_t k = 0; k < m; ++k) actions.push_back({false, k});
    return actions;
  }
  // 1F1B: the warm-up fills the pipeline below this stage, so that the steady state
  // keeps num_stages - stage microbatches in flight (bounding activation memory).
  const int64_t warmup = std::min(num_stages - 1 - stage, m);
  for (int64_t k = 0; k < warmup; ++k) actions.push_back({true, k});
  for (int64_t i = 0; i < m - warmup; ++i) {
    actions.push_back({true, warmup + i});
    actions.push_back({false, i});
  }
  for (int64_t k = m - warmup; k < m; ++k) actions.push_back({false, k});
  return actions;
}

void validate_pipeline_input(const PipelineSimInput& in) {
  check_count("num_replicas", in.num_replicas);
  check_stage_args(in.num_stages, in.num_microbatches);
  if (in.schedule != ScheduleKind::OneFOneB && in.schedule != ScheduleKind::GPipe) {
    throw InvalidArgument("schedule kind " + std::to_string(static_cast<int>(in.schedule)) +
                          " is not a ScheduleKind");
  }
  const int64_t r = in.num_replicas, s = in.num_stages, m = in.num_microbatches;
  const int64_t num_links = s - 1;
  const int64_t times = checked_product(checked_product(r, s, "forward_s"), m, "forward_s");
  check_size("forward_s", in.forward_s, times, "num_replicas x num_stages x num_microbatches");
  check_size("backward_s", in.backward_s, times, "num_replicas x num_stages x num_microbatches");
  check_nonnegative_3d("forward_s", in.forward_s, s, m, "stage");
  check_nonnegative_3d("backward_s", in.backward_s, s, m, "stage");
  check_size("link_latency_s", in.link_latency_s, num_links, "num_stages - 1");
  check_nonnegative_1d("link_latency_s", in.link_latency_s, "link");
  check_size("link_bandwidth_bytes_per_s", in.link_bandwidth_bytes_per_s, num_links,
             "num_stages - 1");
  for (size_t l = 0; l < in.link_bandwidth_bytes_per_s.size(); ++l) {
    const double v = in.link_bandwidth_bytes_per_s[l];
    // +inf is allowed: an infinitely fast link still has its latency.
    if (!(v > 0.0)) {
      throw InvalidArgument("link_bandwidth_bytes_per_s[link " + std::to_string(l) +
                            "] must be > 0 (inf allowed), got " + fmt(v));
    }
  }
  if (!in.activation_bytes.empty()) {
    check_size("activation_bytes", in.activation_bytes,
               checked_product(r * num_links, m, "activation_bytes"),
               "num_replicas x (num_stages - 1) x num_microbatches (or empty)");
    check_nonnegative_3d("activation_bytes", in.activation_bytes, num_links, m, "link");
  }
  if (!in.allreduce_s.empty()) {
    check_size("allreduce_s", in.allreduce_s, s, "num_stages (or empty)");
    check_nonnegative_1d("allreduce_s", in.allreduce_s, "stage");
  }
}

PipelineSimResult simulate_pipeline(const PipelineSimInput& in) {
  validate_pipeline_input(in);
  const int64_t num_replicas = in.num_replicas, num_stages = in.num_stages, m = in.num_microbatches,
                num_links = num_stages - 1;
  std::vector<std::vector<PipelineAction>> orders;
  orders.reserve(static_cast<size_t>(num_stages));
  for (int64_t s = 0; s < num_stages; ++s) {
    orders.push_back(pipeline_actions(in.schedule, num_stages, m, s));
  }

  PipelineSimResult out;
  const size_t grid = static_cast<size_t>(num_replicas * num_stages);
  out.compute_end_s.assign(grid, 0.0);
  out.busy_s.assign(grid, 0.0);
  out.idle_s.assign(grid, 0.0);
  const size_t num_sends = static_cast<size_t>(2 * num_replicas * num_links * m);
  if (in.record_events) {
    out.events.reserve(static_cast<size_t>(2 * num_replicas * num_stages * m) + num_sends +
                       (in.allreduce_s.empty() ? 0 : grid));
  }

  // Per replica state, reused: arrival time of each stage's inputs (NaN = not yet sent).
  std::vector<double> fwd_arrival(static_cast<size_t>(num_stages * m));
  std::vector<double> bwd_arrival(static_cast<size_t>(num_stages * m));
  std::vector<double> stage_free_s(static_cast<size_t>(num_stages));
  std::vector<size_t> next_action(static_cast<size_t>(num_stages));
  std::vector<double> link_fwd_free_s(static_cast<size_t>(num_links));
  std::vector<double> link_bwd_free_s(static_cast<size_t>(num_links));
  std::vector<char> queued(static_cast<size_t>(num_stages));
  std::deque<int64_t> worklist;

  for (int64_t r = 0; r < num_replicas; ++r) {
    std::fill(fwd_arrival.begin(), fwd_arrival.end(), kUnknown);
    std::fill(bwd_arrival.begin(), bwd_arrival.end(), kUnknown);
    std::fill(stage_free_s.begin(), stage_free_s.end(), 0.0);
    std::fill(next_action.begin(), next_action.end(), size_t{0});
    std::fill(link_fwd_free_s.begin(), link_fwd_free_s.end(), 0.0);
    std::fill(link_bwd_free_s.begin(), link_bwd_free_s.end(), 0.0);
    std::fill(queued.begin(), queued.end(), char{1});
    worklist.clear();
    for (int64_t s = 0; s < num_stages; ++s) worklist.push_back(s);

    // Sends microbatch k's tensor from stage `from` over `link`; returns the arrival.
    auto send = [&](int64_t from, int64_t to, int64_t k, double ready_s) {
      const int64_t link = std::min(from, to);
      const double bytes =
          in.activation_bytes.empty()
              ? 0.0
              : in.activation_bytes[static_cast<size_t>((r * num_links + link) * m + k)];
      const double bandwidth = in.link_bandwidth_bytes_per_s[static_cast<size_t>(link)];
      double& link_free_s = (to > from ? link_fwd_free_s : link_bwd_free_s)[link];
      const double start_s = std::max(ready_s, link_free_s);
      link_free_s = start_s + bytes / bandwidth;
      const double arrival_s = link_free_s + in.link_latency_s[static_cast<size_t>(link)];
      if (in.record_events) {
        out.events.push_back({r, from, EventKind::Send, k, to, start_s, arrival_s});
      }
      if (!queued[to]) {
        queued[to] = 1;
        worklist.push_back(to);
      }
      return arrival_s;
    };

    while (!worklist.empty()) {
      const int64_t s = worklist.front();
      worklist.pop_front();
      queued[s] = 0;
      const auto& order = orders[static_cast<size_t>(s)];
      while (next_action[s] < order.size()) {
        const PipelineAction action = order[next_action[s]];
        const int64_t k = action.microbatch;
        const size_t sk = static_cast<size_t>(s * m + k);
        // The first stage's forwards and the last stage's backwards (whose forward came
        // earlier in this stage's order) have no input to wait for.
        double input_s = 0.0;
        if (action.is_forward && s > 0) input_s = fwd_arrival[sk];
        if (!action.is_forward && s < num_stages - 1) input_s = bwd_arrival[sk];
        if (std::isnan(input_s)) break;  // woken again when the input is sent
        const size_t rsk = static_cast<size_t>((r * num_stages + s) * m + k);
        const double duration_s = action.is_forward ? in.forward_s[rsk] : in.backward_s[rsk];
        const double start_s = std::max(stage_free_s[s], input_s);
        const double end_s = start_s + duration_s;
        stage_free_s[s] = end_s;
        out.busy_s[static_cast<size_t>(r * num_stages + s)] += duration_s;
        if (in.record_events) {
          out.events.push_back({r, s, action.is_forward ? EventKind::Forward : EventKind::Backward,
                                k, -1, start_s, end_s});
        }
        ++next_action[s];
        if (action.is_forward && s < num_stages - 1) {
          fwd_arrival[static_cast<size_t>((s + 1) * m + k)] = send(s, s + 1, k, end_s);
        } else if (!action.is_forward && s > 0) {
          bwd_arrival[static_cast<size_t>((s - 1) * m + k)] = send(s, s - 1, k, end_s);
        }
      }
    }
    for (int64_t s = 0; s < num_stages; ++s) {
      // Unreachable for the schedules above (each is deadlock-free); guards future ones.
      if (next_action[s] != orders[static_cast<size_t>(s)].size()) {
        throw std::logic_error("pipeline simulation deadlocked at replica " + std::to_string(r) +
                               ", stage " + std::to_string(s));
      }
      out.compute_end_s[static_cast<size_t>(r * num_stages + s)] = stage_free_s[s];
    }
  }

  // The all-reduce of a stage is a collective over the replicas: it starts when the last
  // replica's stage finishes its backwards.
  double step_time_s = 0.0;
  for (int64_t s = 0; s < num_stages; ++s) {
    double start_s = 0.0;
    for (int64_t r = 0; r < num_replicas; ++r) {
      start_s = std::max(start_s, out.compute_end_s[static_cast<size_t>(r * num_stages + s)]);
    }
    double end_s = start_s;
    if (!in.allreduce_s.empty()) {
      end_s = start_s + in.allreduce_s[static_cast<size_t>(s)];
      for (int64_t r = 0; r < num_replicas && in.record_events; ++r) {
        out.events.push_back({r, s, EventKind::AllReduce, -1, -1, start_s, end_s});
      }
    }
    step_time_s = std::max(step_time_s, end_s);
  }
  out.step_time_s = step_time_s;
  for (size_t i = 0; i < grid; ++i) out.idle_s[i] = step_time_s - out.busy_s[i];

  // Sorts (start, index) pairs and permutes once: moving the events themselves costs more.
  const auto& ev = out.events;
  std::vector<std::pair<double, size_t>> keys(ev.size());
  for (size_t i = 0; i < ev.size(); ++i) keys[i] = {ev[i].start_s, i};
  std::sort(keys.begin(), keys.end(), [&ev](const auto& x, const auto& y) {
    if (x.first != y.first) return x.first < y.first;
    const SimEvent &a = ev[x.second], &b = ev[y.second];
    return std::make_tuple(a.replica, a.stage, static_cast<int>(a.kind), a.microbatch,
                           a.peer_stage) < std::make_tuple(b.replica, b.stage,
                                                           static_cast<int>(b.kind), b.microbatch,
                                                           b.peer_stage);
  });
  std::vector<SimEvent> sorted;
  sorted.reserve(ev.size());
  for (const auto& key : keys) sorted.push_back(ev[key.second]);
  out.events = std::move(sorted);
  return out;
}

}  // namespace dflop
