// check_row_index: the host-side check of a pack / unpack index (dflop/rows.hpp).
#include <string>

#include "bindings.hpp"
#include "dflop/rows.hpp"

namespace py = pybind11;

namespace dflop::bindings {

void register_rows(py::module_& m) {
  m.def(
      "check_row_index",
      [](py::array_t<int64_t, py::array::c_style> index, int64_t rows, bool unique,
         const std::string& name) {
        if (index.ndim() != 1)
          throw InvalidArgument(name + " must be 1-D, got " + std::to_string(index.ndim()) +
                                " dimensions");
        check_row_index(index.data(), index.shape(0), rows, unique, name.c_str());
      },
      py::arg("index"), py::arg("rows"), py::kw_only(), py::arg("unique"), py::arg("name"),
      "Raise ValueError naming `name`, position and value unless every entry is in "
      "[0, rows) (and, with unique, none repeats).");
}

}  // namespace dflop::bindings
