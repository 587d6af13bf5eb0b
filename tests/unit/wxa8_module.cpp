// The W4A8/W8A8 kernels alone as a Python module, for tests that build them for another
// instruction set: wxa8.cpp and what it calls, without the other kernels' sources and their
// bindings (about a third of the full module's compile time).
#include "kvserve_cpu.h"

#include <torch/python.h>

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("wxa8_matmul", &kvserve::wxa8_matmul, py::arg("x"), py::arg("packed"),
        py::arg("scales"), py::arg("zeros"), py::arg("group"), py::arg("bits"),
        py::arg("gemm_from") = 0);
  m.def("wxa8_gemm_runs", &kvserve::wxa8_gemm_runs, py::arg("rows"), py::arg("n"),
        py::arg("gemm_from") = 0);
  m.def("wxa8_linear", &kvserve::wxa8_linear);
}
