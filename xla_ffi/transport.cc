// Process-global registry of transport contexts (see transport.h).
#include "xla_ffi/transport.h"

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace moonep {
namespace {

struct TransportContext {
  std::vector<int32_t> ordinals;  // rank order
  std::vector<PeerArea*> areas;   // one per rank, on that rank's device
};

std::vector<const void*>& preload_kernels() {
  static std::vector<const void*> kernels;
  return kernels;
}

std::vector<ModuleLoader>& module_loaders() {
  static std::vector<ModuleLoader> loaders;
  return loaders;
}

std::string ordinals_str(const std::vector<int32_t>& ordinals) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < ordinals.size(); ++i) os << (i ? ", " : "") << ordinals[i];
  os << (ordinals.size() == 1 ? ",)" : ")");
  return os.str();
}

ffi::Error check_group(const std::vector<int32_t>& ordinals) {
  int num_devices = 0;
  MOONEP_CUDA_RETURN_IF_ERROR("moonep transport", cudaGetDeviceCount(&num_devices));
  if (ordinals.empty() || int(ordinals.size()) > kMaxRanks) {
    return ffi::Error::InvalidArgument("moonep transport: an EP group must have 1 to " +
                                       std::to_string(kMaxRanks) + " devices; got " +
                                       ordinals_str(ordinals) + ".");
  }
  for (size_t i = 0; i < ordinals.size(); ++i) {
    if (ordinals[i] < 0 || ordinals[i] >= num_devices) {
      return ffi::Error::InvalidArgument("moonep transport: CUDA ordinal " +
                                         std::to_string(ordinals[i]) + " of group " +
                                         ordinals_str(ordinals) + " is not in [0, " +
                                         std::to_string(num_devices) + ").");
    }
    for (size_t j = 0; j < i; ++j) {
      if (ordinals[i] == ordinals[j]) {
        return ffi::Error::InvalidArgument("moonep transport: group " + ordinals_str(ordinals) +
                                           " lists a device twice.");
      }
    }
  }
  return ffi::Error::Success();
}

// Peer access from `device` to every other device of the group. XLA usually enabled it already;
// the resulting cudaErrorPeerAccessAlreadyEnabled is sticky for the thread and must be cleared.
ffi::Error enable_peer_access(int32_t device, const std::vector<int32_t>& ordinals) {
  for (int32_t peer : ordinals) {
    if (peer == device) continue;
    int can = 0;
    MOONEP_CUDA_RETURN_IF_ERROR("moonep transport", cudaDeviceCanAccessPeer(&can, device, peer));
    if (!can) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "moonep transport: device " + std::to_string(device) +
                            " cannot access device " + std::to_string(peer) +
                            " (no NVLink/P2P path); the EP group " + ordinals_str(ordinals) +
                            " needs peer access between all of its devices.");
    }
    const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();
    } else if (err != cudaSuccess) {
      return cuda_error("moonep transport", "cudaDeviceEnablePeerAccess", err);
    }
  }
  return ffi::Error::Success();
}

