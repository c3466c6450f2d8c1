// Python bindings of the transport (added to the extension module by xla_ffi/module.cc).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "xla_ffi/transport.h"

namespace moonep {

namespace py = pybind11;

namespace {

// Creates the transport context of one EP group; raises RuntimeError with the CUDA reason.
void bootstrap(const std::vector<int32_t>& ordinals) {
  ffi::Error err;
  {
    py::gil_scoped_release no_gil;  // allocation and zeroing on every device of the group
    err = bootstrap_group(ordinals);
  }
  if (err.failure()) throw std::runtime_error(err.message());
}

}  // namespace

void register_transport_bindings(py::module_& m) {
  m.def("bootstrap", &bootstrap, py::arg("ordinals"),
        "Creates (once) the transport context of the EP group whose devices have these CUDA "
        "ordinals, in rank order: one zeroed symmetric area per device, peer access between "
        "all of them, every kernel loaded.");
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_EXPERTS") = kMaxExperts;
}

}  // namespace moonep
