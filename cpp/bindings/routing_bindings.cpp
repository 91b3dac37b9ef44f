#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "dflop/encoder_split.hpp"
#include "dflop/routing.hpp"

namespace py = pybind11;

namespace dflop::bindings {
namespace {

using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using DoubleArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

void check_1d(const py::array& a, const char* name, py::ssize_t n) {
  if (a.ndim() != 1) throw py::value_error(std::string(name) + " must be 1-D");
  if (n >= 0 && a.shape(0) != n)
    throw py::value_error(std::string(name) + " has length " + std::to_string(a.shape(0)) +
                          ", expected " + std::to_string(n) + " (one per sample)");
}

py::dict plan_routing_py(const IntArray& src_replica, const IntArray& dst_replica,
                         const IntArray& rows, int64_t num_src, int64_t num_dst) {
  check_1d(src_replica, "src_replica", -1);
  const py::ssize_t n = src_replica.shape(0);
  check_1d(dst_replica, "dst_replica", n);
  check_1d(rows, "rows", n);
  RoutingPlan plan =
      plan_routing(src_replica.data(), dst_replica.data(), rows.data(), n, num_src, num_dst);
  py::dict out;
  out["send_rows"] = to_numpy(std::move(plan.send_rows), {num_src, num_dst});
  out["pair_offsets"] = to_numpy(std::move(plan.pair_offsets), {num_src * num_dst + 1});
  out["pair_samples"] = to_numpy(std::move(plan.pair_samples), {n});
  out["send_offsets"] = to_numpy(std::move(plan.send_offsets), {num_src + 1});
  out["send_order"] = to_numpy(std::move(plan.send_order), {n});
  out["recv_offsets"] = to_numpy(std::move(plan.recv_offsets), {num_dst + 1});
  out["recv_order"] = to_numpy(std::move(plan.recv_order), {n});
  return out;
}

SplitGranularity parse_granularity(const std::string& name) {
  if (name == "unit") return SplitGranularity::Unit;
  if (name == "sample") return SplitGranularity::Sample;
  throw py::value_error("granularity must be 'unit' or 'sample', got '" + name + "'");
}

py::dict split_units_py(const IntArray& units, const DoubleArray& costs, int64_t num_replicas,
                        const std::string& granularity) {
  check_1d(units, "units", -1);
  const py::ssize_t n = units.shape(0);
  check_1d(costs, "costs", n);
  const SplitGranularity g = parse_granularity(granularity);
  const std::vector<int64_t> unit_data = owned_copy(units);
  const std::vector<double> cost_data = owned_copy(costs);
  UnitSplit split;
  {
    py::gil_scoped_release release;
    split = split_units(unit_data.data(), cost_data.data(), n, num_replicas, g);
  }
  const auto pieces = static_cast<py::ssize_t>(split.sample.size());
  py::dict out;
  out["sample"] = to_numpy(std::move(split.sample), {pieces});
  out["first_unit"] = to_numpy(std::move(split.first_unit), {pieces});
  out["num_units"] = to_numpy(std::move(split.num_units), {pieces});
  out["replica"] = to_numpy(std::move(split.replica), {pieces});
  out["replica_cost"] = to_numpy(std::move(split.replica_cost), {num_replicas});
  out["replica_units"] = to_numpy(std::move(split.replica_units), {num_replicas});
  out["makespan"] = split.makespan;
  return out;
}

}  // namespace

void register_routing(py::module_& m) {
  m.def("plan_routing", &plan_routing_py, py::arg("src_replica"), py::arg("dst_replica"),
        py::arg("rows"), py::arg("num_src"), py::arg("num_dst"),
        "Routing plan of one microbatch's features between encoder and LLM DP replicas "
        "(dict of int64 arrays); see dflop.runtime.routing.plan_routing.");
  m.def("split_units", &split_units_py, py::arg("units"), py::arg("costs"), py::arg("num_replicas"),
        py::arg("granularity") = "unit",
        "One microbatch's visual units split over the encoder's DP replicas (pieces: "
        "contiguous unit ranges of a sample); see dflop.runtime.routing.split_units.");
}

}  // namespace dflop::bindings
