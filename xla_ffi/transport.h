// Host side of the transport: the process-global registry of per-EP-group contexts.
//
// A context holds, for one EP group (the ordered CUDA ordinals of its devices, rank = position on
// the EP mesh axis), one zeroed `PeerArea` per device and peer access between all of them. It is
// created once, by `bootstrap_group` (Python: `moonep_jax.bootstrap`) or lazily by the first
// handler that needs it, shared by every layer and call site, and never freed (kernels of any
// executable may still reference it). After creation, `group_view` is a lock + map lookup: no
// allocation, no device work, no per-call state.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/transport.cuh"
#include "xla/ffi/api/ffi.h"

namespace pybind11 {
class module_;
}

namespace moonep {

namespace ffi = xla::ffi;

// The view of the group that contains `device_ordinal`. `mesh_ordinals` is the row-major
// `[num_groups, num_ranks]` table of CUDA ordinals of the concrete mesh (one row per EP group);
// the caller's rank is its column. Creates the group's context on first use. `timeout_ns` is
// kDefaultTimeoutNs; handlers overwrite it from their timeout attribute.
ffi::ErrorOr<GroupView> group_view(int32_t device_ordinal, ffi::Span<const int32_t> mesh_ordinals,
                                   int32_t num_ranks);

// Creates the context of the group `ordinals` (rank order) if it does not exist yet. Safe to call
// repeatedly; must not be called while a CUDA stream capture is active on the calling thread.
ffi::Error bootstrap_group(const std::vector<int32_t>& ordinals);

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
