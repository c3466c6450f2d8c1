// The CUDA planner (see plan.h). Two kernels on XLA's stream, per rank. The serial phases run
// in the last CTA of each grid to finish ("last CTA done": every CTA releases its writes with a
// ticket in this rank's scratch), so no launch exists only to run one CTA:
//
//   plan_count_kernel  (C CTAs)  per-chunk expert histograms, their sums per block of
//                                kChunksPerBlock chunks and the invalid-id count of the local
//                                entries; marks this rank's recv_src / recv_primary rows as -1.
//                                Its last CTA: local counts -> every peer's counts region, recv
//                                addresses -> every peer's mailbox, barrier (none of the three in
//                                a group of one); then, replicated on every rank and in shared
//                                memory, B1-B3 and the generation-1 layout of all R destinations.
//   plan_route_kernel  (C CTAs)  stable rank of each entry within its expert, destination row,
//                                duplicate marking; dst locally, recv_src / recv_primary rows
//                                straight into the destination's XLA result buffers. Its last
//                                CTA: exit barrier (no peer still writes when the call returns);
//                                a group of one takes no ticket and has no exit barrier.
//
// Only the last CTA of a grid waits on peers, and by then every other CTA of its grid has exited:
// a rank holds one CTA while it spins, so the peers' grids (other processes under MPS) can run.
//
// Every tie rule follows moonep_algorithm.md §3 and moonep_jax/plan.py::_plan_xla exactly.
#include <climits>
#include <vector>

#include "kernels/ceil_div.h"
#include "kernels/constants.h"
#include "kernels/plan.h"

