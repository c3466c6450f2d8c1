// The CUDA planner (see plan.h). Four kernels on XLA's stream, per rank:
//
//   plan_count_kernel    (C CTAs)  per-chunk expert histograms and invalid-id counts of the local
//                                  entries; marks the receive rows of this rank's recv_src /
//                                  recv_primary as -1.
//   plan_balance_kernel  (1 CTA)   local counts -> every peer's counts region, recv addresses ->
//                                  every peer's mailbox, barrier; then, replicated on every rank,
//                                  B1-B3 and the generation-1 layout of all R destinations.
//   plan_route_kernel    (C CTAs)  stable rank of each entry within its expert, destination row,
//                                  duplicate marking; dst locally, recv_src / recv_primary rows
//                                  straight into the destination's XLA result buffers.
//   plan_exit_kernel     (1 CTA)   exit barrier: no peer still writes when the call returns.
//
// Every tie rule follows moonep_algorithm.md §3 and moonep_jax/plan.py::_plan_xla exactly.
#include <climits>

#include "kernels/constants.h"
#include "kernels/plan.h"

namespace moonep {
namespace {

constexpr int kCountThreads = 256;
constexpr int kBalanceThreads = 1024;
constexpr int kRouteThreads = 256;
constexpr int kRouteWindow = 2048;  // entries ranked per round of the routing kernel
constexpr int kChunkLoadBatch = 16;  // independent loads in flight per thread in phase A
constexpr int kLayoutPerLane = 8;    // consecutive groups per lane in the layout scan
constexpr int kMaxCandidates = kMaxExperts + kMaxRanks * kMaxRanks;  // see plan_balance_kernel
constexpr unsigned kFullMask = 0xffffffffu;

constexpr int kMailboxRecvSrc = mailbox_slot(kOpPlan, 0);
constexpr int kMailboxRecvPrimary = mailbox_slot(kOpPlan, 1);
constexpr int kBarrierExchange = barrier_slot(kOpPlan, 0);
constexpr int kBarrierExit = barrier_slot(kOpPlan, 1);

// Planner scratch in this rank's PeerArea (ints). Strides use the static maxima.
constexpr int kChunkCountsOff = 0;                                          // [chunks][E]
constexpr int kChunkInvalidOff = kChunkCountsOff + kPlanChunkCountInts;      // [chunks]
constexpr int kRankBaseOff = kChunkInvalidOff + kMaxPlanChunks;              // [E]
constexpr int kAllocOff = kRankBaseOff + kMaxExperts;                        // [E][R]
constexpr int kAllocCumOff = kAllocOff + kMaxExperts * kMaxRanks;            // [E][R]
constexpr int kExpertOffOff = kAllocCumOff + kMaxExperts * kMaxRanks;        // [R][E]
constexpr int kScratchEnd = kExpertOffOff + kMaxRanks * kMaxExperts;
static_assert(kScratchEnd <= kPlanScratchInts, "planner scratch must fit PeerArea::plan_scratch");

struct Scratch {
  int32_t* chunk_counts;  // per-chunk histogram; after balancing, the chunk's exclusive base
  int32_t* chunk_invalid; // per chunk: entries with ids outside [-1, E)
  int32_t* rank_base;     // [E] entries of expert e on ranks < this rank
  int32_t* alloc;         // [E][R] entries of expert e computed on rank d
  int32_t* alloc_cum;     // [E][R] inclusive prefix of alloc over d
  int32_t* expert_off;    // [R][E] first row of expert e's group on rank d (stale if empty)
};

__device__ __forceinline__ Scratch scratch_of(const GroupView& g) {
  int32_t* s = own_area(g)->plan_scratch;
  return Scratch{s + kChunkCountsOff, s + kChunkInvalidOff, s + kRankBaseOff,
                 s + kAllocOff,       s + kAllocCumOff, s + kExpertOffOff};
}

__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x & 31;
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// Lane index of the first lane whose `value` equals the warp maximum (ties -> smallest lane).
__device__ __forceinline__ int warp_argmax_first(int value, int* max_out) {
  const int m = __reduce_max_sync(kFullMask, value);
  *max_out = m;
  return __ffs(__ballot_sync(kFullMask, value == m)) - 1;
}

// ---- kernel 1: histograms ------------------------------------------------------------------

__global__ void __launch_bounds__(kCountThreads)
    plan_count_kernel(const PlanParams p, int tokens_per_chunk) {
  __shared__ int hist[kMaxExperts];
  __shared__ int invalid_count;
  const int E = p.num_experts, tid = threadIdx.x, chunk = blockIdx.x;
  const Scratch s = scratch_of(p.group);
  for (int e = tid; e < E; e += blockDim.x) hist[e] = 0;
  if (tid == 0) invalid_count = 0;
  __syncthreads();

  const int begin = chunk * tokens_per_chunk * p.top_k;
  const int end = min(p.num_tokens, (chunk + 1) * tokens_per_chunk) * p.top_k;
  for (int i = begin + tid; i < end; i += blockDim.x) {
    const int id = p.topk_idx[i];
    if (id >= 0 && id < E) {
      atomicAdd(&hist[id], 1);
    } else if (id != -1) {  // invalid: dropped like -1, never used as an index, counted
      atomicAdd(&invalid_count, 1);
    }
  }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) s.chunk_counts[chunk * E + e] = hist[e];
  if (tid == 0) s.chunk_invalid[chunk] = invalid_count;
  // Rows nobody owns stay -1. Peers write their rows only after the exchange barrier, which
  // orders these stores before theirs.
  for (int r = chunk * blockDim.x + tid; r < p.nvs; r += gridDim.x * blockDim.x) {
    p.recv_src[r] = -1;
    p.recv_primary[r] = -1;
  }
  __threadfence_system();
}

// ---- kernel 2: exchange and balancing ------------------------------------------------------

// B2 (one warp, lane d = rank d): the most overloaded rank (first on ties) fills the most
// underloaded one (first on ties) completely; at most R-1 rounds.
__device__ void rank_transfers(int num_ranks, const int* group_tokens, int total,
                               int (*z)[kMaxRanks]) {
  const int lane = threadIdx.x & 31;
  const bool is_rank = lane < num_ranks;
  const int cap = total / num_ranks + (lane < total % num_ranks ? 1 : 0);
  int balance = is_rank ? group_tokens[lane] - cap : 0;
  for (int round = 0; round < num_ranks; ++round) {
    int most;
    const int donor = warp_argmax_first(is_rank ? balance : INT_MIN, &most);
    if (most <= 0) break;
    const int least = __reduce_min_sync(kFullMask, is_rank ? balance : INT_MAX);
    const int receiver = __ffs(__ballot_sync(kFullMask, is_rank && balance == least)) - 1;
    if (lane == 0) z[donor][receiver] = -least;
    if (lane == donor) balance += least;
    if (lane == receiver) balance = 0;
  }
}

// B3 for home rank h (one warp): serve the largest quota (first rank on ties) from the expert
// with the most entries left (first local index on ties), until no quota or no entry is left.
__device__ void split_home(int h, int num_ranks, int epn, int* remaining, const int (*z)[kMaxRanks],
                           int32_t* alloc) {
  const int lane = threadIdx.x & 31;
  const bool is_rank = lane < num_ranks;
  int quota = is_rank ? z[h][lane] : 0;
  const int first = h * epn;
  for (;;) {
    int quota_max;
    const int d = warp_argmax_first(is_rank ? quota : INT_MIN, &quota_max);
    if (quota_max <= 0) break;
    int best = INT_MIN, best_le = INT_MAX;
    for (int le = lane; le < epn; le += 32) {
      const int v = remaining[first + le];
      if (v > best) best = v, best_le = le;
    }
    const int rem_max = __reduce_max_sync(kFullMask, best);
    if (rem_max <= 0) break;
    const int le = __reduce_min_sync(kFullMask, best == rem_max ? best_le : INT_MAX);
    const int take = min(rem_max, quota_max);
    if (lane == 0) {
      const int e = first + le;
      remaining[e] -= take;
      // Reductions without a return value do not wait for memory; the loop never stalls on them.
      atomicAdd(&alloc[e * num_ranks + d], take);
      atomicSub(&alloc[e * num_ranks + h], take);
    }
    if (lane == d) quota -= take;
    __syncwarp();
  }
}

// Phase C for destination d (one warp): group g < E is global expert g (empty when slotted),
// group E + b is slot b; groups padded to tp and laid out back to back. Each lane takes
// kLayoutPerLane consecutive groups per tile, so a tile costs one or two memory latencies.
__device__ void layout_destination(const PlanParams& p, int d, const uint32_t* slotted,
                                   const Scratch& s) {
  const int lane = threadIdx.x & 31;
  const int E = p.num_experts, B = p.num_slots, R = p.group.num_ranks, tp = p.token_padding;
  const int G = E + B;
  const bool mine = d == p.group.rank;
  int carry = 0;
  for (int tile = 0; tile < G; tile += 32 * kLayoutPerLane) {
    const int first = tile + lane * kLayoutPerLane;
    int expert[kLayoutPerLane], count[kLayoutPerLane];
#pragma unroll
    for (int k = 0; k < kLayoutPerLane; ++k) {
      const int g = first + k;
      expert[k] = -1;
      count[k] = 0;
      if (g < E) {
        expert[k] = g;
        count[k] = (slotted[g >> 5] >> (g & 31)) & 1u ? 0 : s.alloc[g * R + d];
      } else if (g < G) {
        expert[k] = p.experts_to_copy[d * B + (g - E)];
      }
    }
    int lane_rows = 0;
#pragma unroll
    for (int k = 0; k < kLayoutPerLane; ++k) {
      if (first + k >= E && expert[k] >= 0) count[k] = s.alloc[expert[k] * R + d];
      lane_rows += (count[k] + tp - 1) / tp * tp;
    }
    const int inclusive = warp_inclusive_sum(lane_rows);
    int start = carry + inclusive - lane_rows;
#pragma unroll
    for (int k = 0; k < kLayoutPerLane; ++k) {
      const int g = first + k, padded = (count[k] + tp - 1) / tp * tp;
      if (count[k] > 0) s.expert_off[d * kMaxExperts + expert[k]] = start;
      if (mine && g < G) {
        p.cu_seqlens[g] = start + padded;
        p.zero_fill[2 * g] = padded > count[k] ? start + count[k] : 0;
        p.zero_fill[2 * g + 1] = padded > count[k] ? padded - count[k] : 0;
      }
      start += padded;
    }
    carry += __shfl_sync(kFullMask, inclusive, 31);
  }
  if (lane == 0 && carry > p.nvs) {  // impossible by §3.12; refuse to write past the buffers
    printf("moonep: rank %d: internal error: the plan of rank %d needs %d rows > NvS = %d\n",
           p.group.rank, d, carry, p.nvs);
    __trap();
  }
}

__global__ void __launch_bounds__(kBalanceThreads)
    plan_balance_kernel(const PlanParams p, int num_chunks) {
  __shared__ int count[kMaxExperts];      // this rank's counts (phase A)
  __shared__ int remaining[kMaxExperts];  // B3: entries of each expert not yet moved
  __shared__ uint32_t slotted[kMaxRanks][kMaxExperts / 32];  // (d, e): e in a slot of d
  __shared__ int z[kMaxRanks][kMaxRanks];
  __shared__ int group_tokens[kMaxRanks];
  __shared__ int cand_key[kMaxCandidates];    // remote pair (e, d) as e * kMaxRanks + d
  __shared__ int cand_count[kMaxCandidates];  // alloc[e, d] of the pair
  __shared__ int num_candidates;
  __shared__ int total;
  __shared__ uint32_t epoch;
  const GroupView& g = p.group;
  const int E = p.num_experts, R = g.num_ranks, B = p.num_slots, epn = E / R;
  const int tid = threadIdx.x, warp = tid >> 5;
  const Scratch s = scratch_of(g);
  const PeerArea* me = own_area(g);

  // Phase A: local counts from the chunk histograms, which become exclusive chunk prefixes.
  if (tid == 0) epoch = next_epoch(g, kOpPlan);
  for (int e = tid; e < E; e += blockDim.x) {
    int run = 0;
    for (int c0 = 0; c0 < num_chunks; c0 += kChunkLoadBatch) {
      int h[kChunkLoadBatch];  // loads first, so that a batch costs one memory latency
#pragma unroll
      for (int k = 0; k < kChunkLoadBatch; ++k) {
        h[k] = c0 + k < num_chunks ? s.chunk_counts[(c0 + k) * E + e] : 0;
      }
#pragma unroll
      for (int k = 0; k < kChunkLoadBatch; ++k) {
        if (c0 + k < num_chunks) s.chunk_counts[(c0 + k) * E + e] = run;
        run += h[k];
      }
    }
    count[e] = run;
  }
  __syncthreads();
  for (int i = tid; i < R * E; i += blockDim.x) {
    g.areas[i / E]->counts[g.rank][i % E] = count[i % E];
  }
  // Invalid ids are this rank's business only: dropped like -1 and counted, so the peers need
  // not hear of them and no rank traps (Plan.num_invalid_ids, docs/CONTRACT.md).
  if (tid == 0) {
    int invalid = 0;
    for (int c = 0; c < num_chunks; ++c) invalid += s.chunk_invalid[c];
    p.num_invalid_ids[0] = invalid;
  }
  if (tid == 0) {
    publish(g, kMailboxRecvSrc, p.recv_src);
    publish(g, kMailboxRecvPrimary, p.recv_primary);
  }
  barrier(g, kBarrierExchange, epoch, "plan: expert count exchange");

  // B1: global counts, this rank's base per expert, everything at home.
  if (tid < R) group_tokens[tid] = 0;
  if (tid == 0) num_candidates = 0;
  if (tid < kMaxRanks * kMaxRanks) z[tid / kMaxRanks][tid % kMaxRanks] = 0;
  if (tid == 0) total = 0;
  for (int i = tid; i < R * (kMaxExperts / 32); i += blockDim.x) {
    slotted[i / (kMaxExperts / 32)][i % (kMaxExperts / 32)] = 0;
  }
  for (int i = tid; i < R * B; i += blockDim.x) p.experts_to_copy[i] = -1;
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    int sum = 0, before = 0;
    for (int r = 0; r < R; ++r) {
      const int v = me->counts[r][e];
      before += r < g.rank ? v : 0;
      sum += v;
    }
    remaining[e] = sum;
    s.rank_base[e] = before;
    for (int d = 0; d < R; ++d) s.alloc[e * R + d] = d == e / epn ? sum : 0;
    atomicAdd(&group_tokens[e / epn], sum);
    atomicAdd(&total, sum);
  }
  __syncthreads();
  if (warp == 0) rank_transfers(R, group_tokens, total, z);  // B2
  __syncthreads();
  if (warp < R) split_home(warp, R, epn, remaining, z, s.alloc);  // B3
  __syncthreads();

