// Python bindings of the transport (added to the extension module by xla_ffi/module.cc). The
// bootstrap's order and its exchange between processes live in moonep_jax/_cuda/transport.py;
// these are its CUDA steps. Each releases the GIL and raises RuntimeError with the CUDA reason.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "xla_ffi/transport.h"

namespace moonep {

namespace py = pybind11;

namespace {

void raise_if(const ffi::Error& err) {
  if (err.failure()) throw std::runtime_error(err.message());
}

template <typename Fn>
void without_gil(Fn&& fn) {
  ffi::Error err;
  {
    py::gil_scoped_release no_gil;
    err = fn();
  }
  raise_if(err);
}

// ranks: one (device_id, ordinal, area, pool_base, pool_size, pool_mapped) per rank.
using RankTuple = std::tuple<int32_t, int32_t, uint64_t, uint64_t, uint64_t, uint64_t>;

void register_group_py(const std::vector<RankTuple>& ranks) {
  std::vector<RankInfo> infos;
  for (const auto& [id, ordinal, area, base, size, mapped] : ranks) {
    infos.push_back({id, ordinal, area, base, size, mapped});
  }
  without_gil([&] { return register_group(infos); });
}

std::tuple<uint64_t, py::bytes> create_shared_area_py(int32_t ordinal) {
  uint64_t area = 0;
  std::string handle;
  without_gil([&] { return create_shared_area(ordinal, &area, &handle); });
  return {area, py::bytes(handle)};
}

uint64_t open_shared_area_py(const std::vector<int32_t>& ordinals, const py::bytes& handle,
                             const std::string& pci) {
  const std::string h = handle;
  uint64_t area = 0;
  without_gil([&] { return open_shared_area(ordinals, h, pci, &area); });
  return area;
}

std::string pci_bus_id_py(int32_t ordinal) {
  std::string id;
  without_gil([&] { return pci_bus_id(ordinal, &id); });
  return id;
}

std::tuple<int, uint64_t, uint64_t> export_pool_py(int32_t ordinal, uint64_t ptr) {
  int fd = -1;
  uint64_t base = 0, size = 0;
  without_gil([&] { return export_pool(ordinal, ptr, &fd, &base, &size); });
  return {fd, base, size};
}

uint64_t map_pool_py(int fd, uint64_t size, const std::vector<int32_t>& ordinals) {
  uint64_t mapped = 0;
  without_gil([&] { return map_pool(fd, size, ordinals, &mapped); });
  return mapped;
}

py::list transport_errors_py(bool clear) {
  std::vector<TransportError> errors;
  without_gil([&] { return read_errors(clear, &errors); });
  py::list out;
  for (const TransportError& e : errors) {
    py::dict d;
    d["device_id"] = e.device_id;
    d["code"] = e.code;
    d["code_name"] = e.code_name;
    d["rank"] = e.rank;
    d["epoch"] = e.epoch;
    d["slot"] = e.slot;
    d["detail"] = e.detail;
    d["what"] = e.what;
    out.append(d);
  }
  return out;
}

}  // namespace

void register_transport_bindings(py::module_& m) {
  m.def("register_group", &register_group_py, py::arg("ranks"),
        "Registers (once) the EP group whose ranks are (device_id, ordinal, area, pool_base, "
        "pool_size, pool_mapped) in rank order: ranks of this process have their CUDA ordinal "
        "(area 0: allocated here), ranks of other processes ordinal -1 and their mapped area and "
        "pool. Enables peer access and loads every kernel.");
  m.def("create_shared_area", &create_shared_area_py, py::arg("ordinal"),
        "A zeroed transport area on this process's CUDA device `ordinal`: (address, IPC handle).");
  m.def("open_shared_area", &open_shared_area_py, py::arg("ordinals"), py::arg("handle"),
        py::arg("pci_bus_id"),
        "Opens a peer process's area (on the device with that PCI bus id) from its IPC handle "
        "for this process's devices `ordinals`; returns its address here.");
  m.def("pci_bus_id", &pci_bus_id_py, py::arg("ordinal"),
        "The PCI bus id of this process's CUDA device `ordinal`.");
  m.def("export_pool", &export_pool_py, py::arg("ordinal"), py::arg("ptr"),
        "(fd, base, size) of the XLA memory pool holding pointer `ptr` on CUDA device `ordinal`, "
        "exported as a "
        "POSIX file descriptor of this process.");
  m.def("map_pool", &map_pool_py, py::arg("fd"), py::arg("size"), py::arg("ordinals"),
        "Maps a peer's pool once from `fd` (a descriptor of this process), accessible from the "
        "CUDA devices `ordinals`; returns the mapping's base address.");
  m.def("transport_errors", &transport_errors_py, py::arg("clear") = true,
        "The device-side error record of every transport area of this process that holds one, "
        "as dicts; `clear` resets them.");
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_EXPERTS") = kMaxExperts;
}

}  // namespace moonep