namespace moonep {
namespace {

constexpr int kCountThreads = 512;  // also the last CTA's threads for the balancing
constexpr int kRouteThreads = 256;
constexpr int kRouteWindow = 2048;  // entries ranked per round of the routing kernel
constexpr int kLayoutPerLane = 8;    // consecutive groups per lane in the layout scan
constexpr int kMaxCandidates = kMaxExperts + kMaxRanks * kMaxRanks;  // see exchange_and_balance
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kCountThreads / 32 >= kMaxRanks && kCountThreads >= kMaxRanks * kMaxRanks,
              "the balancing needs a warp per rank and a thread per rank pair");

// Chunks are grouped in blocks of kChunksPerBlock: the count kernel also sums each block's chunk
// histograms (atomically), so the last CTA reads at most kMaxPlanBlocks rows per expert and a
// routing CTA at most kChunksPerBlock rows, instead of one row per earlier chunk.
constexpr int kChunksPerBlock = 16;
constexpr int kMaxPlanBlocks = ceil_div(kMaxPlanChunks, kChunksPerBlock);
// ceil(C / kChunksPerBlock) * E <= C * E / kChunksPerBlock + E, and C * E <= kPlanChunkCountInts.
constexpr int kPlanBlockCountInts = kPlanChunkCountInts / kChunksPerBlock + kMaxExperts;

constexpr int kMailboxRecvSrc = mailbox_slot(kOpPlan, 0);
constexpr int kMailboxRecvPrimary = mailbox_slot(kOpPlan, 1);
constexpr int kBarrierExchange = barrier_slot(kOpPlan, 0);
constexpr int kBarrierExit = barrier_slot(kOpPlan, 1);

// Counters in the planner scratch; each is zero between calls (the area is zeroed at creation and
// the last CTA of the grid that uses it resets it).
enum PlanCounter : int {
  kCountTicket = 0,   // count CTAs done
  kRouteTicket = 1,   // routing CTAs done
  kInvalidTotal = 2,  // entries with ids outside [-1, E)
  kNumPlanCounters = 3,
};

// Planner scratch in this rank's PeerArea (ints). Strides use the static maxima.
constexpr int kChunkCountsOff = 0;                                          // [chunks][E]
constexpr int kBlockCountsOff = kChunkCountsOff + kPlanChunkCountInts;      // [blocks][E]
constexpr int kBlockBaseOff = kBlockCountsOff + kPlanBlockCountInts;        // [blocks][E]
constexpr int kRankBaseOff = kBlockBaseOff + kPlanBlockCountInts;           // [E]
constexpr int kAllocCumOff = kRankBaseOff + kMaxExperts;                    // [E][R]
constexpr int kRowShiftOff = kAllocCumOff + kMaxExperts * kMaxRanks;        // [E][R]
constexpr int kCountersOff = kRowShiftOff + kMaxExperts * kMaxRanks;        // [kNumPlanCounters]
constexpr int kScratchEnd = kCountersOff + kNumPlanCounters;
static_assert(kScratchEnd <= kPlanScratchInts, "planner scratch must fit PeerArea::plan_scratch");

struct Scratch {
  int32_t* chunk_counts;  // per-chunk histogram
  int32_t* block_counts;  // per-block sum of the chunk histograms (zero between calls)
  int32_t* block_base;    // [blocks][E] entries of expert e in earlier blocks of this rank
  int32_t* rank_base;     // [E] entries of expert e on ranks < this rank
  int32_t* alloc_cum;     // [E][R] inclusive prefix over d of alloc[e][d]
  int32_t* row_shift;     // [E][R] an entry of rank i within expert e that goes to rank d lands
                          // on row i + row_shift[e][d] there (stale where alloc[e][d] == 0)
  int32_t* counters;      // [kNumPlanCounters]
};

__device__ __forceinline__ Scratch scratch_of(const GroupView& g) {
  int32_t* s = own_area(g)->plan_scratch;
  return Scratch{s + kChunkCountsOff, s + kBlockCountsOff, s + kBlockBaseOff, s + kRankBaseOff,
                 s + kAllocCumOff,    s + kRowShiftOff,    s + kCountersOff};
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

// ---- the last count CTA: exchange and balancing ---------------------------------------------

// B2 (one warp, lane d = rank d): the most overloaded rank (first on ties) fills the most
// underloaded one (first on ties) completely; at most R-1 rounds.
__device__ void rank_transfers(int num_ranks, const int* group_tokens, int (*z)[kMaxRanks]) {
  const int lane = threadIdx.x & 31;
  const bool is_rank = lane < num_ranks;
  const int tokens = is_rank ? group_tokens[lane] : 0;
  const int total = __reduce_add_sync(kFullMask, tokens);  // < R * NvS < 2^31
  const int cap = total / num_ranks + (lane < total % num_ranks ? 1 : 0);
  int balance = is_rank ? tokens - cap : 0;
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
// Only this warp touches the rows of home h's experts in `remaining` and `alloc` (shared memory).
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
      alloc[e * num_ranks + d] += take;
      alloc[e * num_ranks + h] -= take;
    }
    if (lane == d) quota -= take;
    __syncwarp();
  }
}

