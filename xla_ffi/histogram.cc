// moonep_tokens_per_expert: decode buffers and launch the histogram kernel.
#include <cuda_runtime.h>

#include <string>

#include "kernels/histogram.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error TokensPerExpertExecute(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx,
                                  ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                                  ffi::ResultBuffer<ffi::S32> num_invalid, int32_t num_sms) {
  const int64_t num_experts = tokens_per_expert->element_count();
  if (num_experts <= 0 || num_experts > (int64_t{1} << 30))
    return ffi::Error::InvalidArgument("moonep_tokens_per_expert: tokens_per_expert must have 1.."
                                       "2^30 elements; got " + std::to_string(num_experts));
  if (num_invalid->element_count() != 1)
    return ffi::Error::InvalidArgument("moonep_tokens_per_expert: num_invalid must have 1 element");
  const moonep::HistogramParams params{
      .topk_idx = topk_idx.typed_data(),
      .tokens_per_expert = tokens_per_expert->typed_data(),
      .num_invalid = num_invalid->typed_data(),
      .num_entries = static_cast<int64_t>(topk_idx.element_count()),
      .num_experts = static_cast<int32_t>(num_experts),
      .num_sms = num_sms,
  };
  const cudaError_t err = moonep::launch_histogram(params, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("moonep_tokens_per_expert: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepTokensPerExpert, TokensPerExpertExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // topk_idx [S, K] int32
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tokens_per_expert [E] int32
                                  .Ret<ffi::Buffer<ffi::S32>>()  // num_invalid [1] int32
                                  .Attr<int32_t>("num_sms"),
                              {ffi::Traits::kCmdBufferCompatible});
