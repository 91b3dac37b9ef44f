#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "dflop/errors.hpp"

namespace dflop::bindings {

// Hands a vector to numpy without copying: the array owns it through a capsule.
template <typename T>
pybind11::array_t<T> to_numpy(std::vector<T>&& v, std::vector<pybind11::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  pybind11::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return pybind11::array_t<T>(shape, owned->data(), free_when_done);
}

// A copy of a caller's array, taken while the GIL is held. The native calls release the
// GIL and read their input for the whole search (and validate it first): given the
// caller's buffer itself, another Python thread could write to it mid-search, and the
// result would match neither the validated input nor the new one. Every binding that
// releases the GIL hands the core memory of its own, never a numpy buffer.
template <typename T, int Flags>
std::vector<T> owned_copy(const pybind11::array_t<T, Flags>& a) {
  static_assert((Flags & pybind11::array::c_style) != 0, "a C-contiguous array: data() is flat");
  return std::vector<T>(a.data(), a.data() + a.size());
}

// A search's optional wall-clock limit: None -> -1 (none), else finite and >= 0.
inline double time_limit_or_none(std::optional<double> time_limit_s) {
  if (!time_limit_s) return -1.0;
  if (!(*time_limit_s >= 0) || !std::isfinite(*time_limit_s))
    throw pybind11::value_error("time_limit_s must be a finite number >= 0");
  return *time_limit_s;
}

// An InterruptCheck for a search that runs with the GIL released: at most every 50 ms it
// takes the GIL and runs Python's signal handlers, so Ctrl-C stops the search (the
// pending KeyboardInterrupt is raised when the call returns). Off the main thread Python
// runs no handlers and the check never fires.
inline InterruptCheck python_signal_check() {
  using Clock = std::chrono::steady_clock;
  auto last = std::make_shared<Clock::time_point>(Clock::now());
  return [last]() {
    const auto now = Clock::now();
    if (now - *last < std::chrono::milliseconds(50)) return false;
    *last = now;
    pybind11::gil_scoped_acquire gil;
    return PyErr_CheckSignals() != 0;
  };
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
void register_rows(pybind11::module_& m);

}  // namespace dflop::bindings