// Phase C for destination d (one warp): group g < E is global expert g (empty when slotted),
// group E + b is slot b (expert slot_expert[b], -1 unused); groups padded to tp and laid out back
// to back. Each lane takes kLayoutPerLane consecutive groups per tile; inputs are in shared memory.
__device__ void layout_destination(const PlanParams& p, int d, const uint32_t* slotted,
                                   const int* slot_expert, const int32_t* alloc, const Scratch& s) {
  const int lane = threadIdx.x & 31;
  const int E = p.num_experts, B = p.num_slots, R = p.group.num_ranks, tp = p.token_padding;
  const int G = E + B;
  const bool mine = d == p.group.rank;
  int carry = 0;
  for (int tile = 0; tile < G; tile += 32 * kLayoutPerLane) {
    const int first = tile + lane * kLayoutPerLane;
    int expert[kLayoutPerLane], count[kLayoutPerLane];
    int lane_rows = 0;
#pragma unroll
    for (int k = 0; k < kLayoutPerLane; ++k) {
      const int g = first + k;
      expert[k] = g < E ? g : g < G ? slot_expert[g - E] : -1;
      const bool empty = expert[k] < 0 || (g < E && ((slotted[g >> 5] >> (g & 31)) & 1u));
      count[k] = empty ? 0 : alloc[expert[k] * R + d];
      lane_rows += (count[k] + tp - 1) / tp * tp;
    }
    const int inclusive = warp_inclusive_sum(lane_rows);
    int start = carry + inclusive - lane_rows;
#pragma unroll
    for (int k = 0; k < kLayoutPerLane; ++k) {
      const int g = first + k, padded = (count[k] + tp - 1) / tp * tp;
      if (count[k] > 0) {  // the group's first row holds the first entry of e computed on d
        int first_rank = 0;
        for (int d2 = 0; d2 < d; ++d2) first_rank += alloc[expert[k] * R + d2];
        s.row_shift[expert[k] * R + d] = start - first_rank;
      }
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

// Phase A: this rank's count of each expert is the sum of its block histograms, which become
// exclusive block prefixes for the routing and are zeroed for the next call (every count CTA
// has added its histogram: this is the last one).
__device__ void sum_blocks(const PlanParams& p, int num_blocks, int* local_count) {
  const int E = p.num_experts;
  const Scratch s = scratch_of(p.group);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int h[kMaxPlanBlocks];  // loads first, so that they cost one memory latency
#pragma unroll
    for (int b = 0; b < kMaxPlanBlocks; ++b) {
      h[b] = b < num_blocks ? __ldcg(&s.block_counts[b * E + e]) : 0;  // other CTAs' atomics
    }
    int run = 0;
#pragma unroll
    for (int b = 0; b < kMaxPlanBlocks; ++b) {
      if (b < num_blocks) {
        s.block_base[b * E + e] = run;
        s.block_counts[b * E + e] = 0;
      }
      run += h[b];
    }
    local_count[e] = run;
  }
}

// Run by every thread of the last count CTA. `expert_count` is a shared [E] array (the CTA's
// histogram, free by now): this rank's counts, then each expert's entries not yet moved (B3);
// `alloc` is shared [E][R], alloc[e][d] entries of expert e computed on rank d.
__device__ void exchange_and_balance(const PlanParams& p, int num_chunks, int* expert_count,
                                     int32_t* alloc) {
  __shared__ uint32_t slotted[kMaxRanks][kMaxExperts / 32];  // (d, e): e in a slot of d
  __shared__ int slot_expert[kMaxExperts];    // [R][B] experts_to_copy; R * B <= E
  __shared__ int z[kMaxRanks][kMaxRanks];
  __shared__ int group_tokens[kMaxRanks];
  __shared__ int cand_key[kMaxCandidates];    // remote pair (e, d) as e * kMaxRanks + d
  __shared__ int cand_count[kMaxCandidates];  // alloc[e, d] of the pair
  __shared__ int num_candidates;
  const GroupView& g = p.group;
  const int E = p.num_experts, R = g.num_ranks, B = p.num_slots, epn = E / R;
  const int tid = threadIdx.x, warp = tid >> 5;
  const Scratch s = scratch_of(g);
  const PeerArea* me = own_area(g);

  // Thread 0's two atomics go out before sum_blocks' loads, so that they share one latency. Only
  // thread 0 uses the epoch: it waits in the barrier and labels its timeout report.
  uint32_t call_epoch = 0;
  int invalid_total = 0;
  if (tid == 0) {
    call_epoch = next_epoch(g, kOpPlan);
    invalid_total = atomicExch(&s.counters[kInvalidTotal], 0);
  }
  sum_blocks(p, ceil_div(num_chunks, kChunksPerBlock), expert_count);
  __syncthreads();
  // This rank's own counts stay in shared memory (B1 reads them there); only peers get a row.
  for (int i = tid; i < R * E; i += blockDim.x) {
    if (i / E != g.rank) g.areas[i / E]->counts[g.rank][i % E] = expert_count[i % E];
  }
  if (tid == 0) {
    // Invalid ids are this rank's business only: dropped like -1 and counted, so the peers need
    // not hear of them and no rank traps (Plan.num_invalid_ids, docs/CONTRACT.md).
    p.num_invalid_ids[0] = invalid_total;
    if (R > 1) {  // the routing finds this rank's own buffers in PlanParams
      publish(g, kMailboxRecvSrc, p.recv_src);
      publish(g, kMailboxRecvPrimary, p.recv_primary);
    }
  }
  barrier(g, kBarrierExchange, call_epoch, "plan: expert count exchange");

  // B1: global counts, this rank's base per expert, everything at home.
  if (tid < kMaxRanks * kMaxRanks) z[tid / kMaxRanks][tid % kMaxRanks] = 0;
  if (tid == 0) num_candidates = 0;
  for (int i = tid; i < R * (kMaxExperts / 32); i += blockDim.x) {
    slotted[i / (kMaxExperts / 32)][i % (kMaxExperts / 32)] = 0;
  }
  for (int i = tid; i < R * B; i += blockDim.x) slot_expert[i] = -1;
  for (int e = tid; e < E; e += blockDim.x) {
    int v[kMaxRanks];  // loads first, so that they cost one memory latency
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      v[r] = r == g.rank ? expert_count[e] : r < R ? me->counts[r][e] : 0;
    }
    int sum = 0, before = 0;
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      before += r < g.rank ? v[r] : 0;
      sum += v[r];
    }
    expert_count[e] = sum;
    s.rank_base[e] = before;
    for (int d = 0; d < R; ++d) alloc[e * R + d] = d == e / epn ? sum : 0;
  }
  __syncthreads();
  if (warp < R) {  // entries of home group `warp`
    int tokens = 0;
    for (int le = tid & 31; le < epn; le += 32) tokens += expert_count[warp * epn + le];
    tokens = __reduce_add_sync(kFullMask, tokens);
    if ((tid & 31) == 0) group_tokens[warp] = tokens;
  }
  __syncthreads();
  if (warp == 0) rank_transfers(R, group_tokens, z);  // B2
  __syncthreads();
  if (warp < R) split_home(warp, R, epn, expert_count, z, alloc);  // B3
  __syncthreads();

  // Prefix over destinations, and the remote (expert, destination) pairs. Each pair comes from a
  // B3 move, and home h makes at most epn + R - 1 moves (each one empties an expert or a quota),
  // so there are fewer than E + R*R <= kMaxCandidates pairs.
  for (int e = tid; e < E; e += blockDim.x) {
    int run = 0;
    for (int d = 0; d < R; ++d) {
      const int a = alloc[e * R + d];
      run += a;
      s.alloc_cum[e * R + d] = run;
      if (d != e / epn && a > 0) {
        const int j = atomicAdd(&num_candidates, 1);
        if (j >= kMaxCandidates) {  // impossible (see above); never write past the arrays
          printf("moonep: rank %d: internal error: more than %d remote experts\n", g.rank,
                 kMaxCandidates);
          __trap();
        }
        cand_key[j] = e * kMaxRanks + d;
        cand_count[j] = a;
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
      slot_expert[d * B + position] = e;
      atomicOr(&slotted[d][e >> 5], 1u << (e & 31));
    }
  }
  __syncthreads();
  for (int i = tid; i < R * B; i += blockDim.x) p.experts_to_copy[i] = slot_expert[i];
  if (warp < R) layout_destination(p, warp, slotted[warp], slot_expert + warp * B, alloc, s);  // C
}

// ---- kernel 1: histograms, then (last CTA) exchange and balancing ---------------------------

__global__ void __launch_bounds__(kCountThreads)
    plan_count_kernel(const PlanParams p, int tokens_per_chunk) {
  __shared__ int hist[kMaxExperts];
  __shared__ int invalid_count;
  extern __shared__ int32_t alloc[];  // [E][R], for the last CTA
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
  int32_t* block_counts = s.block_counts + chunk / kChunksPerBlock * E;
  for (int e = tid; e < E; e += blockDim.x) {
    const int h = hist[e];
    s.chunk_counts[chunk * E + e] = h;
    if (h != 0) atomicAdd(&block_counts[e], h);
  }
  if (tid == 0 && invalid_count != 0) atomicAdd(&s.counters[kInvalidTotal], invalid_count);
  // Rows nobody owns stay -1. Peers write their rows only after the exchange barrier, which
  // orders these stores (fenced in last_cta_done) before theirs.
  for (int r = chunk * blockDim.x + tid; r < p.nvs; r += gridDim.x * blockDim.x) {
    p.recv_src[r] = -1;
    p.recv_primary[r] = -1;
  }
  if (!last_cta_done(&s.counters[kCountTicket], p.group.num_ranks > 1)) return;
  exchange_and_balance(p, gridDim.x, hist, alloc);
}

// ---- kernel 2: destinations, then (last CTA) the exit barrier -------------------------------

constexpr int kIdsPerThread = kRouteWindow / kRouteThreads;

// A window's expert ids, loaded into registers and then stored to shared memory, so that other
// loads can be issued in between and share their latency.
struct WindowIds {
  int id[kIdsPerThread];

  __device__ void load(const int32_t* topk_idx, int n) {
#pragma unroll
    for (int u = 0; u < kIdsPerThread; ++u) {
      const int j = threadIdx.x + u * kRouteThreads;
      id[u] = j < n ? topk_idx[j] : -1;
    }
  }

  __device__ void store(int* win_id, int n) const {
#pragma unroll
    for (int u = 0; u < kIdsPerThread; ++u) {
      const int j = threadIdx.x + u * kRouteThreads;
      if (j < n) win_id[j] = id[u];
    }
  }
};

constexpr int kRouteWarps = kRouteThreads / 32;
constexpr int kBaseExpertsPerThread = 2;  // experts whose base loads one thread issues at once

// next_rank[e] = the chunk's base of expert e: entries of e on ranks before this one, in blocks
// before this chunk's, and in the chunks before it in its block. Each thread issues the loads of
// kBaseExpertsPerThread experts before summing any, so that they cost one memory latency.
__device__ void load_chunk_base(const Scratch& s, int E, int chunk, int* next_rank) {
  const int block = chunk / kChunksPerBlock, block_first = block * kChunksPerBlock;
  for (int e0 = threadIdx.x; e0 < E; e0 += kBaseExpertsPerThread * kRouteThreads) {
    int h[kBaseExpertsPerThread][kChunksPerBlock + 1];
#pragma unroll
    for (int u = 0; u < kBaseExpertsPerThread; ++u) {
      const int e = e0 + u * kRouteThreads;
#pragma unroll
      for (int k = 0; k < kChunksPerBlock - 1; ++k) {
        h[u][k] = e < E && block_first + k < chunk ? s.chunk_counts[(block_first + k) * E + e] : 0;
      }
      h[u][kChunksPerBlock - 1] = e < E ? s.rank_base[e] : 0;
      h[u][kChunksPerBlock] = e < E ? s.block_base[block * E + e] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBaseExpertsPerThread; ++u) {
      const int e = e0 + u * kRouteThreads;
      int base = 0;
#pragma unroll
      for (int k = 0; k <= kChunksPerBlock; ++k) base += h[u][k];
      if (e < E) next_rank[e] = base;
    }
  }
}

// Entries of a window that warp w ranks: [w * span, (w + 1) * span), a multiple of 32 entries.
__device__ __forceinline__ int warp_span(int n) { return ceil_div(n, kRouteThreads) * 32; }

// Stable rank of each window entry within its expert, in two steps. Each warp walks its span in
// ascending j, 32 at a time: win_row[j] = entries of the same expert before j in the span, and
// warp_count[w][e] (zero on entry) = entries of e in warp w's span. Then, per expert, warp_count
// becomes each warp's base (next_rank plus the entries of the spans before it), and next_rank
// moves past the window. So warp_count[w][id] + win_row[j] is the global rank, the same as one
// walk over the whole window in ascending j.
__device__ void rank_window(int n, int E, const int* win_id, int* win_row, int* next_rank,
                            int* warp_count) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, span = warp_span(n);
  const int end = min(n, (warp + 1) * span);
  int* count = warp_count + warp * E;
  for (int j0 = warp * span; j0 < end; j0 += 32) {
    const int j = j0 + lane;
    const int id = j < end ? win_id[j] : -1;
    const bool valid = id >= 0 && id < E;
    const unsigned same = __match_any_sync(kFullMask, valid ? id : -1);
    const int before = __popc(same & ((1u << lane) - 1u));
    if (valid) win_row[j] = count[id] + before;
    __syncwarp();
    if (valid && before == 0) count[id] += __popc(same);
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kRouteThreads) {
    int run = next_rank[e];
#pragma unroll
    for (int w = 0; w < kRouteWarps; ++w) {
      const int c = warp_count[w * E + e];
      warp_count[w * E + e] = run;
      run += c;
    }
    next_rank[e] = run;
  }
  __syncthreads();
}

