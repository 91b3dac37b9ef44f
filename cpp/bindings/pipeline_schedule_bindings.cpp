#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "dflop/pipeline_schedule.hpp"

namespace py = pybind11;

namespace dflop::bindings {
namespace {

using CostArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

PipelineScheduleOptions pipeline_options(
    int64_t num_microbatches, int64_t dp_size, std::vector<int64_t> microbatch_dims,
    std::vector<int64_t> stages, std::vector<double> forward_fraction,
    std::vector<double> microbatch_constant_s, double link_latency_s, std::vector<int64_t> replicas,
    std::vector<int64_t> units, std::vector<int64_t> chunks,
    std::vector<int64_t> backward_from_stage, std::vector<int64_t> backward_gate, std::string order,
    std::vector<double> weight_fraction, std::vector<double> last_stage_weight_extra) {
  PipelineScheduleOptions o;
  o.order = std::move(order);
  o.weight_fraction = std::move(weight_fraction);
  o.last_stage_weight_extra = std::move(last_stage_weight_extra);
  o.chunks = std::move(chunks);
  o.backward_from_stage = std::move(backward_from_stage);
  o.backward_gate = std::move(backward_gate);
  o.replicas = std::move(replicas);
  o.units = std::move(units);
  o.num_microbatches = num_microbatches;
  o.dp_size = dp_size;
  o.microbatch_dims = std::move(microbatch_dims);
  o.stages = std::move(stages);
  o.forward_fraction = std::move(forward_fraction);
  o.microbatch_constant_s = std::move(microbatch_constant_s);
  o.link_latency_s = link_latency_s;
  return o;
}

void check_costs(const CostArray& costs) {
  if (costs.ndim() != 2) throw py::value_error("costs must be 2-D (N, D)");
}

py::dict pipeline_schedule_py(
    const CostArray& costs, std::vector<int64_t> start_assignment, int64_t num_microbatches,
    int64_t dp_size, std::vector<int64_t> microbatch_dims, std::vector<int64_t> stages,
    std::vector<double> forward_fraction, std::vector<double> microbatch_constant_s,
    double link_latency_s, std::optional<std::vector<double>> capacity, double max_growth,
    uint64_t seed, std::optional<double> time_budget_ms, std::optional<double> time_limit_s,
    std::vector<int64_t> replicas, std::vector<int64_t> units, std::vector<int64_t> chunks,
    std::vector<int64_t> backward_from_stage, std::vector<int64_t> backward_gate, std::string order,
    std::vector<double> weight_fraction, std::vector<double> last_stage_weight_extra) {
  check_costs(costs);
  const int64_t n = costs.shape(0), d = costs.shape(1);
  PipelineScheduleOptions o =
      pipeline_options(num_microbatches, dp_size, std::move(microbatch_dims), std::move(stages),
                       std::move(forward_fraction), std::move(microbatch_constant_s),
                       link_latency_s, std::move(replicas), std::move(units), std::move(chunks),
                       std::move(backward_from_stage), std::move(backward_gate), std::move(order),
                       std::move(weight_fraction), std::move(last_stage_weight_extra));
  if (capacity) o.capacity = std::move(*capacity);
  o.max_growth = max_growth;
  o.seed = seed;
  if (time_budget_ms) o.work_budget = pipeline_work_budget_for_ms(*time_budget_ms);
  o.time_limit_s = time_limit_or_none(time_limit_s);
  o.interrupted = python_signal_check();
  const std::vector<double> data = owned_copy(costs);
  PipelineScheduleResult result;
  {
    py::gil_scoped_release release;
    result = pipeline_schedule(data.data(), n, d, start_assignment, o);
  }
  py::dict out;
  out["assignment"] = to_numpy(std::move(result.assignment), {n});
  out["step_time_s"] = result.step_time_s;
  py::dict stats;
  stats["start_step_time_s"] = result.stats.start_step_time_s;
  stats["ordered_step_time_s"] = result.stats.ordered_step_time_s;
  stats["evaluations"] = result.stats.evaluations;
  add_search_stats(stats, result.stats);
  out["stats"] = stats;
  return out;
}

double simulated_step_time_py(const CostArray& costs, std::vector<int64_t> assignment,
                              int64_t num_microbatches, int64_t dp_size,
                              std::vector<int64_t> microbatch_dims, std::vector<int64_t> stages,
                              std::vector<double> forward_fraction,
                              std::vector<double> microbatch_constant_s, double link_latency_s,
                              std::vector<int64_t> replicas, std::vector<int64_t> units,
                              std::vector<int64_t> chunks, std::vector<int64_t> backward_from_stage,
                              std::vector<int64_t> backward_gate, std::string order,
                              std::vector<double> weight_fraction,
                              std::vector<double> last_stage_weight_extra) {
  check_costs(costs);
  const PipelineScheduleOptions o =
      pipeline_options(num_microbatches, dp_size, std::move(microbatch_dims), std::move(stages),
                       std::move(forward_fraction), std::move(microbatch_constant_s),
                       link_latency_s, std::move(replicas), std::move(units), std::move(chunks),
                       std::move(backward_from_stage), std::move(backward_gate), std::move(order),
                       std::move(weight_fraction), std::move(last_stage_weight_extra));
  const std::vector<double> data = owned_copy(costs);
  py::gil_scoped_release release;
  return simulated_step_time(data.data(), costs.shape(0), costs.shape(1), assignment, o);
}

}  // namespace

void register_pipeline_schedule(py::module_& m) {
  m.def("pipeline_schedule", &pipeline_schedule_py, py::arg("costs"), py::kw_only(),
        py::arg("start_assignment"), py::arg("num_microbatches"), py::arg("dp_size"),
        py::arg("microbatch_dims"), py::arg("stages"), py::arg("forward_fraction"),
        py::arg("microbatch_constant_s"), py::arg("link_latency_s"), py::arg("capacity"),
        py::arg("max_growth"), py::arg("seed"), py::arg("time_budget_ms"), py::arg("time_limit_s"),
        py::arg("replicas") = std::vector<int64_t>{}, py::arg("units") = std::vector<int64_t>{},
        py::arg("chunks") = std::vector<int64_t>{},
        py::arg("backward_from_stage") = std::vector<int64_t>{},
        py::arg("backward_gate") = std::vector<int64_t>{}, py::arg("order") = std::string(),
        py::arg("weight_fraction") = std::vector<double>{},
        py::arg("last_stage_weight_extra") = std::vector<double>{},
        "Refine a schedule for the simulated module pipeline; see dflop.pipeline_schedule.");
  m.def("simulated_step_time", &simulated_step_time_py, py::arg("costs"), py::kw_only(),
        py::arg("assignment"), py::arg("num_microbatches"), py::arg("dp_size"),
        py::arg("microbatch_dims"), py::arg("stages"), py::arg("forward_fraction"),
        py::arg("microbatch_constant_s"), py::arg("link_latency_s"),
        py::arg("replicas") = std::vector<int64_t>{}, py::arg("units") = std::vector<int64_t>{},
        py::arg("chunks") = std::vector<int64_t>{},
        py::arg("backward_from_stage") = std::vector<int64_t>{},
        py::arg("backward_gate") = std::vector<int64_t>{}, py::arg("order") = std::string(),
        py::arg("weight_fraction") = std::vector<double>{},
        py::arg("last_stage_weight_extra") = std::vector<double>{});
  m.def("pipeline_work_budget_for_ms", &pipeline_work_budget_for_ms, py::arg("time_budget_ms"));
}

}  // namespace dflop::bindings
