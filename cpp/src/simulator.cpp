// Pipeline step simulator: validation and the step of several replicas (each simulated by
// detail::ReplicaSimulator) with their all-reduces.
#include "dflop/simulator.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "dflop/errors.hpp"
#include "format.hpp"
#include "replica_simulator.hpp"

namespace dflop {
namespace {

std::string fmt(double v) { return detail::format_number(v); }

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

}  // namespace

PipelineShape input_shape(const PipelineSimInput& in) {
  return in.shape.stages.empty() ? PipelineShape::plain(in.num_stages) : in.shape;
}

namespace {

// The program an input runs (validated).
PipelineProgram input_program(const PipelineSimInput& in) {
  const PipelineShape shape = input_shape(in);
  if (in.actions.empty()) return pipeline_program(in.order, shape, in.num_microbatches);
  PipelineProgram program;
  program.num_microbatches = in.num_microbatches;
  program.owner = virtual_stage_owners(shape);
  program.actions = in.actions;
  validate_program(program);
  return program;
}

}  // namespace

void validate_pipeline_input(const PipelineSimInput& in) {
  check_count("num_replicas", in.num_replicas);
  check_count("num_stages", in.num_stages);
  const PipelineShape shape = input_shape(in);
  validate_shape(shape);
  if (num_physical_stages(shape) != in.num_stages) {
    throw InvalidArgument("shape.stages sum to " + std::to_string(num_physical_stages(shape)) +
                          " physical stages, num_stages is " + std::to_string(in.num_stages));
  }
  if (!in.actions.empty() && static_cast<int64_t>(in.actions.size()) != in.num_stages) {
    throw InvalidArgument("actions has " + std::to_string(in.actions.size()) +
                          " lists, expected one per physical stage (" +
                          std::to_string(in.num_stages) + ")");
  }
  if (!(in.weight_grad_fraction >= 0.0 && in.weight_grad_fraction <= 1.0)) {
    throw InvalidArgument("weight_grad_fraction must be in [0, 1], got " +
                          fmt(in.weight_grad_fraction));
  }
  input_program(in);  // the schedule, shape and microbatches (or the given actions)
  const int64_t r = in.num_replicas, v = num_virtual_stages(shape), m = in.num_microbatches;
  const int64_t num_links = v - 1;
  const int64_t times = checked_product(checked_product(r, v, "forward_s"), m, "forward_s");
  const char* cells = "num_replicas x virtual stages x num_microbatches";
  check_size("forward_s", in.forward_s, times, cells);
  check_size("backward_s", in.backward_s, times, cells);
  check_nonnegative_3d("forward_s", in.forward_s, v, m, "stage");
  check_nonnegative_3d("backward_s", in.backward_s, v, m, "stage");
  if (!in.weight_s.empty()) {
    check_size("weight_s", in.weight_s, times, cells);
    check_nonnegative_3d("weight_s", in.weight_s, v, m, "stage");
    for (size_t i = 0; i < in.weight_s.size(); ++i) {
      if (in.weight_s[i] > in.backward_s[i]) {
        throw InvalidArgument("weight_s[" + std::to_string(i) + "]=" + fmt(in.weight_s[i]) +
                              " exceeds backward_s[" + std::to_string(i) +
                              "]=" + fmt(in.backward_s[i]) +
                              ": the weight gradients are part of the "
                              "backward");
      }
    }
  }
  check_size("link_latency_s", in.link_latency_s, num_links, "virtual stages - 1");
  check_nonnegative_1d("link_latency_s", in.link_latency_s, "link");
  check_size("link_bandwidth_bytes_per_s", in.link_bandwidth_bytes_per_s, num_links,
             "virtual stages - 1");
  for (size_t l = 0; l < in.link_bandwidth_bytes_per_s.size(); ++l) {
    const double bw = in.link_bandwidth_bytes_per_s[l];
    // +inf is allowed: an infinitely fast link still has its latency.
    if (!(bw > 0.0)) {
      throw InvalidArgument("link_bandwidth_bytes_per_s[link " + std::to_string(l) +
                            "] must be > 0 (inf allowed), got " + fmt(bw));
    }
  }
  if (!in.activation_bytes.empty()) {
    check_size("activation_bytes", in.activation_bytes,
               checked_product(r * num_links, m, "activation_bytes"),
               "num_replicas x (virtual stages - 1) x num_microbatches (or empty)");
    check_nonnegative_3d("activation_bytes", in.activation_bytes, num_links, m, "link");
  }
  if (!in.gradient_links.empty()) {
    if (static_cast<int64_t>(in.gradient_links.size()) != num_links) {
      throw InvalidArgument(
          "gradient_links has " + std::to_string(in.gradient_links.size()) +
          " values, expected virtual stages - 1 (or empty) = " + std::to_string(num_links));
    }
    for (size_t l = 0; l < in.gradient_links.size(); ++l) {
      if (in.gradient_links[l] > 1) {
        throw InvalidArgument("gradient_links[link " + std::to_string(l) +
                              "] must be 0 or 1, got " + std::to_string(in.gradient_links[l]));
      }
    }
  }
  if (!in.allreduce_s.empty()) {
    check_size("allreduce_s", in.allreduce_s, in.num_stages, "num_stages (or empty)");
    check_nonnegative_1d("allreduce_s", in.allreduce_s, "stage");
  }
}

PipelineSimResult simulate_pipeline(const PipelineSimInput& in) {
  validate_pipeline_input(in);
  const int64_t num_replicas = in.num_replicas, num_stages = in.num_stages, m = in.num_microbatches;
  detail::ReplicaSimulator replica(input_program(in));
  const int64_t num_virtual = int64_t(replica.program().owner.size()), num_links = num_virtual - 1;
  PipelineSimResult out;
  const size_t grid = static_cast<size_t>(num_replicas * num_stages);
  out.compute_end_s.assign(grid, 0.0);
  out.busy_s.assign(grid, 0.0);
  out.idle_s.assign(grid, 0.0);
  if (in.record_events) {
    out.events.reserve(static_cast<size_t>(4 * num_replicas * num_stages * m) +
                       (in.allreduce_s.empty() ? 0 : grid));
  }
  const uint8_t* gradient_links = in.gradient_links.empty() ? nullptr : in.gradient_links.data();
  for (int64_t r = 0; r < num_replicas; ++r) {
    const size_t offset = static_cast<size_t>(r * num_virtual * m);
    const double* bytes = in.activation_bytes.empty()
                              ? nullptr
                              : in.activation_bytes.data() + static_cast<size_t>(r * num_links * m);
    replica.run(in.forward_s.data() + offset, in.backward_s.data() + offset,
                in.link_latency_s.data(), in.link_bandwidth_bytes_per_s.data(), bytes,
                in.weight_s.empty() ? nullptr : in.weight_s.data() + offset,
                in.weight_grad_fraction, gradient_links,
                [&](int64_t stage, EventKind kind, int64_t k, int64_t peer, double start_s,
                    double end_s, int64_t virtual_stage) {
                  if (in.record_events) {
                    out.events.push_back({r, stage, kind, k, peer, start_s, end_s, virtual_stage});
                  }
                });
    for (int64_t s = 0; s < num_stages; ++s) {
      out.compute_end_s[static_cast<size_t>(r * num_stages + s)] = replica.stage_end_s()[s];
      out.busy_s[static_cast<size_t>(r * num_stages + s)] = replica.busy_s()[s];
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
        out.events.push_back({r, s, EventKind::AllReduce, -1, -1, start_s, end_s, -1});
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
    return std::make_tuple(a.replica, a.stage, static_cast<int>(a.kind), a.microbatch, a.peer_stage,
                           a.virtual_stage) <
           std::make_tuple(b.replica, b.stage, static_cast<int>(b.kind), b.microbatch, b.peer_stage,
                           b.virtual_stage);
  });
  std::vector<SimEvent> sorted;
  sorted.reserve(ev.size());
  for (const auto& key : keys) sorted.push_back(ev[key.second]);
  out.events = std::move(sorted);
  return out;
}

}  // namespace dflop