  // Prefix over destinations, and the remote (expert, destination) pairs, staged in shared
  // memory. Each pair comes from a B3 move, and home h makes at most epn + R - 1 moves (each one
  // empties an expert or a quota), so there are fewer than E + R*R <= kMaxCandidates pairs.
  for (int e = tid; e < E; e += blockDim.x) {
    int a[kMaxRanks];
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) a[d] = d < R ? s.alloc[e * R + d] : 0;
    int run = 0;
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      if (d >= R) continue;
      run += a[d];
      s.alloc_cum[e * R + d] = run;
      if (d != e / epn && a[d] > 0) {
        const int j = atomicAdd(&num_candidates, 1);
        if (j >= kMaxCandidates) {  // impossible (see above); never write past the arrays
          printf("moonep: rank %d: internal error: more than %d remote experts\n", g.rank,
                 kMaxCandidates);
          __trap();
        }
        cand_key[j] = e * kMaxRanks + d;
        cand_count[j] = a[d];
      }
    }
  }
  __syncthreads();
  // Slots: the top-B remote experts of each destination by (count desc, id desc). The pairs are
  // unordered, so a pair's slot is the number of pairs of the same destination that precede it;
  // within one destination, a larger key is a larger expert id.
  const int num_pairs = num_candidates;
  for (int j = tid; j < num_pairs; j += blockDim.x) {
    const int key = cand_key[j], c = cand_count[j], d = key % kMaxRanks, e = key / kMaxRanks;
    int position = 0;
    for (int k = 0; k < num_pairs; ++k) {
      const int key2 = cand_key[k], c2 = cand_count[k];
      position += key2 % kMaxRanks == d && (c2 > c || (c2 == c && key2 > key)) ? 1 : 0;
    }
    if (position < B) {
      p.experts_to_copy[d * B + position] = e;
      atomicOr(&slotted[d][e >> 5], 1u << (e & 31));
    }
  }
  __syncthreads();
  if (warp < R) layout_destination(p, warp, slotted[warp], s);  // phase C
}

