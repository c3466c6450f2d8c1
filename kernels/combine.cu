#include "kernels/combine.h"

#include <cuda_bf16.h>

#include "kernels/rendezvous.h"

namespace moonep {
namespace {

constexpr int kThreads = 512;
constexpr int kWarpsPerCta = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
// NOTE: rows and plan data that peers wrote or own are read with ld.global.cg (__ldcg: L2, never
// L1). XLA reuses buffer addresses across calls, and a stale L1 line of an earlier call must never
// be served.
constexpr int kMailboxStaging = mailbox_slot(kOpCombine, 0);
constexpr int kMailboxDst = mailbox_slot(kOpCombine, 1);
constexpr int kMailboxY = mailbox_slot(kOpCombine, 2);
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

// Vectors base + 32 u (u < kU) of a row of row_vecs vectors, those past its end left as they are.
template <typename T, typename Vec, int kU>
__device__ __forceinline__ void load_vectors(const Vec* in, int64_t base, int64_t row_vecs,
                                             Pack<T, Vec> (&v)[kU]) {
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (base + u * 32 < row_vecs) v[u].vec = __ldcg(in + base + u * 32);
}

// sum[u][e] += the vectors' values, in fp32.
template <typename T, typename Vec, int kU>
__device__ __forceinline__ void accumulate(float (&sum)[kU][Pack<T, Vec>::kElems],
                                           const Pack<T, Vec> (&v)[kU]) {
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int e = 0; e < Pack<T, Vec>::kElems; ++e) sum[u][e] += to_float(v[u].elems[e]);
}

// out's vectors base + 32 u (u < kU) within the row: the fp32 sums rounded to T.
template <typename T, typename Vec, int kU>
__device__ __forceinline__ void store_rounded(Vec* out, int64_t base, int64_t row_vecs,
                                              const float (&sum)[kU][Pack<T, Vec>::kElems]) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    if (base + u * 32 >= row_vecs) continue;
    Pack<T, Vec> o;
#pragma unroll
    for (int e = 0; e < Pack<T, Vec>::kElems; ++e) o.elems[e] = from_float<T>(sum[u][e]);
    out[base + u * 32] = o.vec;
  }
}

__device__ __forceinline__ int lanes_below(unsigned mask, int lane) {
  return __popc(mask & ((1u << lane) - 1u));
}

// A token's K entries, one per lane (lanes >= K: none), grouped by destination rank: lanes whose
// entries go to the same rank share a leader, the group's lowest k (__match_any_sync), which
// orders both rounding stages.
struct TokenEntries {
  Destination d;
  int leader;        // -1 for lanes without a valid entry
  unsigned leaders;  // lanes that lead a group
  unsigned staged;   // leaders of groups of two or more rows on a rank other than `home`,
                     // whose owners sum them: slot j of the token's staging holds the j-th
};

// `home`'s entry `dst` of this lane; only the home records bad plan data (`home` is this rank).
__device__ __forceinline__ TokenEntries token_entries(const GroupView& g, int32_t dst, int nvs,
                                                      int home) {
  const int lane = threadIdx.x % 32;
  TokenEntries e{decode_destination(g, kOpCombine, dst, nvs, home == g.rank), -1, 0, 0};
  // Lanes without an entry get a key no other lane has, so they lead only themselves.
  const unsigned group = __match_any_sync(kFullMask, e.d.dest >= 0 ? e.d.dest : -1 - lane);
  e.leader = e.d.dest >= 0 ? __ffs(group) - 1 : -1;
  e.leaders = __ballot_sync(kFullMask, e.leader == lane);
  e.staged = __ballot_sync(kFullMask, e.leader == lane && e.d.dest != home && __popc(group) > 1);
  return e;
}

// Byte offset in a home's staging of token t's partial from the rank of the group led by lane
// `leader`: slot j is the token's j-th staged group in leader order (owner and home alike).
__device__ __forceinline__ int64_t staging_offset(const CombineParams& p, int t,
                                                  const TokenEntries& e, int leader,
                                                  int64_t row_bytes) {
  return (static_cast<int64_t>(t) * p.staging_slots + lanes_below(e.staged, leader)) * row_bytes;
}

