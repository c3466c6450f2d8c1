#include "kernels/prefetch.h"

#include "kernels/rendezvous.h"

namespace moonep {
namespace {

constexpr int kThreads = 512;
// Vectors per thread loaded before the first store: several 16-byte remote loads in flight.
constexpr int kUnroll = 4;
constexpr int kMailboxWLocal = mailbox_slot(kOpPrefetch, 0);

// The home rank's weights of slot b's expert, or nullptr for a slot that must be zero.
__device__ const char* slot_source(const PrefetchParams& p, int b) {
  const int32_t expert = p.experts_to_copy[p.group.rank * p.num_slots + b];
  if (expert == -1) return nullptr;
  if (expert < 0 || expert >= p.group.num_ranks * p.experts_per_rank) {
    report_bad_plan_data(p.group, kOpPrefetch, expert,
                         "plan.experts_to_copy names an expert outside [-1, E)");
    return nullptr;
  }
  const int home = expert / p.experts_per_rank;
  const char* w_home = static_cast<const char*>(peer_address(p.group, kMailboxWLocal, home));
  return w_home + (expert - home * p.experts_per_rank) * p.expert_bytes;
}

// Every CTA copies its share of every slot, so the slots' bytes spread evenly over the grid.
template <typename Vec>
__global__ void __launch_bounds__(kThreads) prefetch_copy_kernel(PrefetchParams p) {
  const int64_t slot_vecs = p.expert_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int b = 0; b < p.num_slots; ++b) {
    const Vec* in = reinterpret_cast<const Vec*>(slot_source(p, b));
    if (in == nullptr && !p.zero_unused_slots) continue;  // uniform over the grid: depends on b
    Vec* out = reinterpret_cast<Vec*>(static_cast<char*>(p.w_slots) + b * p.expert_bytes);
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
         base < slot_vecs; base += stride * kUnroll) {
      Vec v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        // __ldcg: L2 only, so that no stale L1 line of an earlier call is served (combine.cu).
        if (base + u * stride < slot_vecs) v[u] = in ? __ldcg(in + base + u * stride) : Vec{};
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (base + u * stride < slot_vecs) out[base + u * stride] = v[u];
    }
  }
}

template <typename Vec>
cudaError_t launch_copy(const PrefetchParams& p, cudaStream_t stream) {
  prefetch_copy_kernel<Vec><<<p.num_sms, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

[[maybe_unused]] const int kPreloaded[] = {
    register_kernel_for_preload(as_symbol(&prefetch_copy_kernel<uint4>)),
    register_kernel_for_preload(as_symbol(&prefetch_copy_kernel<uint32_t>)),
    register_kernel_for_preload(as_symbol(&prefetch_copy_kernel<uint16_t>)),
};

}  // namespace

cudaError_t launch_prefetch(const PrefetchParams& p, cudaStream_t stream) {
  cudaError_t err = launch_entry_rendezvous(p.group, kOpPrefetch, p.w_local, nullptr, stream);
  if (err != cudaSuccess) return err;
  // Experts are byte copies: the widest vector that divides an expert's size.
  if (p.expert_bytes % 16 == 0) {
    err = launch_copy<uint4>(p, stream);
  } else if (p.expert_bytes % 4 == 0) {
    err = launch_copy<uint32_t>(p, stream);
  } else {
    err = launch_copy<uint16_t>(p, stream);
  }
  if (err != cudaSuccess) return err;
  return launch_exit_rendezvous(p.group, kOpPrefetch, stream);
}

}  // namespace moonep
