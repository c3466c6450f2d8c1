// Process-global registry of transport contexts, and the CUDA work of bootstrap (see transport.h).
#include "xla_ffi/transport.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <functional>
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

constexpr const char* kWhere = "moonep transport";

struct TransportContext {
  std::vector<RankInfo> ranks;          // rank order
  std::vector<ErrorRecord*> mirrors;    // per rank: device address of its error mirror (local)
};

// An area this process owns (allocated here) and its error record's host-mapped mirror, which
// `read_errors` reads.
struct OwnedArea {
  int32_t device_id;
  int32_t ordinal;
  PeerArea* area;
  ErrorRecord* mirror_host;
  ErrorRecord* mirror_device;
};

std::vector<const void*>& preload_kernels() {
  static std::vector<const void*> kernels;
  return kernels;
}

std::vector<ModuleLoader>& module_loaders() {
  static std::vector<ModuleLoader> loaders;
  return loaders;
}

std::mutex registry_mutex;
std::map<std::vector<int32_t>, std::unique_ptr<TransportContext>> registry;  // key: device ids
std::map<int32_t, int32_t> device_id_of_ordinal;  // this process's bootstrapped devices
std::vector<OwnedArea> owned_areas;

// Runs CUDA work on a fresh thread: a caller may be under stream capture (allocation is illegal
// there, and capture is thread-local), and device switches must not leak into the caller.
ffi::Error on_helper_thread(const std::function<ffi::Error()>& work) {
  ffi::Error result;
  std::thread worker([&] { result = work(); });
  worker.join();
  return result;
}

std::string ids_str(const std::vector<int32_t>& ids) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < ids.size(); ++i) os << (i ? ", " : "") << ids[i];
  os << (ids.size() == 1 ? ",)" : ")");
  return os.str();
}

// ---- CUDA driver API (VMM export/import), reached through the runtime: no link to libcuda ----

template <typename Fn>
ffi::Error driver_entry(const char* name, Fn** fn) {
  cudaDriverEntryPointQueryResult status{};
  const cudaError_t err = cudaGetDriverEntryPointByVersion(
      name, reinterpret_cast<void**>(fn), CUDA_VERSION, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || *fn == nullptr) {
    return ffi::Error::Internal(std::string(kWhere) + ": the CUDA driver has no " + name +
                                " (driver too old for CUDA " + std::to_string(CUDA_VERSION) + ")");
  }
  return ffi::Error::Success();
}

#define MOONEP_DRIVER(fn) \
  decltype(&::fn) fn##_ = nullptr; \
  if (auto e = driver_entry(#fn, &fn##_); e.failure()) return e

ffi::Error driver_error(const char* call, CUresult rc, const std::string& hint = "") {
  const char* name = nullptr;
  decltype(&::cuGetErrorName) get_name = nullptr;
  if (driver_entry("cuGetErrorName", &get_name).success()) get_name(rc, &name);
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string(kWhere) + ": " + call + " failed: " + (name ? name : "?") + " (" +
                        std::to_string(int(rc)) + ")" + hint);
}

// ---- group checks, peer access, areas, kernels ------------------------------------------------

ffi::Error check_group(const std::vector<RankInfo>& ranks) {
  int num_devices = 0;
  MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaGetDeviceCount(&num_devices));
  std::vector<int32_t> ids;
  for (const RankInfo& r : ranks) ids.push_back(r.device_id);
  if (ranks.empty() || int(ranks.size()) > kMaxRanks) {
    return ffi::Error::InvalidArgument(std::string(kWhere) + ": an EP group must have 1 to " +
                                       std::to_string(kMaxRanks) + " devices; got " +
                                       ids_str(ids) + ".");
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i].ordinal >= num_devices) {
      return ffi::Error::InvalidArgument(std::string(kWhere) + ": CUDA ordinal " +
                                         std::to_string(ranks[i].ordinal) + " of group " +
                                         ids_str(ids) + " is not in [0, " +
                                         std::to_string(num_devices) + ").");
    }
    for (size_t j = 0; j < i; ++j) {
      if (ids[i] == ids[j] || (ranks[i].ordinal >= 0 && ranks[i].ordinal == ranks[j].ordinal)) {
        return ffi::Error::InvalidArgument(std::string(kWhere) + ": group " + ids_str(ids) +
                                           " lists a device twice.");
      }
    }
    if (ranks[i].ordinal < 0 && (ranks[i].area == 0 || ranks[i].pool_size == 0)) {
      return ffi::Error::InvalidArgument(std::string(kWhere) + ": rank " + std::to_string(i) +
                                         " of group " + ids_str(ids) +
                                         " belongs to another process but has no mapped area "
                                         "and pool.");
    }
  }
  return ffi::Error::Success();
}

