#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
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

py::array_t<int64_t> split_for_encoder_py(const DoubleArray& encoder_costs, int64_t num_replicas) {
  check_1d(encoder_costs, "encoder_costs", -1);
  const py::ssize_t n = encoder_costs.shape(0);
  return to_numpy(split_for_encoder(encoder_costs.data(), n, num_replicas), {n});
}

}  // namespace

void register_routing(py::module_& m) {
  m.def("plan_routing", &plan_routing_py, py::arg("src_replica"), py::arg("dst_replica"),
        py::arg("rows"), py::arg("num_src"), py::arg("num_dst"),
        "Routing plan of one microbatch's features between encoder and LLM DP replicas "
        "(dict of int64 arrays); see dflop.runtime.routing.plan_routing.");
  m.def("split_for_encoder", &split_for_encoder_py, py::arg("encoder_costs"),
        py::arg("num_replicas"),
        "Encoder DP replica of each sample of a microbatch (LPT + local search); see "
        "dflop.runtime.routing.encoder_split.");
}

}  // namespace dflop::bindings
