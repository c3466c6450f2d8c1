// XLA FFI handler `moonep_plan`: decodes the operand, results and sizes, finds this device's EP
// group and rank in the transport registry, and launches the CUDA planner (kernels/plan.h).
// Graph-safe: after the group's context exists the host part is a lookup, a kernel attribute and two launches.
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "kernels/constants.h"
#include "kernels/plan.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/shape_checks.h"
#include "xla_ffi/transport.h"

namespace moonep {
namespace {

ffi::Error check_shape(const char* name, ffi::Span<const int64_t> dims,
                       std::initializer_list<int64_t> expected) {
  if (has_shape(dims, expected)) return ffi::Error::Success();
  return shape_error("moonep_plan", name, dims_str(expected), dims);
}

ffi::Error check_sizes(int64_t E, int64_t K, int64_t S, int64_t R, int64_t B, int64_t tp,
                       int64_t nvs) {
  auto bad = [](const std::string& rule, const std::string& got) {
    return ffi::Error::InvalidArgument("moonep_plan: " + rule + "; got " + got + ".");
  };
  if (R < 1 || R > kMaxRanks) {
    return bad("the CUDA planner needs 1 <= R <= " + std::to_string(kMaxRanks), "R=" + std::to_string(R));
  }
  if (E < 1 || E > kMaxExperts || E % R != 0) {
    return bad("the CUDA planner needs 1 <= E <= " + std::to_string(kMaxExperts) + " and E % R == 0",
               "E=" + std::to_string(E) + ", R=" + std::to_string(R));
  }
  if (K < 1 || K > kMaxTopK || S < 1) {
    return bad("K must be in [1, " + std::to_string(kMaxTopK) + "] and S >= 1",
               "K=" + std::to_string(K) + ", S=" + std::to_string(S));
  }
  if (B < 1 || B > E / R || tp < 1) {
    return bad("B must be in [1, E/R] and tp >= 1", "B=" + std::to_string(B) + ", tp=" + std::to_string(tp));
  }
  if (nvs < S * K || R * nvs >= (int64_t{1} << 31)) {
    return bad("NvS must be >= S*K with R*NvS < 2**31", "NvS=" + std::to_string(nvs));
  }
  return ffi::Error::Success();
}

ffi::Error PlanExecute(cudaStream_t stream, int32_t device_ordinal,
                       ffi::Buffer<ffi::S32> topk_idx, ffi::ResultBuffer<ffi::S32> dst,
                       ffi::ResultBuffer<ffi::S32> cu_seqlens, ffi::ResultBuffer<ffi::S32> zero_fill,
                       ffi::ResultBuffer<ffi::S32> experts_to_copy,
                       ffi::ResultBuffer<ffi::S32> recv_src, ffi::ResultBuffer<ffi::S32> recv_primary,
                       ffi::ResultBuffer<ffi::S32> num_invalid_ids,
                       int64_t E, int64_t K, int64_t S, int64_t R, int64_t B, int64_t tp, int64_t nvs,
                       ffi::Span<const int32_t> mesh_devices, int64_t timeout_ns) {
  if (auto err = check_sizes(E, K, S, R, B, tp, nvs); err.failure()) return err;
  const int64_t N = S * K, G = E + B;
  for (auto err : {check_shape("topk_idx", topk_idx.dimensions(), {S, K}),
                   check_shape("dst", dst->dimensions(), {N}),
                   check_shape("cu_seqlens", cu_seqlens->dimensions(), {G}),
                   check_shape("zero_fill", zero_fill->dimensions(), {G, 2}),
                   check_shape("experts_to_copy", experts_to_copy->dimensions(), {R, B}),
                   check_shape("recv_src", recv_src->dimensions(), {nvs}),
                   check_shape("recv_primary", recv_primary->dimensions(), {nvs}),
                   check_shape("num_invalid_ids", num_invalid_ids->dimensions(), {1})}) {
    if (err.failure()) return err;
  }
  auto view = group_view(device_ordinal, mesh_devices, static_cast<int32_t>(R), timeout_ns);
  if (view.has_error()) return view.error();

  PlanParams params{};
  params.num_experts = static_cast<int>(E);
  params.top_k = static_cast<int>(K);
  params.num_tokens = static_cast<int>(S);
  params.num_slots = static_cast<int>(B);
  params.token_padding = static_cast<int>(tp);
  params.nvs = static_cast<int>(nvs);
  params.group = *view;
  params.topk_idx = topk_idx.typed_data();
  params.dst = dst->typed_data();
  params.cu_seqlens = cu_seqlens->typed_data();
  params.zero_fill = zero_fill->typed_data();
  params.experts_to_copy = experts_to_copy->typed_data();
  params.recv_src = recv_src->typed_data();
  params.recv_primary = recv_primary->typed_data();
  params.num_invalid_ids = num_invalid_ids->typed_data();
  MOONEP_CUDA_RETURN_IF_ERROR("moonep_plan", launch_plan(params, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moonep

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepPlan, moonep::PlanExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // topk_idx [S, K]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // dst [N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // cu_seqlens [G]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // zero_fill [G, 2]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // experts_to_copy [R, B]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // recv_src [NvS]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // recv_primary [NvS]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // num_invalid_ids [1]
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("top_k")
                                  .Attr<int64_t>("tokens_per_rank")
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_slots")
                                  .Attr<int64_t>("token_padding")
                                  .Attr<int64_t>("nvs")
                                  .Attr<xla::ffi::Span<const int32_t>>("mesh_devices")
                                  .Attr<int64_t>("timeout_ns"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