// Peer access from the current device to `peer`. XLA usually enabled it already; the resulting
// cudaErrorPeerAccessAlreadyEnabled is sticky and must be cleared.
ffi::Error enable_peer_access_to(int32_t peer, const char* call) {
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
  } else if (err != cudaSuccess) {
    return cuda_error(kWhere, call, err);
  }
  return ffi::Error::Success();
}

// Peer access from `device` (the current device) to the group's other devices of this process.
ffi::Error enable_peer_access(int32_t device, const std::vector<RankInfo>& ranks) {
  for (const RankInfo& r : ranks) {
    const int32_t peer = r.ordinal;
    if (peer < 0 || peer == device) continue;
    int can = 0;
    MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaDeviceCanAccessPeer(&can, device, peer));
    if (!can) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        std::string(kWhere) + ": CUDA device " + std::to_string(device) +
                            " cannot access device " + std::to_string(peer) +
                            " (no NVLink/P2P path); an EP group needs peer access between all "
                            "of its devices.");
    }
    if (auto err = enable_peer_access_to(peer, "cudaDeviceEnablePeerAccess"); err.failure())
      return err;
  }
  return ffi::Error::Success();
}

// A zeroed area on the current device (zeroed on a private stream: never ordered with XLA's).
ffi::Error new_area(PeerArea** area) {
  MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaMalloc(reinterpret_cast<void**>(area), sizeof(PeerArea)));
  cudaStream_t stream;
  MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaMemsetAsync(*area, 0, sizeof(PeerArea), stream));
  MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaStreamSynchronize(stream));
  MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaStreamDestroy(stream));
  return ffi::Error::Success();
}

// Loads every registered kernel on the current device: loading lazily while a peer spins in a
// barrier can deadlock.
ffi::Error preload_on_current_device() {
  for (const void* kernel : preload_kernels()) {
    cudaFuncAttributes attrs;
    MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaFuncGetAttributes(&attrs, kernel));
  }
  return ffi::Error::Success();
}

// A zeroed ErrorRecord in mapped pinned host memory: (host address, device address).
ffi::Error new_error_mirror(ErrorRecord** host, ErrorRecord** device) {
  MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaHostAlloc(reinterpret_cast<void**>(host),
                                                    sizeof(ErrorRecord),
                                                    cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(*host, 0, sizeof(ErrorRecord));
  MOONEP_CUDA_RETURN_IF_ERROR(kWhere,
                              cudaHostGetDevicePointer(reinterpret_cast<void**>(device), *host, 0));
  return ffi::Error::Success();
}

ffi::Error init_local_ranks(std::vector<RankInfo>& ranks, std::vector<OwnedArea>& owned) {
  for (RankInfo& r : ranks) {
    if (r.ordinal < 0) continue;
    MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaSetDevice(r.ordinal));
    if (auto err = enable_peer_access(r.ordinal, ranks); err.failure()) return err;
    if (r.area == 0) {
      PeerArea* area = nullptr;
      if (auto err = new_area(&area); err.failure()) return err;
      r.area = reinterpret_cast<uint64_t>(area);
    }
    r.pool_base = r.pool_size = r.pool_mapped = 0;  // own address space
    OwnedArea o{r.device_id, r.ordinal, reinterpret_cast<PeerArea*>(r.area), nullptr, nullptr};
    if (auto err = new_error_mirror(&o.mirror_host, &o.mirror_device); err.failure()) return err;
    owned.push_back(o);
    if (auto err = preload_on_current_device(); err.failure()) return err;
  }
  for (ModuleLoader load : module_loaders()) {  // each loads on every device, once per process
    MOONEP_CUDA_RETURN_IF_ERROR("moonep transport: loading a CuTe DSL module", load());
  }
  return ffi::Error::Success();
}

