#include "ops.h"
#include "simd.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("ISA") = triforce::ISA;
  m.def("decode_attention", &triforce::decode_attention, py::call_guard<py::gil_scoped_release>(),
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("T"), py::arg("causal"), py::arg("scale"),
        py::arg("path") = 0, py::arg("visible") = py::none(), py::arg("gap") = py::none());
}
