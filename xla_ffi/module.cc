// The pybind11 module _moonep_jax_cuda: exports every FFI handler as a capsule through
// registrations() (registered for platform "CUDA" by moonep_jax/_ffi.py) and the transport
// bootstrap functions.
#include <pybind11/pybind11.h>

#include <type_traits>

#include "kernels/grouped_gemm.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/transport.h"

namespace py = pybind11;

namespace {

template <typename T>
py::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return py::capsule(reinterpret_cast<void*>(fn));
}

py::dict Registrations() {
  py::dict targets;
#define MOONEP_TARGET(name, symbol) targets[name] = EncapsulateFfiHandler(symbol);
#include "xla_ffi/targets.inc"
#undef MOONEP_TARGET
  return targets;
}

}  // namespace

PYBIND11_MODULE(_moonep_jax_cuda, m) {
  m.doc() = "moonep_jax CUDA kernels as XLA FFI handlers";
  m.def("registrations", &Registrations, "FFI target name -> handler capsule.");
  m.def("gmm_table_rows", &moonep::gmm_table_rows, py::arg("num_rows"), py::arg("num_groups"),
        py::arg("overflow"), "Rows of the grouped GEMM's [rows, 4] int32 tile-table scratch.");
  m.attr("GMM_TILE_M") = moonep::kGmmTileM;
  moonep::register_transport_bindings(m);
}
