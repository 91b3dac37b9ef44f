#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "dflop/simulator.hpp"

namespace py = pybind11;

namespace dflop::bindings {
namespace {

using DoubleArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

std::vector<double> to_vector(const DoubleArray& a) {
  return std::vector<double>(a.data(), a.data() + a.size());
}

std::vector<double> checked_3d(const DoubleArray& a, const char* name) {
  if (a.ndim() != 3) {
    throw py::value_error(std::string(name) + " must be 3-D (replicas, stages, microbatches)");
  }
  return to_vector(a);
}

std::vector<double> checked_1d(const DoubleArray& a, const char* name) {
  if (a.ndim() != 1) throw py::value_error(std::string(name) + " must be 1-D");
  return to_vector(a);
}

py::dict simulate_pipeline_py(const DoubleArray& forward_s, const DoubleArray& backward_s,
                              const std::string& schedule, const DoubleArray& link_latency_s,
                              const DoubleArray& link_bandwidth_bytes_per_s,
                              const std::optional<DoubleArray>& activation_bytes,
                              const std::optional<DoubleArray>& allreduce_s, bool record_events) {
  PipelineSimInput in;
  in.record_events = record_events;
  in.schedule = parse_schedule_kind(schedule);
  in.forward_s = checked_3d(forward_s, "forward_s");
  in.backward_s = checked_3d(backward_s, "backward_s");
  // Sizes of the other arrays are checked in the core against these dimensions.
  in.num_replicas = forward_s.shape(0);
  in.num_stages = forward_s.shape(1);
  in.num_microbatches = forward_s.shape(2);
  if (backward_s.shape(0) != in.num_replicas || backward_s.shape(1) != in.num_stages ||
      backward_s.shape(2) != in.num_microbatches) {
    throw py::value_error("backward_s must have the shape of forward_s");
  }
  in.link_latency_s = checked_1d(link_latency_s, "link_latency_s");
  in.link_bandwidth_bytes_per_s =
      checked_1d(link_bandwidth_bytes_per_s, "link_bandwidth_bytes_per_s");
  if (activation_bytes) in.activation_bytes = checked_3d(*activation_bytes, "activation_bytes");
  if (allreduce_s) in.allreduce_s = checked_1d(*allreduce_s, "allreduce_s");

  PipelineSimResult res;
  {
    py::gil_scoped_release release;
    res = dflop::simulate_pipeline(in);
  }
  // Events as parallel columns; the Python side assembles a structured array.
  const size_t n = res.events.size();
  std::vector<int64_t> replica(n), stage(n), microbatch(n), peer_stage(n);
  std::vector<int8_t> kind(n);
  std::vector<double> start_s(n), end_s(n);
  for (size_t i = 0; i < n; ++i) {
    const SimEvent& e = res.events[i];
    replica[i] = e.replica;
    stage[i] = e.stage;
    kind[i] = static_cast<int8_t>(e.kind);
    microbatch[i] = e.microbatch;
    peer_stage[i] = e.peer_stage;
    start_s[i] = e.start_s;
    end_s[i] = e.end_s;
  }
  const py::ssize_t rows = in.num_replicas, cols = in.num_stages,
                    num_events = static_cast<py::ssize_t>(n);
  py::dict out;
  out["step_time_s"] = res.step_time_s;
  out["compute_end_s"] = to_numpy(std::move(res.compute_end_s), {rows, cols});
  out["busy_s"] = to_numpy(std::move(res.busy_s), {rows, cols});
  out["idle_s"] = to_numpy(std::move(res.idle_s), {rows, cols});
  py::dict events;
  events["replica"] = to_numpy(std::move(replica), {num_events});
  events["stage"] = to_numpy(std::move(stage), {num_events});
  events["kind"] = to_numpy(std::move(kind), {num_events});
  events["microbatch"] = to_numpy(std::move(microbatch), {num_events});
  events["peer_stage"] = to_numpy(std::move(peer_stage), {num_events});
  events["start_s"] = to_numpy(std::move(start_s), {num_events});
  events["end_s"] = to_numpy(std::move(end_s), {num_events});
  out["events"] = events;
  return out;
}

std::vector<std::pair<bool, int64_t>> pipeline_actions_py(const std::string& schedule,
                                                          int64_t num_stages,
                                                          int64_t num_microbatches, int64_t stage) {
  const auto actions =
      pipeline_actions(parse_schedule_kind(schedule), num_stages, num_microbatches, stage);
  std::vector<std::pair<bool, int64_t>> out;
  out.reserve(actions.size());
  for (const auto& a : actions) out.emplace_back(a.is_forward, a.microbatch);
  return out;
}

}  // namespace

void register_simulator(py::module_& m) {
  m.def("simulate_pipeline", &simulate_pipeline_py, py::arg("forward_s"), py::arg("backward_s"),
        py::arg("schedule"), py::arg("link_latency_s"), py::arg("link_bandwidth_bytes_per_s"),
        py::arg("activation_bytes"), py::arg("allreduce_s"), py::arg("record_events") = true,
        "Simulate one training step of (R, S, m) pipelines. Returns a dict of numpy arrays "
        "and scalars; event kinds are 0 fwd, 1 bwd, 2 send, 3 allreduce. See "
        "dflop.simulator.simulate_pipeline.");
  m.def("pipeline_actions", &pipeline_actions_py, py::arg("schedule"), py::arg("num_stages"),
        py::arg("num_microbatches"), py::arg("stage"),
        "The order of (is_forward, microbatch) actions one stage executes.");
}

}  // namespace dflop::bindings
