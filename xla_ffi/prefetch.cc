// XLA FFI handler `moonep_prefetch`: check buffers against each other, find this device's EP group,
// launch the zero-copy slot pull (kernels/prefetch.cu).
#include <cuda_runtime.h>

#include <string>

#include "kernels/prefetch.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/shape_checks.h"
#include "xla_ffi/transport.h"

namespace ffi = xla::ffi;
using moonep::dims_str;
using moonep::shape_error;

namespace {

constexpr const char* kOp = "moonep_prefetch";

ffi::Error PrefetchExecute(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer w_local,
                           ffi::Buffer<ffi::S32> experts_to_copy,
                           ffi::Result<ffi::AnyBuffer> w_slots,
                           ffi::Span<const int32_t> mesh_devices, int32_t num_ranks,
                           int32_t num_sms, int64_t timeout_ns, int32_t zero_unused_slots) {
  const auto w_dims = w_local.dimensions();
  if (w_dims.size() < 1 || w_dims[0] < 1)
    return shape_error(kOp, "w_local", "[epn, ...] with epn >= 1", w_dims);
  const int64_t epn = w_dims[0];
  const int64_t expert_bytes = w_local.size_bytes() / epn;
  if (expert_bytes % 2 != 0)
    return ffi::Error::InvalidArgument(std::string(kOp) +
                                       ": `w_local` must have a 2- or 4-byte dtype.");
  const auto e2c_dims = experts_to_copy.dimensions();
  if (e2c_dims.size() != 2 || e2c_dims[0] != num_ranks || e2c_dims[1] < 1)
    return shape_error(kOp, "experts_to_copy", "[R, B] with R = " + std::to_string(num_ranks), e2c_dims);
  const int64_t B = e2c_dims[1];
  const auto s_dims = w_slots->dimensions();
  bool slots_ok = s_dims.size() == w_dims.size() && s_dims[0] == B &&
                  w_slots->element_type() == w_local.element_type();
  for (size_t i = 1; slots_ok && i < w_dims.size(); ++i) slots_ok = s_dims[i] == w_dims[i];
  if (!slots_ok)
    return shape_error(kOp, "w_slots", "[B, ...] = [" + std::to_string(B) + ", ...] with w_local's "
                       "trailing dims " + dims_str(w_dims) + " and dtype", s_dims);

  auto group = moonep::group_view(device_ordinal, mesh_devices, num_ranks, timeout_ns);
  if (group.has_error()) return group.error();
  const moonep::PrefetchParams params{
      .group = *group,
      .w_local = w_local.untyped_data(),
      .experts_to_copy = experts_to_copy.typed_data(),
      .w_slots = w_slots->untyped_data(),
      .expert_bytes = expert_bytes,
      .experts_per_rank = static_cast<int32_t>(epn),
      .num_slots = static_cast<int32_t>(B),
      .num_sms = num_sms,
      .zero_unused_slots = zero_unused_slots != 0,
  };
  MOONEP_CUDA_RETURN_IF_ERROR(kOp, moonep::launch_prefetch(params, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepPrefetch, PrefetchExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // w_local [epn, D0, D1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // experts_to_copy [R, B] i32
                                  .Ret<ffi::AnyBuffer>()         // w_slots [B, D0, D1] w.dtype
                                  .Attr<ffi::Span<const int32_t>>("mesh_devices")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int32_t>("zero_unused_slots"),
                              {ffi::Traits::kCmdBufferCompatible});
