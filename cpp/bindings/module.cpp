// dflop._core: the only pybind11 code. Each topic registers itself from its own file.
#include <pybind11/pybind11.h>

#include "bindings.hpp"
#include "dflop/errors.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "dflop native core (private; use the dflop package)";
  static py::exception<dflop::Infeasible> infeasible(m, "InfeasibleError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dflop::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const dflop::Infeasible& e) {
      py::set_error(infeasible, e.what());
    } catch (const dflop::Interrupted& e) {
      // The check already raised the signal handler's exception (KeyboardInterrupt).
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
    }
  });
  dflop::bindings::register_balance(m);
  dflop::bindings::register_simulator(m);
  dflop::bindings::register_planner(m);
  dflop::bindings::register_routing(m);
  dflop::bindings::register_pipeline_schedule(m);
  dflop::bindings::register_rows(m);
}
