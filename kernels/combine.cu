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

__device__ __forceinline__ const char* shfl_address(const char* p, int lane) {
  return reinterpret_cast<const char*>(
      __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(p), lane));
}

// One row read of a token's sum. Stage-1 members are added to the fp32 partial; the last member
// of the group rounds the partial to T, adds it to the total and restarts the partial at +0.0; a
// staged partial (already in T, computed by its owner) is added to the total directly.
enum ReadKind : int { kMember, kLastMember, kStagedPartial };

// The rows one warp sums, in summation order: lane i holds read i. Built from every lane's own
// read (its position `order` in the sum, -1 for none).
struct Reads {
  const char* row;
  int kind;
  int count;
};

__device__ __forceinline__ Reads order_reads(int order, const char* row, int kind) {
  const int lane = threadIdx.x % 32;
  const int count = __popc(__ballot_sync(kFullMask, order >= 0));
  int from = lane;
  for (int i = 0; i < count; ++i) {
    const unsigned at_i = __ballot_sync(kFullMask, order == i);
    if (lane == i) from = __ffs(at_i) - 1;
  }
  return {shfl_address(row, from), __shfl_sync(kFullMask, kind, from), count};
}

// Load shapes (kBatch reads x kUnroll vectors): 8 loads per lane in flight, the most that fit 128
// registers per thread without spilling. Stage 1 alone (one fp32 sum per element) often has few
// reads, a token's rows on one rank, so it goes wide along the row; the home keeps two fp32 sums
// per element and has more reads.
constexpr int kPartialBatch = 2, kPartialUnroll = 4;
constexpr int kTotalBatch = 4, kTotalUnroll = 2;

// Sums the warp's reads over the whole row and stores the result to `out`: the stage-1 partial
// (kPartialOnly: the reads are one group's members) or the rounded total. Each lane covers
// kUnroll vectors 32 apart per step and loads kBatch reads of them before adding any, so that
// kBatch * kUnroll 16-byte loads per lane are in flight; the additions keep the read order.
template <typename T, typename Vec, int kBatch, int kUnroll, bool kPartialOnly>
__device__ __forceinline__ void sum_reads(const Reads& r, int64_t row_vecs, Vec* out) {
  using P = Pack<T, Vec>;
  const int lane = threadIdx.x % 32;
  for (int64_t base = lane; base < row_vecs; base += 32 * kUnroll) {
    float partial[kUnroll][P::kElems] = {};
    float total[kPartialOnly ? 1 : kUnroll][P::kElems] = {};
    for (int i0 = 0; i0 < r.count; i0 += kBatch) {
      P v[kBatch][kUnroll];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const Vec* in = reinterpret_cast<const Vec*>(shfl_address(r.row, (i0 + j) % 32));
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (i0 + j < r.count && base + u * 32 < row_vecs)
            v[j][u].vec = __ldcg(in + base + u * 32);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int kind = __shfl_sync(kFullMask, r.kind, (i0 + j) % 32);
        if (i0 + j >= r.count) continue;  // warp-uniform
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int e = 0; e < P::kElems; ++e) {
            const float x = to_float(v[j][u].elems[e]);
            if (kPartialOnly || kind != kStagedPartial) {
              partial[u][e] += x;
            }
            if (!kPartialOnly) {
              if (kind == kStagedPartial) total[u][e] += x;
              if (kind == kLastMember) {
                total[u][e] += to_float(from_float<T>(partial[u][e]));
                partial[u][e] = 0.0f;
              }
            }
          }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 32 >= row_vecs) continue;
      P o;
#pragma unroll
      for (int e = 0; e < P::kElems; ++e)
        o.elems[e] = from_float<T>(kPartialOnly ? partial[u][e] : total[kPartialOnly ? 0 : u][e]);
      out[base + u * 32] = o.vec;
    }
  }
}

// A token's K entries, one per lane (lanes >= K: none), grouped by destination rank: lanes that go
// to the same rank share a leader, the group's lowest k, which orders both stages.
struct TokenEntries {
  Destination d;
  unsigned group;    // lanes of this lane's group (only itself without a valid entry)
  int leader;        // -1 for lanes without a valid entry
};