std::string not_bootstrapped(const std::string& what) {
  return std::string(kWhere) + ": " + what +
         " was not bootstrapped: call `moonep_jax.bootstrap(mesh, axis_name)` in every process "
         "after building the mesh and before tracing the ops.";
}

const char* error_code_name(uint32_t code) {
  switch (code) {
    case kErrTimeout: return "timeout";
    case kErrBadPlanData: return "bad plan data";
    case kErrPeerAddress: return "peer address outside its pool";
    default: return "unknown";
  }
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

ffi::Error register_group(std::vector<RankInfo> ranks) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  std::vector<int32_t> ids;
  for (const RankInfo& r : ranks) ids.push_back(r.device_id);
  if (registry.count(ids)) return ffi::Error::Success();
  if (auto err = check_group(ranks); err.failure()) return err;
  for (const RankInfo& r : ranks) {
    auto it = device_id_of_ordinal.find(r.ordinal);
    if (r.ordinal >= 0 && it != device_id_of_ordinal.end() && it->second != r.device_id) {
      return ffi::Error::InvalidArgument(
          std::string(kWhere) + ": CUDA device " + std::to_string(r.ordinal) +
          " of this process was bootstrapped as JAX device " + std::to_string(it->second) +
          " and now as " + std::to_string(r.device_id) + ".");
    }
  }
  std::vector<OwnedArea> owned;
  if (auto err = on_helper_thread([&] { return init_local_ranks(ranks, owned); });
      err.failure()) {
    return err;  // areas of a failed group are leaked on purpose: rare
  }
  auto ctx = std::make_unique<TransportContext>();
  ctx->mirrors.assign(ranks.size(), nullptr);
  for (const OwnedArea& o : owned) {
    device_id_of_ordinal[o.ordinal] = o.device_id;
    owned_areas.push_back(o);
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i].device_id == o.device_id) ctx->mirrors[i] = o.mirror_device;
    }
  }
  ctx->ranks = std::move(ranks);
  registry.emplace(ids, std::move(ctx));
  return ffi::Error::Success();
}

ffi::Error create_shared_area(int32_t ordinal, uint64_t* area, std::string* ipc_handle) {
  return on_helper_thread([&]() -> ffi::Error {
    MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaSetDevice(ordinal));
    PeerArea* a = nullptr;
    if (auto err = new_area(&a); err.failure()) return err;
    cudaIpcMemHandle_t handle;
    MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaIpcGetMemHandle(&handle, a));
    *area = reinterpret_cast<uint64_t>(a);
    ipc_handle->assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    return ffi::Error::Success();
  });
}

ffi::Error pci_bus_id(int32_t ordinal, std::string* id) {
  char buffer[64] = {};
  MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaDeviceGetPCIBusId(buffer, sizeof(buffer), ordinal));
  *id = buffer;
  return ffi::Error::Success();
}

ffi::Error open_shared_area(const std::vector<int32_t>& ordinals, const std::string& ipc_handle,
                            const std::string& pci_bus_id, uint64_t* area) {
  if (ordinals.empty()) {
    return ffi::Error::InvalidArgument("moonep transport: open_shared_area needs a device.");
  }
  if (ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return ffi::Error::InvalidArgument(std::string(kWhere) + ": a peer's area handle has " +
                                       std::to_string(ipc_handle.size()) + " bytes, not " +
                                       std::to_string(sizeof(cudaIpcMemHandle_t)) + ".");
  }
  return on_helper_thread([&]() -> ffi::Error {
    MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaSetDevice(ordinals[0]));
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, ipc_handle.data(), sizeof(handle));
    void* p = nullptr;
    MOONEP_CUDA_RETURN_IF_ERROR(
        kWhere, cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess));
    *area = reinterpret_cast<uint64_t>(p);
    int owner = -1;
    if (cudaDeviceGetByPCIBusId(&owner, pci_bus_id.c_str()) != cudaSuccess) {
      cudaGetLastError();  // not visible here: only the first device reaches it (through IPC)
      return ffi::Error::Success();
    }
    for (size_t i = 1; i < ordinals.size(); ++i) {
      if (ordinals[i] == owner) continue;
      MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaSetDevice(ordinals[i]));
      if (auto err = enable_peer_access_to(
              owner, "cudaDeviceEnablePeerAccess (a peer process's device)");
          err.failure())
        return err;
    }
    return ffi::Error::Success();
  });
}