// ---- kernel 3: destinations ----------------------------------------------------------------

__global__ void __launch_bounds__(kRouteThreads)
    plan_route_kernel(const PlanParams p, int tokens_per_chunk) {
  __shared__ int next_rank[kMaxExperts];  // global rank of the next entry of expert e
  __shared__ int win_id[kRouteWindow];     // the window's expert ids
  __shared__ int win_dest[kRouteWindow];
  __shared__ int win_row[kRouteWindow];   // global rank within the expert, then the row
  __shared__ int32_t* peer_src[kMaxRanks];
  __shared__ int32_t* peer_primary[kMaxRanks];
  const GroupView& g = p.group;
  const int E = p.num_experts, K = p.top_k, R = g.num_ranks, tid = threadIdx.x;
  const int num_entries = p.num_tokens * K, chunk = blockIdx.x;
  const Scratch s = scratch_of(g);

  for (int e = tid; e < E; e += blockDim.x) {
    next_rank[e] = s.rank_base[e] + s.chunk_counts[chunk * E + e];
  }
  if (tid < R) {
    peer_src[tid] = static_cast<int32_t*>(const_cast<void*>(peer_address(g, kMailboxRecvSrc, tid)));
    peer_primary[tid] =
        static_cast<int32_t*>(const_cast<void*>(peer_address(g, kMailboxRecvPrimary, tid)));
  }
  __syncthreads();

  const int window_tokens = kRouteWindow / K;
  const int chunk_end = min(p.num_tokens, (chunk + 1) * tokens_per_chunk);
  for (int t0 = chunk * tokens_per_chunk; t0 < chunk_end; t0 += window_tokens) {
    const int first = t0 * K, n = (min(chunk_end, t0 + window_tokens) - t0) * K;
    for (int j = tid; j < n; j += blockDim.x) win_id[j] = p.topk_idx[first + j];
    __syncthreads();
    // Stable rank within the expert: one warp walks the window in ascending i, 32 at a time.
    if (tid < 32) {
      for (int j0 = 0; j0 < n; j0 += 32) {
        const int j = j0 + tid;
        const int id = j < n ? win_id[j] : -1;
        const bool valid = id >= 0 && id < E;
        const unsigned same = __match_any_sync(kFullMask, valid ? id : -1);
        const int before = __popc(same & ((1u << tid) - 1u));
        if (valid) win_row[j] = next_rank[id] + before;
        __syncwarp();
        if (valid && before == 0) next_rank[id] += __popc(same);
        __syncwarp();
      }
    }
    __syncthreads();
    // Phase D: destination = number of d with alloc_cum[e, d] <= rank; row within its chunk.
#pragma unroll 4
    for (int j = tid; j < n; j += blockDim.x) {
      const int id = win_id[j];
      if (id < 0 || id >= E) {
        win_dest[j] = -1;
        continue;
      }
      const int rank_in_expert = win_row[j];
      const int32_t* cum = s.alloc_cum + id * R;
      int dest = 0;
      for (int d = 0; d < R; ++d) dest += cum[d] <= rank_in_expert ? 1 : 0;
      const int chunk_start = dest > 0 ? cum[dest - 1] : 0;
      win_dest[j] = dest;
      win_row[j] = s.expert_off[dest * kMaxExperts + id] + rank_in_expert - chunk_start;
    }
    __syncthreads();
    // Duplicates: the lowest k of the token going to the same rank is the primary.
    for (int j = tid; j < n; j += blockDim.x) {
      const int i = first + j, dest = win_dest[j];
      if (dest < 0) {
        p.dst[i] = kDropped;
        continue;
      }
      const int row = win_row[j], token_first = j - (j % K);
      int primary = row;
      bool duplicate = false;
      for (int j2 = token_first; j2 < j; ++j2) {
        if (win_dest[j2] == dest) {
          primary = win_row[j2];
          duplicate = true;
          break;
        }
      }
      if (dest >= R || row < 0 || row >= p.nvs) {  // impossible by §3.6; never write out of bounds
        printf("moonep: rank %d: internal error: entry %d maps to rank %d row %d (NvS = %d)\n",
               g.rank, i, dest, row, p.nvs);
        __trap();
      }
      const int encoded = dest * p.nvs + row;
      p.dst[i] = duplicate ? -encoded - 1 : encoded;
      peer_src[dest][row] = g.rank * num_entries + i;
      peer_primary[dest][row] = primary;
    }
    __syncthreads();
  }
  __threadfence_system();  // the exit barrier (next kernel) publishes these peer stores
}