// Lane k's Plan.dst of token t's entry k (kDropped for lanes >= K). Loaded one token ahead of
// its use, so that the dst read (over NVLink for a peer's token) overlaps the previous rows.
__device__ __forceinline__ int32_t load_dst(const int32_t* dst, int64_t t, int top_k) {
  const int lane = threadIdx.x % 32;
  return lane < top_k ? __ldcg(dst + t * top_k + lane) : kDropped;
}

__device__ __forceinline__ TokenEntries token_entries(const GroupView& g, int32_t dst, int nvs) {
  const int lane = threadIdx.x % 32;
  TokenEntries e{decode_destination(g, kOpCombine, dst, nvs), 0, -1};
  // Lanes without an entry get a key no other lane has, so they lead only themselves.
  e.group = __match_any_sync(kFullMask, e.d.dest >= 0 ? e.d.dest : -1 - lane);
  e.leader = e.d.dest >= 0 ? __ffs(e.group) - 1 : -1;
  return e;
}

// Leaders of groups whose rank is not `home`: their rank of the token has a staging slot, the
// group's position among them (used by groups of two or more rows).
__device__ __forceinline__ unsigned remote_leaders(const TokenEntries& e, int home) {
  return __ballot_sync(kFullMask, e.leader == static_cast<int>(threadIdx.x % 32) &&
                                      e.d.dest != home);
}

__device__ __forceinline__ int lanes_below(unsigned mask, int lane) {
  return __popc(mask & ((1u << lane) - 1u));
}

// Stage 1 on the owner. One warp per (home rank h != this rank, token t of h): reads h's dst of t
// (K ints over NVLink); if two or more of t's entries came to this rank, sums their rows (local)
// in k order, rounds, and stores that one row into h's staging slot of this rank's group. (A
// single row crosses the link either way: the home reads it in place, which saves the staging
// write and read.)
template <typename T, typename Vec>
__global__ void __launch_bounds__(kThreads) combine_partial_kernel(CombineParams p) {
  __shared__ char* staging_of[kMaxRanks];
  __shared__ const int32_t* dst_of[kMaxRanks];
  if (threadIdx.x < p.group.num_ranks) {
    staging_of[threadIdx.x] = static_cast<char*>(
        const_cast<void*>(peer_address(p.group, kMailboxStaging, threadIdx.x)));
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
    const TokenEntries e = token_entries(p.group, dst, p.nvs);
    dst = dst_of_pair(q + num_warps);
    const unsigned members = __ballot_sync(kFullMask, e.d.dest == me);
    if (__popc(members) < 2) continue;  // warp-uniform
    const int slot = lanes_below(remote_leaders(e, home), __ffs(members) - 1);
    const bool member = (members >> lane) & 1u;
    const Reads r = order_reads(member ? lanes_below(members, lane) : -1,
                                static_cast<const char*>(p.y) + e.d.row * row_bytes, kMember);
    Vec* out = reinterpret_cast<Vec*>(
        staging_of[home] + (static_cast<int64_t>(t) * p.staging_slots + slot) * row_bytes);
    sum_reads<T, Vec, kPartialBatch, kPartialUnroll, true>(r, row_vecs, out);
  }
  // NOTE: the middle barrier (a later kernel) publishes these remote stores only if every writing
  // thread fenced at system scope (transport.cuh, `barrier`).
  __threadfence_system();
}

