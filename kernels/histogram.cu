#include "kernels/histogram.h"

namespace moonep {
namespace {

constexpr int kThreads = 512;
// Experts counted in shared memory per CTA; larger E falls back to global atomics.
constexpr int kMaxSharedExperts = 12 * 1024;

__global__ void zero_counts_kernel(int32_t* counts, int32_t num_experts, int32_t* num_invalid) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < num_experts; e += gridDim.x * blockDim.x)
    counts[e] = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) *num_invalid = 0;
}

__device__ __forceinline__ bool is_valid_id(int32_t id, int32_t num_experts) {
  return static_cast<uint32_t>(id) < static_cast<uint32_t>(num_experts);
}

__global__ void __launch_bounds__(kThreads) histogram_kernel(HistogramParams p) {
  extern __shared__ int32_t shared_counts[];
  const bool use_shared = p.num_experts <= kMaxSharedExperts;
  if (use_shared) {
    for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) shared_counts[e] = 0;
    __syncthreads();
  }
  int32_t invalid = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.num_entries;
       i += stride) {
    const int32_t id = p.topk_idx[i];
    if (is_valid_id(id, p.num_experts)) {
      atomicAdd(use_shared ? &shared_counts[id] : &p.tokens_per_expert[id], 1);
    } else if (id != -1) {
      ++invalid;
    }
  }
  if (invalid) atomicAdd(p.num_invalid, invalid);
  if (use_shared) {
    __syncthreads();
    for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x)
      if (shared_counts[e]) atomicAdd(&p.tokens_per_expert[e], shared_counts[e]);
  }
}

}  // namespace

cudaError_t launch_histogram(const HistogramParams& p, cudaStream_t stream) {
  zero_counts_kernel<<<(p.num_experts + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      p.tokens_per_expert, p.num_experts, p.num_invalid);
  const int64_t needed = (p.num_entries + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(needed < p.num_sms ? (needed > 0 ? needed : 1) : p.num_sms);
  const size_t smem = p.num_experts <= kMaxSharedExperts ? p.num_experts * sizeof(int32_t) : 0;
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(
        histogram_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  histogram_kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moonep
