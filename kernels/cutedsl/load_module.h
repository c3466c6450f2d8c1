// Loading of CuTe DSL kernels exported ahead of time with `export_to_c` (build_aot.py).
//
// The generated `<prefix>_Kernel_Module_Load` prints CUDA errors instead of returning them, so
// launchers load through `ExportedModule`, which makes the same two calls (`_cuda_init`, then
// `_cuda_load_to_device` for every visible device), once per process, and keeps the first error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

namespace moonep::cutedsl {

using ModuleInitFn = void (*)(void**);
using ModuleLoadToDeviceFn = void (*)(void**);

// `ModuleT` is the generated `<prefix>_Kernel_Module_t` (a struct holding one cudaLibrary_t).
template <typename ModuleT>
class ExportedModule {
 public:
  ExportedModule(ModuleInitFn init, ModuleLoadToDeviceFn load_to_device)
      : init_(init), load_to_device_(load_to_device) {}

  // Loads the cubin on every visible device on first use; later calls return the first result.
  // NOTE: call it at bootstrap, before any cross-device kernel spins: module loading takes
  // context-wide locks (jax_ffi_notes.md §9.3).
  cudaError_t ensure_loaded() {
    std::call_once(once_, [this] { status_ = load(); });
    return status_;
  }

  ModuleT* get() { return &module_; }

 private:
  cudaError_t load() {
    cudaLibrary_t* library = &module_.module;
    cudaError_t status = cudaSuccess;
    struct {
      cudaLibrary_t** library;
      cudaError_t* status;
    } init_args = {&library, &status};
    init_(reinterpret_cast<void**>(&init_args));
    if (status != cudaSuccess) return status;
    int32_t num_devices = 0;
    if (cudaError_t e = cudaGetDeviceCount(&num_devices); e != cudaSuccess) return e;
    int32_t device = 0;
    struct {
      cudaLibrary_t** library;
      int32_t* device;
      cudaError_t* status;
    } load_args = {&library, &device, &status};
    for (device = 0; device < num_devices; ++device) {
      load_to_device_(reinterpret_cast<void**>(&load_args));
      if (status != cudaSuccess) return status;
    }
    return cudaSuccess;
  }

  ModuleInitFn init_;
  ModuleLoadToDeviceFn load_to_device_;
  ModuleT module_{};
  std::once_flag once_;
  cudaError_t status_ = cudaSuccess;
};

// Makes `device` current: the exported wrappers launch on the current device. The device comes
// from XLA (the handler's context), not from cudaStreamGetDevice, which stream capture refuses
// (cudaErrorStreamCaptureUnsupported, in every capture mode): that call was what kept the grouped
// GEMM handlers out of XLA's command buffers.
inline cudaError_t use_device(int device) { return cudaSetDevice(device); }

}  // namespace moonep::cutedsl
