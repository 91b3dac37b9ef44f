#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <optional>
#include <utility>
#include <vector>

namespace dflop::bindings {

// Hands a vector to numpy without copying: the array owns it through a capsule.
template <typename T>
pybind11::array_t<T> to_numpy(std::vector<T>&& v, std::vector<pybind11::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  pybind11::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return pybind11::array_t<T>(shape, owned->data(), free_when_done);
}

// A search's optional wall-clock limit: None -> -1 (none), else finite and >= 0.
inline double time_limit_or_none(std::optional<double> time_limit_s) {
  if (!time_limit_s) return -1.0;
  if (!(*time_limit_s >= 0) || !std::isfinite(*time_limit_s))
    throw pybind11::value_error("time_limit_s must be a finite number >= 0");
  return *time_limit_s;
}

// The search statistics balance() and pipeline_schedule() share.
template <typename Stats>
void add_search_stats(pybind11::dict& out, const Stats& stats) {
  out["work_used"] = stats.work_used;
  out["work_budget"] = stats.work_budget;
  out["improving_moves"] = stats.improving_moves;
  out["perturbations"] = stats.perturbations;
  out["stopped_by_time_limit"] = stats.stopped_by_time_limit;
}

void register_balance(pybind11::module_& m);
void register_simulator(pybind11::module_& m);
void register_planner(pybind11::module_& m);
void register_routing(pybind11::module_& m);
void register_pipeline_schedule(pybind11::module_& m);

}  // namespace dflop::bindings
