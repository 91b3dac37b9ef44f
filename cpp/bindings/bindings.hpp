#pragma once

#include <pybind11/pybind11.h>

namespace dflop::bindings {

void register_balance(pybind11::module_& m);
void register_simulator(pybind11::module_& m);
void register_planner(pybind11::module_& m);
void register_routing(pybind11::module_& m);

}  // namespace dflop::bindings