// Lane k's Plan.dst of token t's entry k (kDropped for lanes >= K).
__device__ __forceinline__ int32_t load_dst(const int32_t* dst, int64_t t, int top_k) {
  const int lane = threadIdx.x % 32;
  return lane < top_k ? __ldcg(dst + t * top_k + lane) : kDropped;
}

__device__ __forceinline__ const char* shfl_address(const char* p, int lane) {
  return reinterpret_cast<const char*>(
      __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(p), lane));
}

// Stage 1 of one (token, rank) group on the rank that holds its rows: lane i < count holds the
// i-th row in k order; out = cast(sum in that order of fp32 rows, from +0.0). Each lane covers
// kUnroll vectors 32 apart per step and loads kBatch rows of them before adding any, so that
// kBatch * kUnroll 16-byte loads per lane are in flight; the additions keep the row order.
constexpr int kPartialBatch = 2, kPartialUnroll = 4;

template <typename T, typename Vec>
__device__ __forceinline__ void sum_group(const char* row, int count, int64_t row_vecs, Vec* out) {
  using P = Pack<T, Vec>;
  const int lane = threadIdx.x % 32;
  // Every lane runs every step (the shuffles below need the whole warp), whatever the row size;
  // loads and stores past the row are masked.
  for (int64_t step = 0; step < row_vecs; step += 32 * kPartialUnroll) {
    const int64_t base = step + lane;
    float partial[kPartialUnroll][P::kElems] = {};
    for (int i0 = 0; i0 < count; i0 += kPartialBatch) {
      P v[kPartialBatch][kPartialUnroll];
#pragma unroll
      for (int j = 0; j < kPartialBatch; ++j) {
        const Vec* in = reinterpret_cast<const Vec*>(shfl_address(row, (i0 + j) % 32));
        if (i0 + j < count) load_vectors<T>(in, base, row_vecs, v[j]);
      }
#pragma unroll
      for (int j = 0; j < kPartialBatch; ++j) {
        if (i0 + j < count) accumulate<T>(partial, v[j]);  // warp-uniform
      }
    }
    store_rounded<T>(out, base, row_vecs, partial);
  }
}

// Stage 1 on the owner. One warp per (home rank h != this rank, token t of h): reads h's dst of t
// (K ints over NVLink, one token ahead so that the read overlaps the previous rows); if two or
// more of t's entries came to this rank, sums their rows (local) in k order, rounds, and stores
// that one row into h's staging slot of this rank's group. (A single row crosses the link either
// way: the home reads it in place, which saves the staging write and read.)
template <typename T, typename Vec>
__global__ void __launch_bounds__(kThreads) combine_partial_kernel(CombineParams p) {
  __shared__ char* staging_of[kMaxRanks];
  __shared__ const int32_t* dst_of[kMaxRanks];
  if (threadIdx.x < p.group.num_ranks) {
    staging_of[threadIdx.x] =
        static_cast<char*>(const_cast<void*>(peer_address(p.group, kMailboxStaging, threadIdx.x)));
    dst_of[threadIdx.x] =
        static_cast<const int32_t*>(peer_address(p.group, kMailboxDst, threadIdx.x));
  }
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int me = p.group.rank, R = p.group.num_ranks;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t num_pairs = static_cast<int64_t>(R - 1) * p.num_tokens;
  const int num_warps = gridDim.x * kWarpsPerCta;
  const auto home_of = [&](int64_t q) { return (me + 1 + static_cast<int>(q / p.num_tokens)) % R; };
  const auto dst_of_pair = [&](int64_t q) {
    return q < num_pairs ? load_dst(dst_of[home_of(q)], q % p.num_tokens, p.top_k) : kDropped;
  };
  int64_t q = blockIdx.x * kWarpsPerCta + threadIdx.x / 32;
  for (int32_t dst = dst_of_pair(q); q < num_pairs; q += num_warps) {
    const int home = home_of(q);
    const int t = static_cast<int>(q % p.num_tokens);
    const TokenEntries e = token_entries(p.group, dst, p.nvs, home);
    dst = dst_of_pair(q + num_warps);
    const unsigned members = __ballot_sync(kFullMask, e.d.dest == me);
    if (__popc(members) < 2) continue;  // warp-uniform
    // Lane i takes the i-th member's row (members in k order).
    int from = lane;
    for (unsigned m = members, i = 0; m; m &= m - 1, ++i)
      if (lane == static_cast<int>(i)) from = __ffs(m) - 1;
    const char* row = shfl_address(static_cast<const char*>(p.y) + e.d.row * row_bytes, from);
    Vec* out = reinterpret_cast<Vec*>(staging_of[home] +
                                      staging_offset(p, t, e, __ffs(members) - 1, row_bytes));
    sum_group<T, Vec>(row, __popc(members), row_vecs, out);
  }
  // NOTE: the middle barrier (a later kernel) publishes these remote stores only if every writing
  // thread fenced at system scope (transport.cuh, `barrier`).
  __threadfence_system();
}

