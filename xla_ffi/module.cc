// The pybind11 module _moonep_jax_cuda: exports every FFI handler as a capsule through
// registrations() (registered for platform "CUDA" by moonep_jax/_ffi.py) and the transport
// bootstrap functions.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/constants.h"
#include "kernels/grouped_matmul.h"
#include "kernels/plan.h"
#include "kernels/prefetch.h"
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
  m.def("grouped_matmul_table_rows", &moonep::grouped_matmul_table_rows, py::arg("num_rows"),
        py::arg("num_groups"), py::arg("overflow"),
        "Rows of the grouped GEMM's [rows, TABLE_COLUMNS] int32 tile-table scratch.");
  m.attr("GROUPED_MATMUL_TILE_M") = moonep::kGroupedMatmulTileM;
  m.attr("GROUPED_MATMUL_TILE_N") = moonep::kGroupedMatmulTileN;
  m.attr("GROUPED_MATMUL_CHUNK_M") = moonep::kGroupedMatmulChunkM;
  m.attr("GROUPED_MATMUL_WIDE_N_TILES") = moonep::kGroupedMatmulWideNTiles;
  m.attr("MAX_PREFETCH_WEIGHTS") = moonep::kMaxPrefetchWeights;
  m.def(
      "plan_graph_nodes",
      [](int num_experts, int top_k, int num_tokens, int num_ranks) {
        int kernels = 0, others = 0;
        const cudaError_t err =
            moonep::plan_graph_nodes(num_experts, top_k, num_tokens, num_ranks, &kernels, &others);
        if (err != cudaSuccess) {
          throw std::runtime_error(std::string("plan_graph_nodes: ") + cudaGetErrorString(err));
        }
        return py::make_tuple(kernels, others);
      },
      py::arg("num_experts"), py::arg("top_k"), py::arg("num_tokens"), py::arg("num_ranks"),
      "(kernel nodes, other nodes) of the CUDA planner for these sizes, captured into a CUDA "
      "graph on the current device (nothing runs).");
  m.def(
      "grouped_matmul_replays_equal",
      [] {
        bool forward = false, dx = false, dw = false;
        const cudaError_t err = moonep::grouped_matmul_replays_equal(&forward, &dx, &dw);
        if (err != cudaSuccess) {
          throw std::runtime_error(std::string("grouped_matmul_replays_equal: ") +
                                   cudaGetErrorString(err));
        }
        return py::make_tuple(forward, dx, dw);
      },
      "(forward, dX, dW): whether each grouped GEMM launcher, captured into a CUDA graph on the "
      "current device, replays exactly what a direct launch writes.");
  // kernels/constants.h, for tests/test_constants.py to hold the Python copies to.
  m.attr("MAX_TOP_K") = moonep::kMaxTopK;
  m.attr("DROPPED") = moonep::kDropped;
  py::dict table_kinds;
  table_kinds["KIND_LOCAL"] = moonep::kKindLocal;
  table_kinds["KIND_SLOT"] = moonep::kKindSlot;
  table_kinds["KIND_ZERO"] = moonep::kKindZero;
  table_kinds["TABLE_FIRST_ITEM"] = moonep::kTableFirstItem;
  table_kinds["TABLE_ITEM_N_TILES"] = moonep::kTableItemNTiles;
  table_kinds["TABLE_COLUMNS"] = moonep::kTableColumns;
  table_kinds["SCHEDULE_TILES"] = moonep::kScheduleTiles;
  table_kinds["SCHEDULE_NEXT_ITEM"] = moonep::kScheduleNextItem;
  table_kinds["SCHEDULE_ITEMS"] = moonep::kScheduleItems;
  table_kinds["DW_SCHEDULE_MATS"] = moonep::kDwScheduleMats;
  table_kinds["DW_SCHEDULE_NEXT_ITEM"] = moonep::kDwScheduleNextItem;
  table_kinds["DW_SCHEDULE_SLOTS"] = moonep::kDwScheduleSlots;
  m.attr("GROUPED_MATMUL_TABLE_CONSTANTS") = table_kinds;
  moonep::register_transport_bindings(m);
}
