// XLA FFI handler `moonep_dispatch`: check buffers against each other, find this device's EP group,
// launch the zero-copy dispatch (kernels/dispatch.cu).
#include <cuda_runtime.h>

#include <string>

#include "kernels/constants.h"
#include "kernels/dispatch.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/shape_checks.h"
#include "xla_ffi/transport.h"

namespace ffi = xla::ffi;
using moonep::dims_str;
using moonep::kMaxTopK;
using moonep::shape_error;

namespace {

constexpr const char* kOp = "moonep_dispatch";

ffi::Error DispatchExecute(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x,
                           ffi::Buffer<ffi::F32> topk_w, ffi::Buffer<ffi::S32> dst,
                           ffi::Buffer<ffi::S32> recv_src, ffi::Buffer<ffi::S32> recv_primary,
                           ffi::Result<ffi::AnyBuffer> recv_x,
                           ffi::Result<ffi::Buffer<ffi::F32>> recv_w,
                           ffi::Span<const int32_t> mesh_devices, int32_t num_ranks,
                           int32_t num_sms, int64_t timeout_ns) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return shape_error(kOp, "x", "[S, H]", x_dims);
  const int64_t S = x_dims[0], H = x_dims[1];
  const auto w_dims = topk_w.dimensions();
  if (w_dims.size() != 2 || w_dims[0] != S || w_dims[1] < 1 || w_dims[1] > kMaxTopK)
    return shape_error(kOp, "topk_w",
                       "[S, K] with S = " + std::to_string(S) +
                           ", 1 <= K <= " + std::to_string(kMaxTopK),
                       w_dims);
  const int64_t K = w_dims[1];
  if (dst.element_count() != S * K)
    return shape_error(kOp, "dst", "[S * K] = [" + std::to_string(S * K) + "]", dst.dimensions());
  const int64_t nvs = recv_src.element_count();
  if (nvs < 1 || nvs * num_ranks >= (int64_t{1} << 31))
    return shape_error(kOp, "recv_src", "[NvS] with 1 <= R * NvS < 2^31", recv_src.dimensions());
  if (recv_primary.element_count() != nvs)
    return shape_error(kOp, "recv_primary", "[NvS] = [" + std::to_string(nvs) + "]",
                       recv_primary.dimensions());
  const auto rx_dims = recv_x->dimensions();
  if (rx_dims.size() != 2 || rx_dims[0] != nvs || rx_dims[1] != H ||
      recv_x->element_type() != x.element_type())
    return shape_error(kOp, "recv_x", "[NvS, H] = [" + std::to_string(nvs) + ", " +
                                     std::to_string(H) + "] of x's dtype", rx_dims);
  if (recv_w->element_count() != nvs)
    return shape_error(kOp, "recv_w", "[NvS] = [" + std::to_string(nvs) + "]", recv_w->dimensions());
  const int64_t row_bytes = x.size_bytes() / (S > 0 ? S : 1);
  if (S < 1 || row_bytes % 2 != 0)
    return ffi::Error::InvalidArgument(std::string(kOp) +
                                       ": `x` must have S >= 1 rows of a 2- or 4-byte dtype.");

  auto group = moonep::group_view(device_ordinal, mesh_devices, num_ranks, timeout_ns);
  if (group.has_error()) return group.error();
  const moonep::DispatchParams params{
      .group = *group,
      .x = x.untyped_data(),
      .topk_w = topk_w.typed_data(),
      .dst = dst.typed_data(),
      .recv_src = recv_src.typed_data(),
      .recv_primary = recv_primary.typed_data(),
      .recv_x = recv_x->untyped_data(),
      .recv_w = recv_w->typed_data(),
      .row_bytes = row_bytes,
      .num_tokens = static_cast<int32_t>(S),
      .top_k = static_cast<int32_t>(K),
      .nvs = static_cast<int32_t>(nvs),
      .num_sms = num_sms,
  };
  MOONEP_CUDA_RETURN_IF_ERROR(kOp, moonep::launch_dispatch(params, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepDispatch, DispatchExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()          // x [S, H] bf16 | f32
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_w [S, K] f32
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst [S * K] i32
                                  .Arg<ffi::Buffer<ffi::S32>>()   // recv_src [NvS] i32
                                  .Arg<ffi::Buffer<ffi::S32>>()   // recv_primary [NvS] i32
                                  .Ret<ffi::AnyBuffer>()          // recv_x [NvS, H] x.dtype
                                  .Ret<ffi::Buffer<ffi::F32>>()   // recv_w [NvS] f32
                                  .Attr<ffi::Span<const int32_t>>("mesh_devices")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns"),
                              {ffi::Traits::kCmdBufferCompatible});