ffi::Error export_pool(int32_t ordinal, uint64_t ptr, int* fd, uint64_t* base, uint64_t* size) {
  return on_helper_thread([&]() -> ffi::Error {
    MOONEP_DRIVER(cuPointerGetAttribute);
    MOONEP_DRIVER(cuMemRetainAllocationHandle);
    MOONEP_DRIVER(cuMemGetAllocationPropertiesFromHandle);
    MOONEP_DRIVER(cuMemExportToShareableHandle);
    MOONEP_DRIVER(cuMemRelease);
    const std::string hint =
        ". The multi-process transport maps each peer's XLA memory pool once; it needs XLA's "
        "default allocator (unset XLA_PYTHON_CLIENT_ALLOCATOR, or set it to 'bfc'), with "
        "preallocation (XLA_PYTHON_CLIENT_PREALLOCATE unset or 'true').";
    MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaSetDevice(ordinal));
    MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaFree(nullptr));  // make the primary context current
    CUdeviceptr mapping_base = 0;
    size_t mapping_size = 0;
    CUresult rc = cuPointerGetAttribute_(&mapping_base, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
                                CUdeviceptr(ptr));
    if (rc != CUDA_SUCCESS) return driver_error("cuPointerGetAttribute(MAPPING_BASE_ADDR)", rc, hint);
    rc = cuPointerGetAttribute_(&mapping_size, CU_POINTER_ATTRIBUTE_MAPPING_SIZE, CUdeviceptr(ptr));
    if (rc != CUDA_SUCCESS) return driver_error("cuPointerGetAttribute(MAPPING_SIZE)", rc, hint);
    CUmemGenericAllocationHandle handle;
    rc = cuMemRetainAllocationHandle_(&handle, reinterpret_cast<void*>(ptr));
    if (rc != CUDA_SUCCESS) return driver_error("cuMemRetainAllocationHandle", rc, hint);
    CUmemAllocationProp prop{};
    rc = cuMemGetAllocationPropertiesFromHandle_(&prop, handle);
    if (rc == CUDA_SUCCESS &&
        !(prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
      cuMemRelease_(handle);
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        std::string(kWhere) + ": XLA's memory pool cannot be exported as a POSIX "
                        "file descriptor" + hint);
    }
    int shared = -1;
    rc = cuMemExportToShareableHandle_(&shared, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    cuMemRelease_(handle);
    if (rc != CUDA_SUCCESS) return driver_error("cuMemExportToShareableHandle", rc, hint);
    *fd = shared;
    *base = uint64_t(mapping_base);
    *size = uint64_t(mapping_size);
    return ffi::Error::Success();
  });
}

ffi::Error map_pool(int fd, uint64_t size, const std::vector<int32_t>& ordinals, uint64_t* mapped) {
  if (ordinals.empty()) return ffi::Error::InvalidArgument("moonep transport: map_pool needs a device.");
  return on_helper_thread([&]() -> ffi::Error {
    MOONEP_DRIVER(cuMemImportFromShareableHandle);
    MOONEP_DRIVER(cuMemAddressReserve);
    MOONEP_DRIVER(cuMemMap);
    MOONEP_DRIVER(cuMemSetAccess);
    MOONEP_DRIVER(cuMemRelease);
    MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaSetDevice(ordinals[0]));
    MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaFree(nullptr));
    CUmemGenericAllocationHandle handle;
    CUresult rc = cuMemImportFromShareableHandle_(
        &handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (rc != CUDA_SUCCESS) return driver_error("cuMemImportFromShareableHandle", rc);
    CUdeviceptr va = 0;
    rc = cuMemAddressReserve_(&va, size, 0, 0, 0);
    if (rc != CUDA_SUCCESS) return driver_error("cuMemAddressReserve", rc);
    rc = cuMemMap_(va, size, 0, handle, 0);
    cuMemRelease_(handle);  // the mapping keeps the allocation alive
    if (rc != CUDA_SUCCESS) return driver_error("cuMemMap", rc);
    std::vector<CUmemAccessDesc> access(ordinals.size());
    for (size_t i = 0; i < ordinals.size(); ++i) {
      access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access[i].location.id = ordinals[i];
      access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    rc = cuMemSetAccess_(va, size, access.data(), access.size());
    if (rc != CUDA_SUCCESS) return driver_error("cuMemSetAccess", rc);
    *mapped = uint64_t(va);
    return ffi::Error::Success();
  });
}

