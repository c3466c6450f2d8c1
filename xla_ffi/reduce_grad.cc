// XLA FFI handler `moonep_reduce_grad`: check buffers against each other, find this device's EP
// group, launch the zero-copy reduction of replica gradients into `g` (kernels/reduce_grad.cu).
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

ffi::Error ReduceGradExecute(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer g_in,
                             ffi::Buffer<ffi::F32> g_partial, ffi::Buffer<ffi::F32> g_slots,
                             ffi::Buffer<ffi::S32> experts_to_copy, ffi::Result<ffi::AnyBuffer> g,
                             ffi::Span<const int32_t> mesh_devices, int32_t num_ranks,
                             int32_t num_sms, int64_t timeout_ns) {
  const auto local_dims = g_in.dimensions();
  if (local_dims.size() < 1 || local_dims[0] < 1)
    return shape_error(kOp, "g", "[epn, ...] with epn >= 1", local_dims);
  const int64_t epn = local_dims[0];
  const bool g_is_bf16 = g_in.element_type() == ffi::DataType::BF16;
  if (!g_is_bf16 && g_in.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(std::string(kOp) + ": `g` must be float32 or bfloat16");
  // Without partials (a [0, ...] operand) g itself holds the fp32 first terms.
  const bool partials_in_g = g_partial.dimensions().size() >= 1 && g_partial.dimensions()[0] == 0;
  if (partials_in_g && g_is_bf16)
    return ffi::Error::InvalidArgument(std::string(kOp) +
                                       ": a bfloat16 `g` needs fp32 `g_partial` [epn, ...]");
  if (!partials_in_g && !same_trailing_dims(g_partial.dimensions(), epn, local_dims))
    return shape_error(kOp, "g_partial", "[0, ...] or g's " + dims_str(local_dims),
                       g_partial.dimensions());
  const auto e2c_dims = experts_to_copy.dimensions();
  if (e2c_dims.size() != 2 || e2c_dims[0] != num_ranks || e2c_dims[1] < 1)
    return shape_error(kOp, "experts_to_copy", "[R, B] with R = " + std::to_string(num_ranks), e2c_dims);
  const int64_t B = e2c_dims[1];
  if (!same_trailing_dims(g_slots.dimensions(), B, local_dims))
    return shape_error(kOp, "g_slots",
                       "[B, ...] with B = " + std::to_string(B) + " and g's trailing dims " +
                           dims_str(local_dims),
                       g_slots.dimensions());
  if (g->element_type() != g_in.element_type() || !same_trailing_dims(g->dimensions(), epn, local_dims))
    return shape_error(kOp, "result", "g's " + dims_str(local_dims) + " and dtype", g->dimensions());

  // The kernel writes only the experts that receive contributions: the rest of the result must
  // already hold g (jax's ffi_call aliases them, input_output_aliases={0: 0}).
  if (g->untyped_data() != g_in.untyped_data())
    return ffi::Error::InvalidArgument(
        std::string(kOp) + ": the result must alias g (call it with "
        "input_output_aliases={0: 0}, as moonep_jax._cuda.comm.reduce_grad does)");

  auto group = moonep::group_view(device_ordinal, mesh_devices, num_ranks, timeout_ns);
  if (group.has_error()) return group.error();
  const moonep::ReduceGradParams params{
      .group = *group,
      .g_partial = partials_in_g ? static_cast<const float*>(g_in.untyped_data())
                                 : g_partial.typed_data(),
      .g_slots = g_slots.typed_data(),
      .experts_to_copy = experts_to_copy.typed_data(),
      .g = g->untyped_data(),
      .g_is_bf16 = g_is_bf16,
      .expert_elems = static_cast<int64_t>(g_in.element_count()) / epn,
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
                                  .Arg<ffi::AnyBuffer>()         // g [epn, D0, D1] f32 | bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g_partial [epn | 0, D0, D1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g_slots [B, D0, D1] f32
                                  .Arg<ffi::Buffer<ffi::S32>>()  // experts_to_copy [R, B] i32
                                  .Ret<ffi::AnyBuffer>()         // g (aliased)
                                  .Attr<ffi::Span<const int32_t>>("mesh_devices")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns"),
                              {ffi::Traits::kCmdBufferCompatible});