// Vectors per lane loaded together from one row in stage 2: several 16-byte loads in flight.
constexpr int kUnroll = 4;

// Stage 2 on the home, after the middle barrier (without staging slots, the whole combine). One
// warp per token. The warp walks the row in chunks of 32 * kUnroll vectors: for each group, in
// leader order, it adds the group's stage-1 partial to the fp32 accumulator: the staged partial
// of a remote group of two or more rows when the owners sum, else the group's rows (its own, or
// an owner's read in place) summed in k order in fp32 and rounded to T.
// One CTA per SM (launched so): the register budget of a 512-thread CTA alone.
template <typename T, typename Vec>
__global__ void __launch_bounds__(kThreads, 1) combine_sum_kernel(CombineParams p) {
  using P = Pack<T, Vec>;
  __shared__ const char* y_of[kMaxRanks];
  if (threadIdx.x < p.group.num_ranks)
    y_of[threadIdx.x] = static_cast<const char*>(peer_address(p.group, kMailboxY, threadIdx.x));
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int me = p.group.rank;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int num_warps = gridDim.x * kWarpsPerCta;
  for (int t = blockIdx.x * kWarpsPerCta + threadIdx.x / 32; t < p.num_tokens; t += num_warps) {
    const TokenEntries e = token_entries(p.group, load_dst(p.dst, t, p.top_k), p.nvs, me);
    // Remote groups of two or more rows were summed by their owners, when the owners sum.
    const unsigned staged = p.staging_slots > 0 ? e.staged : 0u;
    Vec* out = reinterpret_cast<Vec*>(static_cast<char*>(p.out) + t * row_bytes);
    // Every lane runs every step, whatever the row size (the ballots and shuffles below need the
    // whole warp); loads and stores past the row are masked.
    for (int64_t step = 0; step < row_vecs; step += 32 * kUnroll) {
      const int64_t base = step + lane;
      float acc[kUnroll][P::kElems] = {};
      for (unsigned g = e.leaders; g; g &= g - 1) {
        const int group_leader = __ffs(g) - 1;
        const unsigned members = __ballot_sync(kFullMask, e.leader == group_leader);
        if ((staged >> group_leader) & 1u) {  // warp-uniform
          const char* partial_row = static_cast<const char*>(p.staging) +
                                    staging_offset(p, t, e, group_leader, row_bytes);
          const Vec* in = reinterpret_cast<const Vec*>(partial_row);
          P v[kUnroll];
          load_vectors<T>(in, base, row_vecs, v);
          accumulate<T>(acc, v);
          continue;
        }
        float partial[kUnroll][P::kElems] = {};
        for (unsigned m = members; m; m &= m - 1) {
          const int k = __ffs(m) - 1;
          const int dest = __shfl_sync(kFullMask, e.d.dest, k);
          const int row = __shfl_sync(kFullMask, e.d.row, k);
          const Vec* in = reinterpret_cast<const Vec*>(y_of[dest] + row * row_bytes);
          P v[kUnroll];
          load_vectors<T>(in, base, row_vecs, v);
          accumulate<T>(partial, v);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int x = 0; x < P::kElems; ++x) acc[u][x] += to_float(from_float<T>(partial[u][x]));
      }
      store_rounded<T>(out, base, row_vecs, acc);
    }
  }
}