ffi::Error read_errors(bool clear, std::vector<TransportError>* errors) {
  std::vector<OwnedArea> areas;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    areas = owned_areas;
  }
  std::vector<const OwnedArea*> to_clear;
  for (const OwnedArea& a : areas) {
    const volatile ErrorRecord* m = a.mirror_host;  // written by kernels over PCIe
    const uint32_t code = m->code;
    if (code == kErrNone) continue;
    std::atomic_thread_fence(std::memory_order_acquire);
    TransportError e{a.device_id, code, error_code_name(code), m->rank, m->epoch, m->slot,
                     m->detail, ""};
    for (size_t i = 0; i + 1 < sizeof(m->what) && m->what[i] != '\0'; ++i) e.what += m->what[i];
    errors->push_back(e);
    to_clear.push_back(&a);
  }
  if (!clear || to_clear.empty()) return ffi::Error::Success();
  // Reset the device records (so that later errors are kept again), then the mirrors.
  return on_helper_thread([&]() -> ffi::Error {
    for (const OwnedArea* a : to_clear) {
      MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaSetDevice(a->ordinal));
      cudaStream_t stream;
      MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      MOONEP_CUDA_RETURN_IF_ERROR(
          kWhere, cudaMemsetAsync(&a->area->error, 0, sizeof(ErrorRecord), stream));
      MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaStreamSynchronize(stream));
      MOONEP_CUDA_RETURN_IF_ERROR(kWhere, cudaStreamDestroy(stream));
      std::memset(a->mirror_host, 0, sizeof(ErrorRecord));
    }
    return ffi::Error::Success();
  });
}

ffi::ErrorOr<GroupView> group_view(int32_t device_ordinal, ffi::Span<const int32_t> mesh_devices,
                                   int32_t num_ranks, int64_t timeout_ns) {
  if (num_ranks < 1 || num_ranks > kMaxRanks || mesh_devices.size() % size_t(num_ranks) != 0) {
    return ffi::Error::InvalidArgument(
        "moonep transport: `mesh_devices` must be a [num_groups, R] table with 1 <= R <= " +
        std::to_string(kMaxRanks) + "; got " + std::to_string(mesh_devices.size()) +
        " device ids for R = " + std::to_string(num_ranks) + ".");
  }
  if (timeout_ns <= 0) {
    return ffi::Error::InvalidArgument("moonep transport: `timeout_ns` must be > 0; got " +
                                       std::to_string(timeout_ns) + ".");
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto id = device_id_of_ordinal.find(device_ordinal);
  if (id == device_id_of_ordinal.end()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      not_bootstrapped("CUDA device " + std::to_string(device_ordinal)));
  }
  for (size_t i = 0; i < mesh_devices.size(); ++i) {
    if (mesh_devices[i] != id->second) continue;
    const size_t row = i / size_t(num_ranks);
    const std::vector<int32_t> ids(mesh_devices.begin() + row * num_ranks,
                                   mesh_devices.begin() + (row + 1) * num_ranks);
    auto ctx = registry.find(ids);
    if (ctx == registry.end()) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        not_bootstrapped("the EP group of JAX devices " + ids_str(ids)));
    }
    GroupView view{};
    view.rank = int(i % size_t(num_ranks));
    view.num_ranks = num_ranks;
    view.timeout_ns = static_cast<uint64_t>(timeout_ns);
    view.error_mirror = ctx->second->mirrors[view.rank];
    for (int r = 0; r < num_ranks; ++r) {
      const RankInfo& info = ctx->second->ranks[r];
      view.areas[r] = reinterpret_cast<PeerArea*>(info.area);
      view.pool_base[r] = info.pool_base;
      view.pool_size[r] = info.pool_size;
      view.pool_mapped[r] = info.pool_mapped;
    }
    return view;
  }
  return ffi::Error::InvalidArgument(
      "moonep transport: JAX device " + std::to_string(id->second) + " (CUDA device " +
      std::to_string(device_ordinal) +
      ") is not in `mesh_devices`; the mesh the op was traced with does not contain this device.");
}

}  // namespace moonep