__device__ void zero_warp_counts(int E, int* warp_count) {
  for (int i = threadIdx.x; i < kRouteWarps * E; i += kRouteThreads) warp_count[i] = 0;
}

// minBlocksPerMultiprocessor 1: without it ptxas caps the registers for more resident CTAs than
// a grid of at most kMaxPlanChunks CTAs needs, and spills around the chunk base's loads.
__global__ void __launch_bounds__(kRouteThreads, 1)
    plan_route_kernel(const PlanParams p, int tokens_per_chunk) {
  __shared__ int next_rank[kMaxExperts];  // global rank of the next entry of expert e
  __shared__ int win_id[kRouteWindow];    // the window's expert ids
  __shared__ int win_dest[kRouteWindow];
  __shared__ int win_row[kRouteWindow];  // rank within the expert in a warp's span, then the row
  __shared__ int32_t* peer_src[kMaxRanks];
  __shared__ int32_t* peer_primary[kMaxRanks];
  extern __shared__ int warp_count[];  // [kRouteWarps][E], see rank_window
  const GroupView& g = p.group;
  const int E = p.num_experts, K = p.top_k, R = g.num_ranks, tid = threadIdx.x;
  const int num_entries = p.num_tokens * K, chunk = blockIdx.x;
  const Scratch s = scratch_of(g);
  const int window_tokens = kRouteWindow / K;
  const int chunk_begin = chunk * tokens_per_chunk;
  const int chunk_end = min(p.num_tokens, chunk_begin + tokens_per_chunk);
  auto window_size = [&](int t0) { return (min(chunk_end, t0 + window_tokens) - t0) * K; };

  WindowIds ids;
  ids.load(p.topk_idx + chunk_begin * K, window_size(chunk_begin));
  load_chunk_base(s, E, chunk, next_rank);
  zero_warp_counts(E, warp_count);
  if (tid < R) {  // a group of one publishes no addresses: its own buffers are in PlanParams
    auto published = [&](int slot) {
      return static_cast<int32_t*>(const_cast<void*>(peer_address(g, slot, tid)));
    };
    peer_src[tid] = tid == g.rank ? p.recv_src : published(kMailboxRecvSrc);
    peer_primary[tid] = tid == g.rank ? p.recv_primary : published(kMailboxRecvPrimary);
  }
  ids.store(win_id, window_size(chunk_begin));
  __syncthreads();

  for (int t0 = chunk_begin; t0 < chunk_end; t0 += window_tokens) {
    const int first = t0 * K, n = window_size(t0), span = warp_span(n);
    if (t0 != chunk_begin) {  // the first window's ids came with the base
      ids.load(p.topk_idx + first, n);
      ids.store(win_id, n);
      zero_warp_counts(E, warp_count);
      __syncthreads();
    }
    rank_window(n, E, win_id, win_row, next_rank, warp_count);
    // Phase D: destination = number of d with alloc_cum[e, d] <= rank; row on it.
#pragma unroll 2
    for (int j = tid; j < n; j += blockDim.x) {
      const int id = win_id[j];
      if (id < 0 || id >= E) {
        win_dest[j] = -1;
        continue;
      }
      const int rank_in_expert = warp_count[j / span * E + id] + win_row[j];
      int cum[kMaxRanks], shift[kMaxRanks];  // loads first, so that they cost one memory latency
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) {
        cum[d] = d < R ? s.alloc_cum[id * R + d] : INT_MAX;
        shift[d] = d < R ? s.row_shift[id * R + d] : 0;
      }
      int dest = 0, row_shift = 0;
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) dest += cum[d] <= rank_in_expert ? 1 : 0;
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) row_shift = d == dest ? shift[d] : row_shift;
      win_dest[j] = dest;
      win_row[j] = rank_in_expert + row_shift;
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
  // The exit barrier publishes every CTA's peer stores (fenced in last_cta_done). A group of one
  // has no peer and no exit barrier: its stores are ordered by the kernel boundary.
  if (R == 1 || !last_cta_done(&s.counters[kRouteTicket], true)) return;
  barrier(g, kBarrierExit, current_epoch(g, kOpPlan), "plan: exit");
}

