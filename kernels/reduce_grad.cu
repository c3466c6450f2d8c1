#include "kernels/reduce_grad.h"

#include <cuda_bf16.h>

#include <type_traits>

#include "kernels/rendezvous.h"

namespace moonep {
namespace {

constexpr int kThreads = 512;
// Vectors per thread and work item: several 16-byte remote loads in flight per contribution.
constexpr int kUnroll = 4;
constexpr int kMailboxGSlots = mailbox_slot(kOpReduceGrad, 0);

// The contributions to this rank's experts, in the fixed order (source rank, slot) ascending, as
// a CSR table in shared memory: expert le's contributions are
// contribution[first[le] .. first[le + 1]), each the flat index r * B + b.
struct Contributions {
  int32_t* first;         // [epn + 1]
  int32_t* contribution;  // [R * B]
};

__device__ Contributions build_contributions(const ReduceGradParams& p, int32_t* shared) {
  Contributions c{shared, shared + p.experts_per_rank + 1};
  if (threadIdx.x == 0) {
    const int num_entries = p.group.num_ranks * p.num_slots;
    const int first_expert = p.group.rank * p.experts_per_rank;
    const int num_experts = p.group.num_ranks * p.experts_per_rank;
    for (int le = 0; le <= p.experts_per_rank; ++le) c.first[le] = 0;
    for (int i = 0; i < num_entries; ++i) {
      const int32_t e = p.experts_to_copy[i];
      if (e < -1 || e >= num_experts) {
        report_bad_plan_data(p.group, kOpReduceGrad, e,
                             "plan.experts_to_copy names an expert outside [-1, E)");
      } else if (e >= first_expert && e < first_expert + p.experts_per_rank) {
        ++c.first[e - first_expert + 1];
      }
    }
    for (int le = 0; le < p.experts_per_rank; ++le) c.first[le + 1] += c.first[le];
    // Second pass fills each expert's list in ascending (r, b); first[le] is used as a cursor and
    // ends one list later, so shifting the table by one restores the starts.
    for (int i = 0; i < num_entries; ++i) {
      const int32_t e = p.experts_to_copy[i];
      if (e >= first_expert && e < first_expert + p.experts_per_rank)
        c.contribution[c.first[e - first_expert]++] = i;
    }
    for (int le = p.experts_per_rank; le > 0; --le) c.first[le] = c.first[le - 1];
    c.first[0] = 0;
  }
  __syncthreads();
  return c;
}

// One vector of fp32 sums stored in the result's dtype: as is, or rounded to bf16 (4 bf16 =
// one 8-byte store for float4).
template <typename Vec, typename Out>
__device__ void store_sum(void* g, int64_t index, const Vec& sum) {
  if constexpr (std::is_same_v<Out, float>) {
    static_cast<Vec*>(g)[index] = sum;
  } else {
    constexpr int kElems = sizeof(Vec) / sizeof(float);
    const float* x = reinterpret_cast<const float*>(&sum);
    struct alignas(kElems * sizeof(__nv_bfloat16)) Rounded {
      __nv_bfloat16 v[kElems];
    } r;
#pragma unroll
    for (int e = 0; e < kElems; ++e) r.v[e] = __float2bfloat16_rn(x[e]);
    static_cast<Rounded*>(g)[index] = r;
  }
}

// Work item = (local expert, chunk of kThreads * kUnroll vectors). Each thread keeps kUnroll fp32
// accumulators, starting from g_partial, and adds the contributions in the fixed order, loading
// the kUnroll vectors of one contribution together.
template <typename Vec, typename Out>
__global__ void __launch_bounds__(kThreads) reduce_grad_kernel(ReduceGradParams p) {
  constexpr int kElems = sizeof(Vec) / sizeof(float);
  extern __shared__ int32_t shared[];
  __shared__ const float* g_slots_of[kMaxRanks];
  if (threadIdx.x < p.group.num_ranks)
    g_slots_of[threadIdx.x] =
        static_cast<const float*>(peer_address(p.group, kMailboxGSlots, threadIdx.x));
  const Contributions c = build_contributions(p, shared);  // ends with __syncthreads

  const int64_t expert_vecs = p.expert_elems / kElems;
  const int64_t chunk_vecs = int64_t{kThreads} * kUnroll;
  const int64_t chunks_per_expert = (expert_vecs + chunk_vecs - 1) / chunk_vecs;
  const int64_t num_items = chunks_per_expert * p.experts_per_rank;
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    const int le = static_cast<int>(item / chunks_per_expert);
    // g already holds the gradient of an expert no replica contributes to (the caller aliases
    // it): skipping it saves a read and a write.
    if (c.first[le] == c.first[le + 1]) continue;
    const int64_t offset = le * p.expert_elems;  // of expert le, in elements
    const int64_t base = (item % chunks_per_expert) * chunk_vecs + threadIdx.x;
    Vec acc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * kThreads < expert_vecs)
        acc[u] = reinterpret_cast<const Vec*>(p.g_partial + offset)[base + u * kThreads];
    for (int j = c.first[le]; j < c.first[le + 1]; ++j) {
      const int r = c.contribution[j] / p.num_slots;
      const int b = c.contribution[j] - r * p.num_slots;
      const Vec* in = reinterpret_cast<const Vec*>(g_slots_of[r] + b * p.expert_elems);
      Vec v[kUnroll];  // __ldcg: L2 only, no stale L1 line of an earlier call (combine.cu)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (base + u * kThreads < expert_vecs) v[u] = __ldcg(in + base + u * kThreads);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float* a = reinterpret_cast<float*>(&acc[u]);
        const float* x = reinterpret_cast<const float*>(&v[u]);
#pragma unroll
        for (int e = 0; e < kElems; ++e) a[e] += x[e];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * kThreads < expert_vecs)
        store_sum<Vec, Out>(p.g, offset / kElems + base + u * kThreads, acc[u]);
  }
}

