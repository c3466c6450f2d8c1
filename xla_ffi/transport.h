// Host side of the transport: the process-global registry of per-EP-group contexts.
//
// A context holds, for one EP group (the JAX device ids of its devices in rank order, rank =
// position on the EP mesh axis), the `PeerArea` of every rank as this process addresses it and,
// for ranks of other processes, this process's mapping of their XLA memory pool. Contexts are
// created only by `moonep_jax.bootstrap` (xla_ffi/transport_bindings.cc), before anything is
// traced, shared by every layer and call site, and never freed (kernels of any executable may
// still reference them). Handlers only look them up: `group_view` is a lock + map lookup, no
// allocation, no device work, no per-call state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/transport.cuh"
#include "xla/ffi/api/ffi.h"

namespace pybind11 {
class module_;
}

namespace moonep {

namespace ffi = xla::ffi;

// The view of the group that contains this process's device `device_ordinal` (CUDA ordinal).
// `mesh_devices` is the row-major `[num_groups, num_ranks]` table of JAX device ids of the
// concrete mesh (one row per EP group, identical in every process); the caller's rank is its
// column. Fails, naming `moonep_jax.bootstrap`, when the group was not bootstrapped.
ffi::ErrorOr<GroupView> group_view(int32_t device_ordinal, ffi::Span<const int32_t> mesh_devices,
                                   int32_t num_ranks, int64_t timeout_ns);

// One rank of a group being registered. A rank of this process has `ordinal >= 0` (area and
// pool fields are filled by `register_group`); a rank of another process has ordinal -1, its
// area as opened here and its pool as mapped here.
struct RankInfo {
  int32_t device_id;
  int32_t ordinal;
  uint64_t area;
  uint64_t pool_base, pool_size, pool_mapped;
};

// Registers the group `ranks` (rank order) unless it exists: allocates and zeroes the areas of
// this process's ranks that have none yet (`area == 0`), enables peer access between this
// process's devices of the group and loads every kernel. Must not run under stream capture.
ffi::Error register_group(std::vector<RankInfo> ranks);

// This process's side of a group that spans processes, before `register_group`: a zeroed area on
// device `ordinal` and its CUDA IPC handle.
ffi::Error create_shared_area(int32_t ordinal, uint64_t* area, std::string* ipc_handle);
// Opens a peer process's area from its IPC handle for this process's devices `ordinals`: opened
// on the first, and peer access enabled from the others to the area's device, the one with PCI
// bus id `pci_bus_id` (when this process sees it; CUDA IPC works without).
ffi::Error open_shared_area(const std::vector<int32_t>& ordinals, const std::string& ipc_handle,
                            const std::string& pci_bus_id, uint64_t* area);
// The PCI bus id of this process's CUDA device `ordinal` (how peers name it).
ffi::Error pci_bus_id(int32_t ordinal, std::string* id);
// The XLA pool that contains `ptr` (a JAX array's pointer on device `ordinal`): one VMM allocation,
// as a POSIX file descriptor. Fails, naming the setting, when it is not such an allocation.
ffi::Error export_pool(int32_t ordinal, uint64_t ptr, int* fd, uint64_t* base, uint64_t* size);
// Maps a peer's pool (imported from `fd`, a descriptor of this process) once, readable and
// writable by this process's devices `ordinals`.
ffi::Error map_pool(int fd, uint64_t size, const std::vector<int32_t>& ordinals, uint64_t* mapped);

// One error record of one of this process's areas.
struct TransportError {
  int32_t device_id;
  uint32_t code;
  std::string code_name;
  int32_t rank;
  uint32_t epoch;
  int32_t slot;
  int64_t detail;
  std::string what;
};
// Reads the error record of every area this process owns from its host-mapped mirror (plain
// loads: no CUDA call, so it works after a trap lost the context); with `clear`, resets the
// records that hold an error (device record on a private stream, then the mirror).
ffi::Error read_errors(bool clear, std::vector<TransportError>* errors);

// Adds the transport functions (bootstrap, limits) to the extension module.
// Defined in xla_ffi/transport_bindings.cc; called by xla_ffi/module.cc.
void register_transport_bindings(pybind11::module_& m);

// Formats a CUDA error for an ffi::Error message: "<where>: <call> failed: <name> (<text>)".
ffi::Error cuda_error(const char* where, const char* call, cudaError_t err);

}  // namespace moonep

// Returns an ffi::Error from the enclosing function when a CUDA runtime call fails.
#define MOONEP_CUDA_RETURN_IF_ERROR(where, call)                      \
  do {                                                                \
    const cudaError_t moonep_err_ = (call);                           \
    if (moonep_err_ != cudaSuccess) {                                 \
      return ::moonep::cuda_error((where), #call, moonep_err_);       \
    }                                                                 \
  } while (0)