MOONEP_PRELOAD_KERNEL(plan_count_kernel);
MOONEP_PRELOAD_KERNEL(plan_route_kernel);

}  // namespace

cudaError_t launch_plan(const PlanParams& p, cudaStream_t stream) {
  // Token-aligned chunks of about kPlanChunkEntries entries (see plan.h for the maximum).
  const int num_entries = p.num_tokens * p.top_k;
  const int max_chunks = min(kMaxPlanChunks, kPlanChunkCountInts / p.num_experts);
  const int wanted = max(1, min(max_chunks, ceil_div(num_entries, kPlanChunkEntries)));
  const int tokens_per_chunk = ceil_div(p.num_tokens, wanted);
  const int num_chunks = ceil_div(p.num_tokens, tokens_per_chunk);

  // The last count CTA keeps alloc [E][R] in dynamic shared memory, and a routing CTA its
  // per-warp counts [kRouteWarps][E]. Each limit is set to the largest size, the same on every
  // call and every thread, so concurrent launches agree on it.
  constexpr int kMaxAllocBytes = int(sizeof(int32_t)) * kMaxExperts * kMaxRanks;
  if (cudaError_t err = cudaFuncSetAttribute(
          plan_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxAllocBytes);
      err != cudaSuccess) {
    return err;
  }
  const size_t alloc_bytes = sizeof(int32_t) * p.num_experts * p.group.num_ranks;
  plan_count_kernel<<<num_chunks, kCountThreads, alloc_bytes, stream>>>(p, tokens_per_chunk);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  constexpr int kMaxWarpCountBytes = int(sizeof(int)) * kRouteWarps * kMaxExperts;
  if (cudaError_t err = cudaFuncSetAttribute(
          plan_route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxWarpCountBytes);
      err != cudaSuccess) {
    return err;
  }
  const size_t warp_count_bytes = sizeof(int) * kRouteWarps * p.num_experts;
  plan_route_kernel<<<num_chunks, kRouteThreads, warp_count_bytes, stream>>>(p, tokens_per_chunk);
  return cudaGetLastError();
}

