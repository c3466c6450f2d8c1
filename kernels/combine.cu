#include "kernels/combine.h"

#include <cuda_bf16.h>

#include "kernels/rendezvous.h"

namespace moonep {
namespace {

constexpr int kThreads = 512;
constexpr int kWarpsPerCta = kThreads / 32;
// Vectors per lane loaded together from one row: several 16-byte remote loads in flight.
constexpr int kUnroll = 4;
constexpr unsigned kFullMask = 0xffffffffu;
// NOTE: peers' buffers are read with ld.global.cg (__ldcg: L2, never L1). XLA reuses buffer
// addresses across calls, and a stale L1 line of an earlier call must never be served.
constexpr int kMailboxY = mailbox_slot(kOpCombine, 0);
constexpr int kMailboxRecvW = mailbox_slot(kOpCombineWeights, 0);

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);  // round to nearest even, as XLA's convert
}

// kElems values of type T moved as one aligned vector.
template <typename T, typename Vec>
union Pack {
  static constexpr int kElems = sizeof(Vec) / sizeof(T);
  Vec vec;
  T elems[kElems];
};

// One warp per token. Lane k decodes entry k; lanes whose entries go to the same rank form a group
// led by its lowest k (__match_any_sync), which fixes both rounding stages' order. The warp then
// walks the row in chunks of 32 * kUnroll vectors: for each group, in leader order, it sums the
// group's rows in k order in fp32, rounds the partial to T, and adds it to the fp32 accumulator.
template <typename T, typename Vec>
__global__ void __launch_bounds__(kThreads) combine_gather_kernel(CombineParams p) {
  using P = Pack<T, Vec>;
  __shared__ const char* y_of[kMaxRanks];
  if (threadIdx.x < p.group.num_ranks)
    y_of[threadIdx.x] = static_cast<const char*>(peer_address(p.group, kMailboxY, threadIdx.x));
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int num_warps = gridDim.x * kWarpsPerCta;
  for (int t = blockIdx.x * kWarpsPerCta + threadIdx.x / 32; t < p.num_tokens; t += num_warps) {
    Destination d{-1, 0, false};
    if (lane < p.top_k)
      d = decode_destination(p.group, kOpCombine,
                             p.dst[static_cast<int64_t>(t) * p.top_k + lane], p.nvs);
    // Lanes without an entry get a key no other lane has, so they lead only themselves.
    const unsigned same_dest = __match_any_sync(kFullMask, d.dest >= 0 ? d.dest : -1 - lane);
    const int leader = d.dest >= 0 ? __ffs(same_dest) - 1 : -1;
    const unsigned leaders = __ballot_sync(kFullMask, leader == lane);

    Vec* out = reinterpret_cast<Vec*>(static_cast<char*>(p.out) + t * row_bytes);
    // Every lane runs every step, whatever the row size (the ballots and shuffles below need the
    // whole warp); loads and stores past the row are masked.
    for (int64_t step = 0; step < row_vecs; step += 32 * kUnroll) {
      const int64_t base = step + lane;
      float acc[kUnroll][P::kElems] = {};
      for (unsigned g = leaders; g; g &= g - 1) {
        const int group_leader = __ffs(g) - 1;
        const unsigned members = __ballot_sync(kFullMask, leader == group_leader);
        float partial[kUnroll][P::kElems] = {};
        for (unsigned m = members; m; m &= m - 1) {
          const int k = __ffs(m) - 1;
          const int dest = __shfl_sync(kFullMask, d.dest, k);
          const int row = __shfl_sync(kFullMask, d.row, k);
          const Vec* in = reinterpret_cast<const Vec*>(y_of[dest] + row * row_bytes);
          P v[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            if (base + u * 32 < row_vecs) v[u].vec = __ldcg(in + base + u * 32);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
#pragma unroll
            for (int e = 0; e < P::kElems; ++e) partial[u][e] += to_float(v[u].elems[e]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int e = 0; e < P::kElems; ++e) acc[u][e] += to_float(from_float<T>(partial[u][e]));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * 32 >= row_vecs) continue;
        P o;
#pragma unroll
        for (int e = 0; e < P::kElems; ++e) o.elems[e] = from_float<T>(acc[u][e]);
        out[base + u * 32] = o.vec;
      }
    }
  }
}

template <typename T>
cudaError_t launch_gather(const CombineParams& p, cudaStream_t stream) {
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  if (row_bytes % 16 == 0) {
    combine_gather_kernel<T, uint4><<<p.num_sms, kThreads, 0, stream>>>(p);
  } else if (row_bytes % 4 == 0) {
    combine_gather_kernel<T, uint32_t><<<p.num_sms, kThreads, 0, stream>>>(p);
  } else {
    combine_gather_kernel<T, T><<<p.num_sms, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

// One thread per entry: d topk_w[i] = the owner's recv_w[row] of entry i (duplicates read their
// own row); dropped or undecodable entries get 0.
__global__ void __launch_bounds__(kThreads) combine_weights_gather_kernel(CombineWeightsParams p) {
  __shared__ const float* recv_w_of[kMaxRanks];
  if (threadIdx.x < p.group.num_ranks)
    recv_w_of[threadIdx.x] = static_cast<const float*>(
        peer_address(p.group, kMailboxRecvW, threadIdx.x));
  __syncthreads();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.num_entries;
       i += gridDim.x * blockDim.x) {
    const Destination d = decode_destination(p.group, kOpCombineWeights, p.dst[i], p.nvs);
    p.topk_w[i] = d.dest >= 0 ? __ldcg(recv_w_of[d.dest] + d.row) : 0.0f;
  }
}

[[maybe_unused]] const int kPreloaded[] = {
    register_kernel_for_preload(as_symbol(&combine_gather_kernel<__nv_bfloat16, uint4>)),
    register_kernel_for_preload(as_symbol(&combine_gather_kernel<__nv_bfloat16, uint32_t>)),
    register_kernel_for_preload(as_symbol(&combine_gather_kernel<__nv_bfloat16, __nv_bfloat16>)),
    register_kernel_for_preload(as_symbol(&combine_gather_kernel<float, uint4>)),
    register_kernel_for_preload(as_symbol(&combine_gather_kernel<float, uint32_t>)),
    register_kernel_for_preload(as_symbol(&combine_gather_kernel<float, float>)),
    register_kernel_for_preload(as_symbol(&combine_weights_gather_kernel)),
};

}  // namespace

cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream) {
  cudaError_t err = launch_entry_rendezvous(p.group, kOpCombine, p.y, nullptr, stream);
  if (err != cudaSuccess) return err;
  err = p.row_type == RowType::kBF16 ? launch_gather<__nv_bfloat16>(p, stream)
                                     : launch_gather<float>(p, stream);
  if (err != cudaSuccess) return err;
  return launch_exit_rendezvous(p.group, kOpCombine, stream);
}

cudaError_t launch_combine_weights(const CombineWeightsParams& p, cudaStream_t stream) {
  cudaError_t err = launch_entry_rendezvous(p.group, kOpCombineWeights, p.recv_w, nullptr, stream);
  if (err != cudaSuccess) return err;
  const int blocks_needed = (p.num_entries + kThreads - 1) / kThreads;
  combine_weights_gather_kernel<<<blocks_needed < p.num_sms ? blocks_needed : p.num_sms, kThreads,
                                  0, stream>>>(p);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  return launch_exit_rendezvous(p.group, kOpCombineWeights, stream);
}

}  // namespace moonep
