#include "kernels/dispatch.h"
#include "kernels/rendezvous.h"

namespace moonep {
namespace {

constexpr int kThreads = 512;
constexpr int kWarpsPerCta = kThreads / 32;
// Vectors each lane loads before it starts storing: several 16-byte loads in flight per lane.
constexpr int kUnroll = 4;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMailboxRecvX = mailbox_slot(kOpDispatch, 0);
constexpr int kMailboxRecvW = mailbox_slot(kOpDispatch, 1);

// ---- data kernels ------------------------------------------------------------------------------

// One warp per token: lane k decodes entry k and writes its weight; then the warp loads the row
// once, kUnroll vectors per lane at a time, and stores it to every destination of a primary entry.
template <typename Vec>
__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(DispatchParams p) {
  __shared__ char* recv_x_of[kMaxRanks];
  __shared__ float* recv_w_of[kMaxRanks];
  if (threadIdx.x < p.group.num_ranks) {
    recv_x_of[threadIdx.x] =
        static_cast<char*>(const_cast<void*>(peer_address(p.group, kMailboxRecvX, threadIdx.x)));
    recv_w_of[threadIdx.x] =
        static_cast<float*>(const_cast<void*>(peer_address(p.group, kMailboxRecvW, threadIdx.x)));
  }
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int64_t row_vecs = p.row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int num_warps = gridDim.x * kWarpsPerCta;
  for (int t = blockIdx.x * kWarpsPerCta + threadIdx.x / 32; t < p.num_tokens; t += num_warps) {
    Destination d{-1, 0, false};
    if (lane < p.top_k) {
      const int64_t entry = static_cast<int64_t>(t) * p.top_k + lane;
      d = decode_destination(p.group, kOpDispatch, p.dst[entry], p.nvs);
      if (d.dest >= 0) recv_w_of[d.dest][d.row] = p.topk_w[entry];
    }
    const unsigned send_mask = __ballot_sync(kFullMask, d.primary);
    const Vec* src = reinterpret_cast<const Vec*>(static_cast<const char*>(p.x) + t * p.row_bytes);
    for (int64_t base = lane; send_mask != 0 && base < row_vecs; base += 32 * kUnroll) {
      Vec v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (base + u * 32 < row_vecs) v[u] = __ldg(src + base + u * 32);
      for (unsigned m = send_mask; m; m &= m - 1) {
        const int k = __ffs(m) - 1;
        const int dest = __shfl_sync(kFullMask, d.dest, k);
        const int row = __shfl_sync(kFullMask, d.row, k);
        Vec* out = reinterpret_cast<Vec*>(recv_x_of[dest] + row * p.row_bytes);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (base + u * 32 < row_vecs) out[base + u * 32] = v[u];
      }
    }
  }
  // NOTE: the exit barrier (a later kernel) publishes these remote stores only if every writing
  // thread fenced at system scope (transport.cuh, `barrier`).
  __threadfence_system();
}

__device__ __forceinline__ bool is_row(int32_t row, int32_t nvs) {
  return static_cast<uint32_t>(row) < static_cast<uint32_t>(nvs);
}

// Receiver side, after the exit barrier: a duplicate row gets a copy of its primary row (the token
// crossed the link once); a row no entry owns is zeroed in recv_x and recv_w. A warp reads the
// plan of 32 rows at once, then copies or zeroes those that need it, one row at a time.
template <typename Vec>
__global__ void __launch_bounds__(kThreads) dispatch_fill_kernel(DispatchParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row_vecs = p.row_bytes / static_cast<int64_t>(sizeof(Vec));
  char* recv_x = static_cast<char*>(p.recv_x);
  const int num_warps = gridDim.x * kWarpsPerCta;
  for (int row0 = (blockIdx.x * kWarpsPerCta + threadIdx.x / 32) * 32; row0 < p.nvs;
       row0 += num_warps * 32) {
    const int row = row0 + lane;
    int32_t copy_from = row;  // == row: nothing to do; -1: zero the row; else: copy that row
    if (row < p.nvs) {
      if (p.recv_src[row] < 0) {
        copy_from = -1;
        p.recv_w[row] = 0.0f;
      } else {
        const int32_t primary = p.recv_primary[row];
        if (primary != row) {
          const bool valid = is_row(primary, p.nvs) && p.recv_primary[primary] == primary;
          if (!valid) {
            report_bad_plan_data(p.group, kOpDispatch, primary,
                                 "plan.recv_primary is not a primary row");
          }
          copy_from = valid ? primary : -1;
        }
      }
    }
    // Primary rows were written by peers over NVLink: read them from L2 (__ldcg), never L1.
    for (unsigned m = __ballot_sync(kFullMask, copy_from != row); m; m &= m - 1) {
      const int i = __ffs(m) - 1;
      const int32_t from = __shfl_sync(kFullMask, copy_from, i);
      Vec* out = reinterpret_cast<Vec*>(recv_x + (row0 + i) * p.row_bytes);
      const Vec* in = reinterpret_cast<const Vec*>(recv_x + from * p.row_bytes);
      for (int64_t base = lane; base < row_vecs; base += 32 * kUnroll) {
        Vec v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (base + u * 32 < row_vecs) v[u] = from < 0 ? Vec{} : __ldcg(in + base + u * 32);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (base + u * 32 < row_vecs) out[base + u * 32] = v[u];
      }
    }
  }
}

template <typename Vec>
cudaError_t launch_data_kernels(const DispatchParams& p, cudaStream_t stream) {
  dispatch_send_kernel<Vec><<<p.num_sms, kThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if ((err = launch_exit_rendezvous(p.group, kOpDispatch, stream)) != cudaSuccess) return err;
  dispatch_fill_kernel<Vec><<<p.num_sms, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// Loaded on every device when a transport context is created (lazy loading while a peer spins
// in a barrier can deadlock).
[[maybe_unused]] const int kPreloaded[] = {
    register_kernel_for_preload(as_symbol(&dispatch_send_kernel<uint4>)),
    register_kernel_for_preload(as_symbol(&dispatch_send_kernel<uint32_t>)),
    register_kernel_for_preload(as_symbol(&dispatch_send_kernel<uint16_t>)),
    register_kernel_for_preload(as_symbol(&dispatch_fill_kernel<uint4>)),
    register_kernel_for_preload(as_symbol(&dispatch_fill_kernel<uint32_t>)),
    register_kernel_for_preload(as_symbol(&dispatch_fill_kernel<uint16_t>)),
};

}  // namespace

cudaError_t launch_dispatch(const DispatchParams& p, cudaStream_t stream) {
  const cudaError_t err = launch_entry_rendezvous(p.group, kOpDispatch, p.recv_x, p.recv_w, stream);
  if (err != cudaSuccess) return err;
  // Rows are byte copies: the widest vector that divides the row size (rows are then aligned,
  // XLA buffers being at least 16-byte aligned).
  if (p.row_bytes % 16 == 0) return launch_data_kernels<uint4>(p, stream);
  if (p.row_bytes % 4 == 0) return launch_data_kernels<uint32_t>(p, stream);
  return launch_data_kernels<uint16_t>(p, stream);
}

}  // namespace moonep
