// XLA FFI handlers `moonep_combine` and `moonep_combine_weights`: check buffers against each other,
// find this device's EP group, launch the kernels (kernels/combine.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/combine.h"
#include "kernels/constants.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/shape_checks.h"
#include "xla_ffi/transport.h"

namespace ffi = xla::ffi;
using moonep::kMaxTopK;
using moonep::shape_error;

namespace {

ffi::Error CombineExecute(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer y,
                          ffi::Buffer<ffi::S32> dst, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> staging,
                          ffi::Span<const int32_t> mesh_devices, int32_t num_ranks,
                          int32_t top_k, int32_t num_sms, int64_t timeout_ns) {
  constexpr const char* kOp = "moonep_combine";
  const auto y_dims = y.dimensions();
  if (y_dims.size() != 2 || y_dims[0] < 1 || y_dims[0] * num_ranks >= (int64_t{1} << 31))
    return shape_error(kOp, "y", "[NvS, H] with 1 <= R * NvS < 2^31", y_dims);
  const int64_t nvs = y_dims[0], H = y_dims[1];
  moonep::RowType row_type;
  if (y.element_type() == ffi::DataType::BF16) {
    row_type = moonep::RowType::kBF16;
  } else if (y.element_type() == ffi::DataType::F32) {
    row_type = moonep::RowType::kF32;
  } else {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": `y` must be bfloat16 or float32.");
  }
  if (top_k < 1 || top_k > kMaxTopK || dst.element_count() % top_k != 0)
    return shape_error(kOp, "dst",
                       "[S * K] with 1 <= K = " + std::to_string(top_k) +
                           " <= " + std::to_string(kMaxTopK),
                       dst.dimensions());
  const int64_t S = dst.element_count() / top_k;
  const auto out_dims = out->dimensions();
  if (out_dims.size() != 2 || out_dims[0] != S || out_dims[1] != H ||
      out->element_type() != y.element_type())
    return shape_error(kOp, "out", "[S, H] = [" + std::to_string(S) + ", " + std::to_string(H) +
                                       "] of y's dtype", out_dims);
  // At most min(R - 1, K / 2) ranks other than a token's home hold two or more of its rows: one
  // slot each when the owners sum (stage 1); no slot when the home reads every row in place.
  // Exactly so: an owner indexes its peers' staging with its own slot count.
  const int64_t slots = std::min<int64_t>(num_ranks - 1, top_k / 2);
  const auto staging_dims = staging->dimensions();
  if (staging_dims.size() != 3 || staging_dims[0] != S ||
      (staging_dims[1] != 0 && staging_dims[1] != slots) || staging_dims[2] != H ||
      staging->element_type() != y.element_type())
    return shape_error(kOp, "staging",
                       "[S, 0 or min(R - 1, K / 2), H] = [" + std::to_string(S) + ", 0 or " +
                           std::to_string(slots) + ", " + std::to_string(H) + "] of y's dtype",
                       staging_dims);

  auto group = moonep::group_view(device_ordinal, mesh_devices, num_ranks, timeout_ns);
  if (group.has_error()) return group.error();
  const moonep::CombineParams params{
      .group = *group,
      .y = y.untyped_data(),
      .dst = dst.typed_data(),
      .out = out->untyped_data(),
      .staging = staging->untyped_data(),
      .staging_slots = static_cast<int32_t>(staging_dims[1]),
      .row_type = row_type,
      .hidden = static_cast<int32_t>(H),
      .num_tokens = static_cast<int32_t>(S),
      .top_k = top_k,
      .nvs = static_cast<int32_t>(nvs),
      .num_sms = num_sms,
  };
  MOONEP_CUDA_RETURN_IF_ERROR(kOp, moonep::launch_combine(params, stream));
  return ffi::Error::Success();
}

ffi::Error CombineWeightsExecute(cudaStream_t stream, int32_t device_ordinal,
                                 ffi::Buffer<ffi::F32> recv_w, ffi::Buffer<ffi::S32> dst,
                                 ffi::Result<ffi::Buffer<ffi::F32>> topk_w,
                                 ffi::Span<const int32_t> mesh_devices, int32_t num_ranks,
                                 int32_t num_sms, int64_t timeout_ns) {
  constexpr const char* kOp = "moonep_combine_weights";
  const int64_t nvs = recv_w.element_count();
  if (nvs < 1 || nvs * num_ranks >= (int64_t{1} << 31))
    return shape_error(kOp, "recv_w", "[NvS] with 1 <= R * NvS < 2^31", recv_w.dimensions());
  const int64_t num_entries = dst.element_count();
  if (num_entries < 1 || num_entries >= (int64_t{1} << 31))
    return shape_error(kOp, "dst", "[S * K] with 1 <= S * K < 2^31", dst.dimensions());
  if (topk_w->element_count() != num_entries)
    return shape_error(kOp, "topk_w", "[S, K] with S * K = " + std::to_string(num_entries),
                       topk_w->dimensions());

  auto group = moonep::group_view(device_ordinal, mesh_devices, num_ranks, timeout_ns);
  if (group.has_error()) return group.error();
  const moonep::CombineWeightsParams params{
      .group = *group,
      .recv_w = recv_w.typed_data(),
      .dst = dst.typed_data(),
      .topk_w = topk_w->typed_data(),
      .num_entries = static_cast<int32_t>(num_entries),
      .nvs = static_cast<int32_t>(nvs),
      .num_sms = num_sms,
  };
  MOONEP_CUDA_RETURN_IF_ERROR(kOp, moonep::launch_combine_weights(params, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepCombine, CombineExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // y [NvS, H] bf16 | f32
                                  .Arg<ffi::Buffer<ffi::S32>>()  // dst [S * K] i32
                                  .Ret<ffi::AnyBuffer>()         // out [S, H] y.dtype
                                  .Ret<ffi::AnyBuffer>()         // staging [S, slots, H] y.dtype
                                  .Attr<ffi::Span<const int32_t>>("mesh_devices")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("top_k")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepCombineWeights, CombineWeightsExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // recv_w [NvS] f32
                                  .Arg<ffi::Buffer<ffi::S32>>()  // dst [S * K] i32
                                  .Ret<ffi::Buffer<ffi::F32>>()  // topk_w [S, K] f32
                                  .Attr<ffi::Span<const int32_t>>("mesh_devices")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns"),
                              {ffi::Traits::kCmdBufferCompatible});