// Allocates and zeroes one area per device and loads every registered kernel there. Runs on a
// helper thread (see create_context), so switching devices never disturbs the caller.
ffi::Error init_context(TransportContext& ctx) {
  for (int32_t device : ctx.ordinals) {
    MOONEP_CUDA_RETURN_IF_ERROR("moonep transport", cudaSetDevice(device));
    if (auto err = enable_peer_access(device, ctx.ordinals); err.failure()) return err;
    PeerArea* area = nullptr;
    MOONEP_CUDA_RETURN_IF_ERROR("moonep transport",
                                cudaMalloc(reinterpret_cast<void**>(&area), sizeof(PeerArea)));
    ctx.areas.push_back(area);
    // A private non-blocking stream: zeroing must not wait for, or be ordered with, XLA's work.
    cudaStream_t stream;
    MOONEP_CUDA_RETURN_IF_ERROR("moonep transport",
                                cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    MOONEP_CUDA_RETURN_IF_ERROR("moonep transport",
                                cudaMemsetAsync(area, 0, sizeof(PeerArea), stream));
    MOONEP_CUDA_RETURN_IF_ERROR("moonep transport", cudaStreamSynchronize(stream));
    MOONEP_CUDA_RETURN_IF_ERROR("moonep transport", cudaStreamDestroy(stream));
    for (const void* kernel : preload_kernels()) {
      cudaFuncAttributes attrs;
      MOONEP_CUDA_RETURN_IF_ERROR("moonep transport", cudaFuncGetAttributes(&attrs, kernel));
    }
  }
  for (ModuleLoader load : module_loaders()) {  // each loads on every device, once per process
    MOONEP_CUDA_RETURN_IF_ERROR("moonep transport: loading a CuTe DSL module", load());
  }
  return ffi::Error::Success();
}

std::mutex registry_mutex;
std::map<std::vector<int32_t>, std::unique_ptr<TransportContext>> registry;  // key: ordinals

// Creates the context on a fresh thread: a handler may be running under CUDA stream capture
// (XLA command buffers capture thread-locally), where allocation on the capturing thread is
// illegal. Caller holds registry_mutex.
ffi::ErrorOr<TransportContext*> create_context(const std::vector<int32_t>& ordinals) {
  if (auto err = check_group(ordinals); err.failure()) return err;
  auto ctx = std::make_unique<TransportContext>();
  ctx->ordinals = ordinals;
  ffi::Error result;
  std::thread worker([&] { result = init_context(*ctx); });
  worker.join();
  if (result.failure()) return result;  // areas of a failed group are leaked on purpose: rare
  TransportContext* raw = ctx.get();
  registry.emplace(ordinals, std::move(ctx));
  return raw;
}

ffi::ErrorOr<TransportContext*> get_or_create(const std::vector<int32_t>& ordinals) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(ordinals);
  if (it != registry.end()) return it->second.get();
  return create_context(ordinals);
}

}  // namespace

int register_kernel_for_preload(const void* kernel) {
  preload_kernels().push_back(kernel);
  return int(preload_kernels().size());
}

int register_module_loader_for_preload(ModuleLoader loader) {
  module_loaders().push_back(loader);
  return int(module_loaders().size());
}

ffi::Error cuda_error(const char* where, const char* call, cudaError_t err) {
  return ffi::Error::Internal(std::string(where) + ": " + call + " failed: " +
                              cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

ffi::Error bootstrap_group(const std::vector<int32_t>& ordinals) {
  auto ctx = get_or_create(ordinals);
  return ctx.has_value() ? ffi::Error::Success() : ctx.error();
}

ffi::ErrorOr<GroupView> group_view(int32_t device_ordinal, ffi::Span<const int32_t> mesh_ordinals,
                                   int32_t num_ranks) {
  if (num_ranks < 1 || num_ranks > kMaxRanks || mesh_ordinals.size() % size_t(num_ranks) != 0) {
    return ffi::Error::InvalidArgument(
        "moonep transport: `mesh_ordinals` must be a [num_groups, R] table with 1 <= R <= " +
        std::to_string(kMaxRanks) + "; got " + std::to_string(mesh_ordinals.size()) +
        " ordinals for R = " + std::to_string(num_ranks) + ".");
  }
  for (size_t i = 0; i < mesh_ordinals.size(); ++i) {
    if (mesh_ordinals[i] != device_ordinal) continue;
    const size_t row = i / size_t(num_ranks);
    std::vector<int32_t> ordinals(mesh_ordinals.begin() + row * num_ranks,
                                  mesh_ordinals.begin() + (row + 1) * num_ranks);
    auto ctx = get_or_create(ordinals);
    if (ctx.has_error()) return ctx.error();
    GroupView view{};
    view.rank = int(i % size_t(num_ranks));
    view.num_ranks = num_ranks;
    for (int r = 0; r < num_ranks; ++r) view.areas[r] = (*ctx)->areas[r];
    view.timeout_ns = kDefaultTimeoutNs;
    return view;
  }
  return ffi::Error::InvalidArgument(
      "moonep transport: the device with CUDA ordinal " + std::to_string(device_ordinal) +
      " is not in `mesh_ordinals`; the mesh the op was traced with does not contain this device.");
}

}  // namespace moonep
