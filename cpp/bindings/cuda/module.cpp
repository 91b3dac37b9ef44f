// dflop._cuda: the CUDA row packing (private; dflop.runtime.rows is the public face, which
// checks tensors, devices and indices before anything reaches a kernel).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "dflop/cuda_rows.hpp"

namespace py = pybind11;

namespace {

void raise_if(const std::string& error, const char* what) {
  if (!error.empty()) throw std::runtime_error(std::string(what) + ": " + error);
}

template <typename T>
T* address(uintptr_t value) {
  return reinterpret_cast<T*>(value);
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "dflop CUDA row packing (private; use dflop.runtime.rows)";
  m.def(
      "gather_rows",
      [](uintptr_t src, uintptr_t index, int64_t count, uintptr_t dst, int64_t row_bytes,
         uintptr_t stream) {
        raise_if(
            dflop::cuda::gather_rows(address<const void>(src), address<const int64_t>(index), count,
                                     address<void>(dst), row_bytes, address<void>(stream)),
            "gather_rows");
      },
      py::arg("src"), py::arg("index"), py::arg("count"), py::arg("dst"), py::arg("row_bytes"),
      py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
      "dst[r] = src[index[r]] for r < count: device addresses, rows of row_bytes bytes, "
      "enqueued on the cudaStream_t `stream`.");
  m.def(
      "scatter_rows",
      [](uintptr_t src, uintptr_t index, int64_t count, uintptr_t dst, int64_t row_bytes,
         uintptr_t stream) {
        raise_if(
            dflop::cuda::scatter_rows(address<const void>(src), address<const int64_t>(index),
                                      count, address<void>(dst), row_bytes, address<void>(stream)),
            "scatter_rows");
      },
      py::arg("src"), py::arg("index"), py::arg("count"), py::arg("dst"), py::arg("row_bytes"),
      py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
      "dst[index[r]] = src[r] for r < count (see gather_rows).");
  m.def("device_count", &dflop::cuda::device_count,
        "Visible CUDA devices (0 without a driver or device).");
}