// Stage 2 on the home, after the middle barrier. One warp per token, in leader order: each remote
// group's staged partial, or its single row read in place from its owner; the local group's rows
// summed in k order and rounded (stage 1 fused here: this rank holds them). The total is rounded
// into out.
template <typename T, typename Vec>
__global__ void __launch_bounds__(kThreads) combine_sum_kernel(CombineParams p) {
  __shared__ const char* y_of[kMaxRanks];
  if (threadIdx.x < p.group.num_ranks)
    y_of[threadIdx.x] = static_cast<const char*>(peer_address(p.group, kMailboxY, threadIdx.x));
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int me = p.group.rank;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int num_warps = gridDim.x * kWarpsPerCta;
  const auto dst_of_token = [&](int t) {
    return t < p.num_tokens ? load_dst(p.dst, t, p.top_k) : kDropped;
  };
  int t = blockIdx.x * kWarpsPerCta + threadIdx.x / 32;
  for (int32_t dst = dst_of_token(t); t < p.num_tokens; t += num_warps) {
    const TokenEntries e = token_entries(p.group, dst, p.nvs);
    dst = dst_of_token(t + num_warps);
    const unsigned remote = remote_leaders(e, me);
    const unsigned local = __ballot_sync(kFullMask, e.d.dest == me);
    // Reads in order: the remote groups led below the local group's leader, the local group's
    // members, then the remaining remote groups.
    const int local_leader = local ? __ffs(local) - 1 : 32;
    const int local_count = __popc(local);
    int order = -1, kind = kStagedPartial;
    const char* row = nullptr;
    if ((local >> lane) & 1u) {
      order = lanes_below(remote, local_leader) + lanes_below(local, lane);
      kind = lane == 31 - __clz(local) ? kLastMember : kMember;
      row = static_cast<const char*>(p.y) + e.d.row * row_bytes;
    } else if ((remote >> lane) & 1u) {
      const int slot = lanes_below(remote, lane);
      order = slot + (local_leader < lane ? local_count : 0);
      if (__popc(e.group) == 1) {
        kind = kLastMember;  // a group of one: its stage 1 is that row, rounded
        row = y_of[e.d.dest] + e.d.row * row_bytes;
      } else {
        row = static_cast<const char*>(p.staging) +
              (static_cast<int64_t>(t) * p.staging_slots + slot) * row_bytes;
      }
    }
    Vec* out = reinterpret_cast<Vec*>(static_cast<char*>(p.out) + t * row_bytes);
    sum_reads<T, Vec, kTotalBatch, kTotalUnroll, false>(order_reads(order, row, kind), row_vecs,
                                                        out);
  }
}

template <typename T, typename Vec>
cudaError_t launch_data_kernels(const CombineParams& p, cudaStream_t stream) {
  if (p.group.num_ranks > 1) {  // alone, a rank holds all its tokens' rows: no first phase
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
    recv_w_of[threadIdx.x] = static_cast<const float*>(
        peer_address(p.group, kMailboxRecvW, threadIdx.x));
  __syncthreads();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.num_entries;
       i += gridDim.x * blockDim.x) {
    const Destination d = decode_destination(p.group, kOpCombineWeights, p.dst[i], p.nvs);
    p.topk_w[i] = d.dest >= 0 ? __ldcg(recv_w_of[d.dest] + d.row) : 0.0f;
  }
}

// Loaded on every device when a transport context is created (lazy loading while a peer spins
// in a barrier can deadlock).
[[maybe_unused]] const int kPreloaded[] = {
    register_kernel_for_preload(as_symbol(&combine_partial_kernel<__nv_bfloat16, uint4>)),
    register_kernel_for_preload(as_symbol(&combine_sum_kernel<__nv_bfloat16, uint4>)),
    register_kernel_for_preload(as_symbol(&combine_partial_kernel<__nv_bfloat16, uint32_t>)),
    register_kernel_for_preload(as_symbol(&combine_sum_kernel<__nv_bfloat16, uint32_t>)),
    register_kernel_for_preload(as_symbol(&combine_partial_kernel<__nv_bfloat16, __nv_bfloat16>)),
    register_kernel_for_preload(as_symbol(&combine_sum_kernel<__nv_bfloat16, __nv_bfloat16>)),
    register_kernel_for_preload(as_symbol(&combine_partial_kernel<float, uint4>)),
    register_kernel_for_preload(as_symbol(&combine_sum_kernel<float, uint4>)),
    register_kernel_for_preload(as_symbol(&combine_partial_kernel<float, uint32_t>)),
    register_kernel_for_preload(as_symbol(&combine_sum_kernel<float, uint32_t>)),
    register_kernel_for_preload(as_symbol(&combine_partial_kernel<float, float>)),
    register_kernel_for_preload(as_symbol(&combine_sum_kernel<float, float>)),
    register_kernel_for_preload(as_symbol(&combine_weights_gather_kernel)),
};

}  // namespace

cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream) {
  const cudaError_t err = launch_entry_rendezvous(
      p.group, kOpCombine, PublishedAddresses{{p.staging, p.dst, p.y}}, stream);
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