// ---- kernel 4: exit barrier ----------------------------------------------------------------

__global__ void plan_exit_kernel(const GroupView g) {
  barrier(g, kBarrierExit, current_epoch(g, kOpPlan), "plan: exit");
}

MOONEP_PRELOAD_KERNEL(plan_count_kernel);
MOONEP_PRELOAD_KERNEL(plan_balance_kernel);
MOONEP_PRELOAD_KERNEL(plan_route_kernel);
MOONEP_PRELOAD_KERNEL(plan_exit_kernel);

int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace

cudaError_t launch_plan(const PlanParams& p, cudaStream_t stream) {
  // Token-aligned chunks of about kPlanChunkEntries entries (see plan.h for the maximum).
  const int num_entries = p.num_tokens * p.top_k;
  const int max_chunks = min(kMaxPlanChunks, kPlanChunkCountInts / p.num_experts);
  const int wanted = max(1, min(max_chunks, ceil_div(num_entries, kPlanChunkEntries)));
  const int tokens_per_chunk = ceil_div(p.num_tokens, wanted);
  const int num_chunks = ceil_div(p.num_tokens, tokens_per_chunk);

  plan_count_kernel<<<num_chunks, kCountThreads, 0, stream>>>(p, tokens_per_chunk);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  plan_balance_kernel<<<1, kBalanceThreads, 0, stream>>>(p, num_chunks);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  plan_route_kernel<<<num_chunks, kRouteThreads, 0, stream>>>(p, tokens_per_chunk);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  plan_exit_kernel<<<1, 32, 0, stream>>>(p.group);
  return cudaGetLastError();
}

}  // namespace moonep
