#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "dflop/errors.hpp"
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

using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Action lists as (n, 3) int64 arrays of (virtual stage, kind code, microbatch).
std::vector<PipelineAction> to_actions(const IntArray& a, size_t stage) {
  if (a.ndim() != 2 || a.shape(1) != 3) {
    throw py::value_error("actions[" + std::to_string(stage) +
                          "] must have shape (n, 3): (virtual stage, kind, microbatch) rows");
  }
  std::vector<PipelineAction> out(static_cast<size_t>(a.shape(0)));
  const auto v = a.unchecked<2>();
  for (py::ssize_t i = 0; i < a.shape(0); ++i) {
    const int64_t kind = v(i, 1);
    if (kind < 0 || kind > 3) {
      throw py::value_error("actions[" + std::to_string(stage) + "][" + std::to_string(i) +
                            "] has kind code " + std::to_string(kind) + " (0 F, 1 B, 2 I, 3 W)");
    }
    out[size_t(i)] = {v(i, 0), static_cast<ActionKind>(kind), v(i, 2)};
  }
  return out;
}

py::list to_arrays(const std::vector<std::vector<PipelineAction>>& lists) {
  py::list out;
  for (const auto& list : lists) {
    std::vector<int64_t> flat;
    flat.reserve(3 * list.size());
    for (const auto& a : list) {
      flat.push_back(a.stage);
      flat.push_back(static_cast<int64_t>(a.kind));
      flat.push_back(a.microbatch);
    }
    out.append(to_numpy(std::move(flat), {static_cast<py::ssize_t>(list.size()), 3}));
  }
  return out;
}

PipelineShape to_shape(const std::vector<int64_t>& stages, const std::vector<int64_t>& chunks) {
  return {stages, chunks};
}

py::dict simulate_pipeline_py(
    const DoubleArray& forward_s, const DoubleArray& backward_s, const std::string& order,
    const DoubleArray& link_latency_s, const DoubleArray& link_bandwidth_bytes_per_s,
    const std::optional<DoubleArray>& activation_bytes,
    const std::optional<DoubleArray>& allreduce_s, bool record_events,
    const std::vector<int64_t>& stages, const std::vector<int64_t>& chunks,
    const std::optional<std::vector<IntArray>>& actions, double weight_grad_fraction,
    const std::optional<IntArray>& gradient_links, const std::optional<DoubleArray>& weight_s) {
  PipelineSimInput in;
  in.record_events = record_events;
  in.order = parse_pipeline_order(order);
  in.forward_s = checked_3d(forward_s, "forward_s");
  in.backward_s = checked_3d(backward_s, "backward_s");
  // Sizes of the other arrays are checked in the core against these dimensions.
  in.num_replicas = forward_s.shape(0);
  in.num_microbatches = forward_s.shape(2);
  in.shape = to_shape(stages, chunks);
  in.num_stages = stages.empty() ? forward_s.shape(1) : num_physical_stages(in.shape);
  in.weight_grad_fraction = weight_grad_fraction;
  if (actions) {
    for (size_t s = 0; s < actions->size(); ++s) in.actions.push_back(to_actions((*actions)[s], s));
  }
  if (backward_s.shape(0) != in.num_replicas || backward_s.shape(1) != forward_s.shape(1) ||
      backward_s.shape(2) != in.num_microbatches) {
    throw py::value_error("backward_s must have the shape of forward_s");
  }
  if (weight_s) {
    if (weight_s->ndim() != 3 || weight_s->shape(0) != in.num_replicas ||
        weight_s->shape(1) != forward_s.shape(1) || weight_s->shape(2) != in.num_microbatches) {
      throw py::value_error("weight_s must have the shape of backward_s");
    }
    in.weight_s = checked_3d(*weight_s, "weight_s");
  }
  in.link_latency_s = checked_1d(link_latency_s, "link_latency_s");
  in.link_bandwidth_bytes_per_s =
      checked_1d(link_bandwidth_bytes_per_s, "link_bandwidth_bytes_per_s");
  if (activation_bytes) in.activation_bytes = checked_3d(*activation_bytes, "activation_bytes");
  if (allreduce_s) in.allreduce_s = checked_1d(*allreduce_s, "allreduce_s");
  if (gradient_links) {
    if (gradient_links->ndim() != 1) throw py::value_error("gradient_links must be 1-D");
    const auto g = gradient_links->unchecked<1>();
    for (py::ssize_t l = 0; l < g.shape(0); ++l) {
      // Checked here too, before narrowing: the core sees only bytes.
      if (g(l) != 0 && g(l) != 1) {
        throw InvalidArgument("gradient_links[link " + std::to_string(l) +
                              "] must be 0 or 1, got " + std::to_string(g(l)));
      }
      in.gradient_links.push_back(static_cast<uint8_t>(g(l)));
    }
  }

  PipelineSimResult res;
  {
    py::gil_scoped_release release;
    res = dflop::simulate_pipeline(in);
  }
  // Events as parallel columns; the Python side assembles a structured array.
  const size_t n = res.events.size();
  std::vector<int64_t> replica(n), stage(n), microbatch(n), peer_stage(n), virtual_stage(n);
  std::vector<int8_t> kind(n);
  std::vector<double> start_s(n), end_s(n);
  for (size_t i = 0; i < n; ++i) {
    const SimEvent& e = res.events[i];
    replica[i] = e.replica;
    stage[i] = e.stage;
    kind[i] = static_cast<int8_t>(e.kind);
    microbatch[i] = e.microbatch;
    peer_stage[i] = e.peer_stage;
    virtual_stage[i] = e.virtual_stage;
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
  events["virtual_stage"] = to_numpy(std::move(virtual_stage), {num_events});
  events["start_s"] = to_numpy(std::move(start_s), {num_events});
  events["end_s"] = to_numpy(std::move(end_s), {num_events});
  out["events"] = events;
  return out;
}

py::tuple pipeline_program_py(const std::string& order, const std::vector<int64_t>& stages,
                              const std::vector<int64_t>& chunks, int64_t num_microbatches) {
  PipelineProgram program;
  {
    py::gil_scoped_release release;
    program =
        pipeline_program(parse_pipeline_order(order), to_shape(stages, chunks), num_microbatches);
  }
  return py::make_tuple(program.owner, to_arrays(program.actions));
}

PipelineProgram to_program(const std::vector<int64_t>& owner, const std::vector<IntArray>& actions,
                           int64_t num_microbatches) {
  PipelineProgram program;
  program.num_microbatches = num_microbatches;
  program.owner = owner;
  for (size_t s = 0; s < actions.size(); ++s) program.actions.push_back(to_actions(actions[s], s));
  return program;
}

void validate_program_py(const std::vector<int64_t>& owner, const std::vector<IntArray>& actions,
                         int64_t num_microbatches) {
  const PipelineProgram program = to_program(owner, actions, num_microbatches);
  py::gil_scoped_release release;
  validate_program(program);
}

}  // namespace