template <typename Vec, typename Out>
cudaError_t launch_reduce(const ReduceGradParams& p, cudaStream_t stream) {
  const size_t shared_bytes =
      sizeof(int32_t) * (p.experts_per_rank + 1 + p.group.num_ranks * p.num_slots);
  if (shared_bytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(reduce_grad_kernel<Vec, Out>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(shared_bytes));
    if (err != cudaSuccess) return err;
  }
  reduce_grad_kernel<Vec, Out><<<p.num_sms, kThreads, shared_bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename Out>
cudaError_t launch_reduce_into(const ReduceGradParams& p, cudaStream_t stream) {
  return p.expert_elems % 4 == 0 ? launch_reduce<float4, Out>(p, stream)
                                 : launch_reduce<float, Out>(p, stream);
}

[[maybe_unused]] const int kPreloaded[] = {
    register_kernel_for_preload(as_symbol(&reduce_grad_kernel<float4, float>)),
    register_kernel_for_preload(as_symbol(&reduce_grad_kernel<float, float>)),
    register_kernel_for_preload(as_symbol(&reduce_grad_kernel<float4, __nv_bfloat16>)),
    register_kernel_for_preload(as_symbol(&reduce_grad_kernel<float, __nv_bfloat16>)),
};

}  // namespace

cudaError_t launch_reduce_grad(const ReduceGradParams& p, cudaStream_t stream) {
  cudaError_t err = launch_entry_rendezvous(p.group, kOpReduceGrad, p.g_slots, nullptr, stream);
  if (err != cudaSuccess) return err;
  err = p.g_is_bf16 ? launch_reduce_into<__nv_bfloat16>(p, stream)
                    : launch_reduce_into<float>(p, stream);
  if (err != cudaSuccess) return err;
  return launch_exit_rendezvous(p.group, kOpReduceGrad, stream);
}

}  // namespace moonep
