#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "dflop/balance.hpp"

namespace py = pybind11;

namespace dflop::bindings {
namespace {

py::dict balance_py(const py::array_t<double, py::array::c_style | py::array::forcecast>& costs,
                    int64_t num_microbatches, int64_t dp_size, std::vector<int64_t> microbatch_dims,
                    std::optional<std::vector<double>> capacity, uint64_t seed,
                    std::optional<double> time_budget_ms, std::optional<double> time_limit_s,
                    int64_t num_limit_dims, std::optional<int64_t> work_budget) {
  if (costs.ndim() != 2) throw py::value_error("costs must be 2-D (N, D)");
  const int64_t n = costs.shape(0), d = costs.shape(1);
  BalanceOptions options;
  options.num_microbatches = num_microbatches;
  options.dp_size = dp_size;
  options.microbatch_dims = std::move(microbatch_dims);
  if (capacity) options.capacity = std::move(*capacity);
  options.num_limit_dims = num_limit_dims;
  options.seed = seed;
  if (time_budget_ms) options.work_budget = work_budget_for_ms(*time_budget_ms);
  if (work_budget) options.work_budget = std::max<int64_t>(*work_budget, 0);  // what is left
  options.time_limit_s = time_limit_or_none(time_limit_s);
  options.interrupted = python_signal_check();
  const std::vector<double> data = owned_copy(costs);
  BalanceResult result;
  {
    py::gil_scoped_release release;
    result = balance(data.data(), n, d, options);
  }
  const int64_t num_bins = num_microbatches * dp_size;
  py::dict out;
  out["assignment"] = to_numpy(std::move(result.assignment), {n});
  out["bin_loads"] = to_numpy(std::move(result.bin_loads), {num_bins, d});
  out["microbatch_loads"] = to_numpy(std::move(result.microbatch_loads), {num_microbatches, d});
  out["makespan"] = result.makespan;
  out["lower_bound"] = result.lower_bound;
  py::dict stats;
  stats["initial_makespan"] = result.stats.initial_makespan;
  stats["seeded_by_first_fit"] = result.stats.seeded_by_first_fit;
  add_search_stats(stats, result.stats);
  out["stats"] = stats;
  return out;
}

}  // namespace

void register_balance(py::module_& m) {
  m.def("balance", &balance_py, py::arg("costs"), py::kw_only(), py::arg("num_microbatches"),
        py::arg("dp_size"), py::arg("microbatch_dims"), py::arg("capacity"), py::arg("seed"),
        py::arg("time_budget_ms"), py::arg("time_limit_s") = py::none(),
        py::arg("num_limit_dims") = 0, py::arg("work_budget") = py::none(),
        "Assign samples to num_microbatches x dp_size bins minimising the largest load. "
        "Returns a dict of numpy arrays and scalars; see dflop.schedule.");
  m.def(
      "first_fit_decreasing_bins",
      [](const py::array_t<double, py::array::c_style | py::array::forcecast>& used,
         std::vector<double> limits) {
        if (used.ndim() != 2) throw py::value_error("resources must be 2-D (N, K)");
        const std::vector<double> data = owned_copy(used);
        py::gil_scoped_release release;
        return first_fit_decreasing_bins(data.data(), used.shape(0), used.shape(1), limits);
      },
      py::arg("resources"), py::arg("limits"),
      "Bins first-fit decreasing packs the samples into within the limits.");
  m.def("default_work_budget", &default_work_budget, py::arg("num_items"), py::arg("num_bins"),
        py::arg("num_dims"));
  m.def("work_budget_for_ms", &work_budget_for_ms, py::arg("time_budget_ms"));
}

}  // namespace dflop::bindings
