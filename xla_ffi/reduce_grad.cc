// XLA FFI handler `moonep_reduce_grad`: check buffers against each other, find this device's EP
// group, launch the zero-copy reduction of replica gradients (kernels/reduce_grad.cu).
#include <cuda_runtime.h>

#include <string>

#include "kernels/reduce_grad.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/shape_checks.h"
#include "xla_ffi/transport.h"

namespace ffi = xla::ffi;
using moonep::dims_str;
using moonep::shape_error;

namespace {

constexpr const char* kOp = "moonep_reduce_grad";

// Whether `dims` is [leading, trailing dims of `like`...].
bool same_trailing_dims(ffi::Span<const int64_t> dims, int64_t leading,
                        ffi::Span<const int64_t> like) {
  if (dims.size() != like.size() || dims[0] != leading) return false;
  for (size_t i = 1; i < dims.size(); ++i)
    if (dims[i] != like[i]) return false;
  return true;
}

ffi::Error ReduceGradExecute(cudaStream_t stream, int32_t device_ordinal,
                             ffi::Buffer<ffi::F32> g_local, ffi::Buffer<ffi::F32> g_slots,
                             ffi::Buffer<ffi::S32> experts_to_copy,
                             ffi::Result<ffi::Buffer<ffi::F32>> g,
                             ffi::Span<const int32_t> mesh_devices, int32_t num_ranks,
                             int32_t num_sms, int64_t timeout_ns) {
  const auto local_dims = g_local.dimensions();
  if (local_dims.size() < 1 || local_dims[0] < 1)
    return shape_error(kOp, "g_local", "[epn, ...] with epn >= 1", local_dims);
  const int64_t epn = local_dims[0];
  const auto e2c_dims = experts_to_copy.dimensions();
  if (e2c_dims.size() != 2 || e2c_dims[0] != num_ranks || e2c_dims[1] < 1)
    return shape_error(kOp, "experts_to_copy", "[R, B] with R = " + std::to_string(num_ranks), e2c_dims);
  const int64_t B = e2c_dims[1];
  if (!same_trailing_dims(g_slots.dimensions(), B, local_dims))
    return shape_error(kOp, "g_slots",
                       "[B, ...] with B = " + std::to_string(B) + " and g_local's trailing dims " +
                           dims_str(local_dims),
                       g_slots.dimensions());
  if (!same_trailing_dims(g->dimensions(), epn, local_dims))
    return shape_error(kOp, "g", "g_local's " + dims_str(local_dims), g->dimensions());

  // The kernel writes only the experts that receive contributions: the rest of `g` must already
  // hold g_local (jax's ffi_call aliases them, input_output_aliases={0: 0}).
  if (g->typed_data() != g_local.typed_data())
    return ffi::Error::InvalidArgument(
        std::string(kOp) + ": the result g must alias g_local (call it with "
        "input_output_aliases={0: 0}, as moonep_jax._cuda.comm.reduce_grad_impl does)");

  auto group = moonep::group_view(device_ordinal, mesh_devices, num_ranks, timeout_ns);
  if (group.has_error()) return group.error();
  const moonep::ReduceGradParams params{
      .group = *group,
      .g_local = g_local.typed_data(),
      .g_slots = g_slots.typed_data(),
      .experts_to_copy = experts_to_copy.typed_data(),
      .g = g->typed_data(),
      .expert_elems = static_cast<int64_t>(g_local.element_count()) / epn,
      .experts_per_rank = static_cast<int32_t>(epn),
      .num_slots = static_cast<int32_t>(B),
      .num_sms = num_sms,
  };
  MOONEP_CUDA_RETURN_IF_ERROR(kOp, moonep::launch_reduce_grad(params, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepReduceGrad, ReduceGradExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g_local [epn, D0, D1] f32
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g_slots [B, D0, D1] f32
                                  .Arg<ffi::Buffer<ffi::S32>>()  // experts_to_copy [R, B] i32
                                  .Ret<ffi::Buffer<ffi::F32>>()  // g [epn, D0, D1] f32
                                  .Attr<ffi::Span<const int32_t>>("mesh_devices")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns"),
                              {ffi::Traits::kCmdBufferCompatible});
