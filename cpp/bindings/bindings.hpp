#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

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

void register_balance(pybind11::module_& m);
void register_simulator(pybind11::module_& m);
void register_planner(pybind11::module_& m);
void register_routing(pybind11::module_& m);

}  // namespace dflop::bindings