cudaError_t plan_graph_nodes(int num_experts, int top_k, int num_tokens, int num_ranks,
                             int* kernel_nodes, int* other_nodes) {
  PlanParams p{};  // sizes only: captured launches never run, so no pointer is dereferenced
  p.num_experts = num_experts;
  p.top_k = top_k;
  p.num_tokens = num_tokens;
  p.group.num_ranks = num_ranks;
  cudaStream_t stream;
  if (cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      err != cudaSuccess) {
    return err;
  }
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  if (err == cudaSuccess) {
    const cudaError_t launched = launch_plan(p, stream);
    err = cudaStreamEndCapture(stream, &graph);
    if (launched != cudaSuccess) err = launched;
  }
  size_t n = 0;
  if (err == cudaSuccess) err = cudaGraphGetNodes(graph, nullptr, &n);
  std::vector<cudaGraphNode_t> nodes(n);
  if (err == cudaSuccess) err = cudaGraphGetNodes(graph, nodes.data(), &n);
  *kernel_nodes = *other_nodes = 0;
  for (size_t i = 0; i < n && err == cudaSuccess; ++i) {
    cudaGraphNodeType type;
    err = cudaGraphNodeGetType(nodes[i], &type);
    if (err == cudaSuccess) ++*(type == cudaGraphNodeTypeKernel ? kernel_nodes : other_nodes);
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return err;
}

}  // namespace moonep