template <typename T, typename Vec>
cudaError_t launch_data_kernels(const CombineParams& p, cudaStream_t stream) {
  if (p.staging_slots > 0) {  // the owners sum first (min(R - 1, K / 2) slots: never alone)
    combine_partial_kernel<T, Vec><<<p.num_sms, kThreads, 0, stream>>>(p);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    if (const cudaError_t err = launch_middle_rendezvous(p.group, kOpCombine, stream);
        err != cudaSuccess)
      return err;
  }
  combine_sum_kernel<T, Vec><<<p.num_sms, kThreads, 0, stream>>>(p);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return launch_exit_rendezvous(p.group, kOpCombine, stream);
}

// Rows are summed as vectors: the widest that divides the row size (rows are then aligned, XLA
// buffers being at least 16-byte aligned).
template <typename T>
cudaError_t launch_data_kernels(const CombineParams& p, cudaStream_t stream) {
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  if (row_bytes % 16 == 0) return launch_data_kernels<T, uint4>(p, stream);
  if (row_bytes % 4 == 0) return launch_data_kernels<T, uint32_t>(p, stream);
  return launch_data_kernels<T, T>(p, stream);
}

// One thread per entry: d topk_w[i] = the owner's recv_w[row] of entry i (duplicates read their
// own row); dropped or undecodable entries get 0.
__global__ void __launch_bounds__(kThreads) combine_weights_gather_kernel(CombineWeightsParams p) {
  __shared__ const float* recv_w_of[kMaxRanks];
  if (threadIdx.x < p.group.num_ranks)
    recv_w_of[threadIdx.x] =
        static_cast<const float*>(peer_address(p.group, kMailboxRecvW, threadIdx.x));
  __syncthreads();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.num_entries;
       i += gridDim.x * blockDim.x) {
    const Destination d = decode_destination(p.group, kOpCombineWeights, p.dst[i], p.nvs);
    p.topk_w[i] = d.dest >= 0 ? __ldcg(recv_w_of[d.dest] + d.row) : 0.0f;
  }
}

// Loaded on every device when a transport context is created (lazy loading while a peer spins
// in a barrier can deadlock): both kernels of each (T, Vec) that launch_combine launches.
template <typename T, typename Vec>
int preload_combine_kernels() {
  register_kernel_for_preload(as_symbol(&combine_partial_kernel<T, Vec>));
  return register_kernel_for_preload(as_symbol(&combine_sum_kernel<T, Vec>));
}

[[maybe_unused]] const int kPreloaded[] = {
    preload_combine_kernels<__nv_bfloat16, uint4>(),
    preload_combine_kernels<__nv_bfloat16, uint32_t>(),
    preload_combine_kernels<__nv_bfloat16, __nv_bfloat16>(),
    preload_combine_kernels<float, uint4>(),
    preload_combine_kernels<float, uint32_t>(),
    preload_combine_kernels<float, float>(),
    register_kernel_for_preload(as_symbol(&combine_weights_gather_kernel)),
};

}  // namespace

cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream) {
  const cudaError_t err =
      launch_entry_rendezvous(p.group, kOpCombine, p.staging, p.dst, p.y, stream);
  if (err != cudaSuccess) return err;
  return p.row_type == RowType::kBF16 ? launch_data_kernels<__nv_bfloat16>(p, stream)
                                      : launch_data_kernels<float>(p, stream);
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