void register_simulator(py::module_& m) {
  m.def("simulate_pipeline", &simulate_pipeline_py, py::arg("forward_s"), py::arg("backward_s"),
        py::arg("order"), py::arg("link_latency_s"), py::arg("link_bandwidth_bytes_per_s"),
        py::arg("activation_bytes"), py::arg("allreduce_s"), py::arg("record_events") = true,
        py::arg("stages") = std::vector<int64_t>{}, py::arg("chunks") = std::vector<int64_t>{},
        py::arg("actions") = py::none(), py::arg("weight_grad_fraction") = 0.5,
        py::arg("gradient_links") = py::none(), py::arg("weight_s") = py::none(),
        "Simulate one training step of (R, S, m) pipelines. Returns a dict of numpy arrays "
        "and scalars; event kinds are 0 fwd, 1 bwd, 2 send, 3 allreduce, 4 bwd_input, 5 "
        "bwd_weight. gradient_links: None (every boundary carries gradients back) or V - 1 "
        "values of 0 / 1 (0: no gradient back over that boundary). See "
        "dflop.simulator.simulate_pipeline.");
  m.def("pipeline_program", &pipeline_program_py, py::arg("order"), py::arg("stages"),
        py::arg("chunks"), py::arg("num_microbatches"),
        "(owner per virtual stage, per physical stage an (n, 3) int64 array of (virtual "
        "stage, kind code 0 F / 1 B / 2 I / 3 W, microbatch)); see "
        "dflop.scheduling.pipeline_program.");
  m.def("validate_program", &validate_program_py, py::arg("owner"), py::arg("actions"),
        py::arg("num_microbatches"), "Check a pipeline program; see dflop.scheduling.");
  m.def(
      "peak_in_flight",
      [](const std::string& order, const std::vector<int64_t>& stages,
         const std::vector<int64_t>& chunks, int64_t num_microbatches, int64_t stage) {
        return peak_in_flight(parse_pipeline_order(order), to_shape(stages, chunks),
                              num_microbatches, stage);
      },
      py::arg("order"), py::arg("stages"), py::arg("chunks"), py::arg("num_microbatches"),
      py::arg("stage"), "The memory rule of a generated schedule; see dflop.scheduling.");
  m.def(
      "pipeline_order_names",
      [] {
        std::vector<std::string> names;
        for (const PipelineOrderDef& def : pipeline_order_registry()) names.emplace_back(def.name);
        return names;
      },
      "The registered (generated) schedules' names, in registry order.");
  m.def(
      "pipeline_order_for",
      [](const std::vector<int64_t>& stages, const std::vector<int64_t>& chunks) {
        return std::string(pipeline_order_name(pipeline_order_for(to_shape(stages, chunks))));
      },
      py::arg("stages"), py::arg("chunks"),
      "The schedule dflop runs on a pipeline of these segments; see dflop.scheduling.");
  m.def(
      "program_grid",
      [](const std::vector<int64_t>& owner, const std::vector<IntArray>& actions,
         int64_t num_microbatches, const std::vector<std::pair<int64_t, int64_t>>& marks) {
        return program_grid(to_program(owner, actions, num_microbatches), marks);
      },
      py::arg("owner"), py::arg("actions"), py::arg("num_microbatches"), py::arg("marks"),
      "A program's stage x time grid with the actions at marks shown as >X<; see "
      "dflop.scheduling.program_grid.");
}

}  // namespace dflop::bindings
