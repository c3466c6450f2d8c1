#include "kernels/dispatch.h"
#include "kernels/rendezvous.h"

namespace moonep {
namespace {

constexpr int kThreads = 512;
// Vectors each lane loads before it stores them: 8 x 16 bytes in flight per lane, 4 KiB per warp,
// so that a few hundred warps keep the NVLink round trip of a peer's row busy.
constexpr int kUnroll = 8;
constexpr unsigned kFullMask = 0xffffffffu;
// Receive rows a warp decodes per unit of work. Units are taken from a grid-wide counter, so
// that SMs done early take more: dealt statically (a group of 32 rows per warp, one per warp at
// R = 1), the tokens a CTA pulls vary from 64 on average to 84 at most, and the grid waits on it.
constexpr int kRowsPerUnit = 8;
// The counter and the CTAs' exit ticket, in this rank's op_scratch (the last CTA out zeroes both:
// the ticket in last_cta_done).
constexpr int kScratchNextUnit = 0;
constexpr int kScratchCtasDone = 1;
constexpr int kMailboxX = mailbox_slot(kOpDispatch, 0);
constexpr int kMailboxTopkW = mailbox_slot(kOpDispatch, 1);
constexpr int kMailboxDst = mailbox_slot(kOpDispatch, 2);

// Every rank's published operands, as this process addresses them (peers' are XLA buffers of
// the current call, valid between the entry and the exit barrier).
struct Sources {
  const char* x[kMaxRanks];
  const float* topk_w[kMaxRanks];
  const int32_t* dst[kMaxRanks];
};

__device__ __forceinline__ bool is_row(int32_t row, int32_t nvs) {
  return static_cast<uint32_t>(row) < static_cast<uint32_t>(nvs);
}

__device__ __forceinline__ int32_t num_entries(const DispatchParams& p) {
  return p.num_tokens * p.top_k;
}

// Out of line: the error path of every check stays one copy, off the data loop's code.
__device__ __noinline__ void report_bad_row(const DispatchParams& p, int64_t value,
                                            const char* what) {
  report_bad_plan_data(p.group, kOpDispatch, value, what);
}

// The entry that owns a receive row, from Plan.recv_src: its source rank and its flat index
// t*K + k there; src == -1 for a row no entry owns (or one naming a rank outside the group,
// reported).
struct Owner {
  int32_t src;
  int32_t entry;
};

__device__ __forceinline__ Owner owner_of(const DispatchParams& p, int32_t row) {
  const int32_t v = p.recv_src[row];
  if (v < 0) return {-1, 0};
  const int32_t src = v / num_entries(p);
  if (src >= p.group.num_ranks) {
    report_bad_row(p, v, "plan.recv_src names a rank outside");
    return {-1, 0};
  }
  return {src, v - src * num_entries(p)};
}

// Plan.dst of the entry that owns receive row `row` of this rank, as its source encodes it.
__device__ __forceinline__ int32_t dst_of_row(const DispatchParams& p, int32_t row, bool primary) {
  const int32_t code = p.group.rank * p.nvs + row;
  return primary ? code : -code - 1;
}

// Whether the owner's dst `value` names receive row `row` of this rank (as a primary or a
// duplicate). A disagreement is reported here, unless the value names a rank outside the group:
// its own rank's check (check_own_destinations) reports that, so that the record names the cause.
__device__ bool owner_names_row(const DispatchParams& p, int32_t value, int32_t row, bool primary) {
  if (value == dst_of_row(p, row, primary)) return true;
  const int32_t raw = value >= 0 ? value : -(value + 1);
  if (value == kDropped || raw / p.nvs < p.group.num_ranks) {
    report_bad_row(p, row, "plan.dst disagrees with plan.recv_src");
  }
  return false;
}

// Whether primary row `q` (recv_primary[q] == q, owner `o`) is pulled: an entry owns it and the
// owner's dst names q as that entry's primary row (row_action's test, seen from a duplicate).
__device__ bool is_pulled(const DispatchParams& p, const Sources& s, int32_t q, Owner o) {
  return o.src >= 0 && owner_names_row(p, __ldcg(s.dst[o.src] + o.entry), q, true);
}

// What the warp does with one receive row. A duplicate row is written by the warp that pulls
// its primary row, which finds it through the source's dst of the token's K entries; both sides
// test the same conditions (is_pulled of the primary, the same token, the owner's dst naming the
// row), so every row is written exactly once: pulled, by its primary, or zeroed.
enum RowAction : int32_t { kZero, kPull, kByPrimary };

__device__ RowAction row_action(const DispatchParams& p, const Sources& s, int32_t row, Owner o) {
  if (o.src < 0) return kZero;
  const int32_t own_dst = __ldcg(s.dst[o.src] + o.entry);  // in flight during the local reads
  const int32_t q = p.recv_primary[row];
  if (q == row) return owner_names_row(p, own_dst, row, true) ? kPull : kZero;
  if (!is_row(q, p.nvs) || p.recv_primary[q] != q) {
    report_bad_row(p, q, "plan.recv_primary is not a primary row");
    return kZero;
  }
  // A primary that is not pulled has reported itself; its duplicates are zeroed with it.
  const Owner oq = owner_of(p, q);
  if (!is_pulled(p, s, q, oq)) return kZero;
  if (o.src != oq.src || o.entry / p.top_k != oq.entry / p.top_k) {
    report_bad_row(p, row, "plan.dst disagrees with plan.recv_src");
    return kZero;
  }
  return owner_names_row(p, own_dst, row, false) ? kByPrimary : kZero;
}

// Every entry of this rank's dst is decoded once here: a dst naming a rank outside the group is
// reported even when no receiver reads it.
__device__ void check_own_destinations(const DispatchParams& p) {
  const int64_t n = num_entries(p);
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * kThreads) {
    decode_destination(p.group, kOpDispatch, p.dst[i], p.nvs);
  }
}

template <typename Vec>
__device__ void zero_row(const DispatchParams& p, int32_t row, int lane) {
  const int64_t row_vecs = p.row_bytes / static_cast<int64_t>(sizeof(Vec));
  Vec* out = reinterpret_cast<Vec*>(static_cast<char*>(p.recv_x) + row * p.row_bytes);
  for (int64_t i = lane; i < row_vecs; i += 32) out[i] = Vec{};
}

// A lane's part of one chunk of a row: vectors i + u*32 (u < kUnroll), those below row_vecs.
template <typename Vec>
__device__ __forceinline__ void load_chunk(const Vec* in, int64_t i, int64_t row_vecs,
                                           Vec (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (i + u * 32 < row_vecs) v[u] = __ldcg(in + i + u * 32);
}

template <typename Vec>
__device__ __forceinline__ void store_chunk(Vec* out, int64_t i, int64_t row_vecs,
                                            const Vec (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (i + u * 32 < row_vecs) out[i + u * 32] = v[u];
}

// The warp pulls the token of primary row `primary` (owner `o`) once and writes it to every row
// of this rank that the token's entries own: lane k < K reads entry k's dst and weight from the
// source, keeps its row if it is `primary` or a duplicate of it (the conditions of row_action),
// and writes its weight; the warp loads the row, kUnroll vectors per lane at a time, from L2
// (__ldcg: a peer's buffer, never an L1 line of an earlier call) and stores each chunk to those
// rows. The first chunk is in flight while the token's dst and weights arrive. Loops are
// warp-uniform (chunks counted from 0, not from the lane), as the shuffles need every lane.
template <typename Vec>
__device__ void pull_token(const DispatchParams& p, const Sources& s, int32_t primary, Owner o,
                           int lane) {
  const int32_t first = o.entry - o.entry % p.top_k;  // t*K of the token
  const int64_t row_vecs = p.row_bytes / static_cast<int64_t>(sizeof(Vec));
  const Vec* in = reinterpret_cast<const Vec*>(s.x[o.src] + (first / p.top_k) * p.row_bytes);
  Vec v[kUnroll];
  load_chunk(in, lane, row_vecs, v);

  int32_t row = -1;
  if (lane < p.top_k) {
    const int32_t entry = first + lane;
    const int32_t value = __ldcg(s.dst[o.src] + entry);
    const float weight = __ldcg(s.topk_w[o.src] + entry);  // with the dst, not after the checks
    if (entry == o.entry) {
      row = primary;  // row_action found that its dst names `primary`
    } else if (value < 0 && value != kDropped) {
      const int32_t r = -(value + 1) - p.group.rank * p.nvs;
      const int32_t owner = o.src * num_entries(p) + entry;  // R*N <= R*NvS < 2^31
      if (is_row(r, p.nvs) && p.recv_primary[r] == primary && p.recv_src[r] == owner) row = r;
    }
    if (row >= 0) p.recv_w[row] = weight;
  }
  const unsigned rows = __ballot_sync(kFullMask, row >= 0);

  char* recv_x = static_cast<char*>(p.recv_x);
  for (int64_t chunk = 0;;) {
    for (unsigned m = rows; m; m &= m - 1) {
      const int32_t to = __shfl_sync(kFullMask, row, __ffs(m) - 1);
      store_chunk(reinterpret_cast<Vec*>(recv_x + to * p.row_bytes), chunk + lane, row_vecs, v);
    }
    chunk += 32 * kUnroll;
    if (chunk >= row_vecs) break;
    load_chunk(in, chunk + lane, row_vecs, v);
  }
}

// Receiver side, between the entry and the exit barrier, one pass: a warp takes units of
// kRowsPerUnit receive rows, reads their plan at once (one row per lane), zeroes the rows no
// entry owns (recv_x and recv_w), then pulls each primary row's token and writes it to the
// primary and its duplicate rows.
template <typename Vec>
__global__ void __launch_bounds__(kThreads, 2)
    dispatch_pull_kernel(const __grid_constant__ DispatchParams p) {
  __shared__ Sources s;
  if (threadIdx.x < p.group.num_ranks) {
    const int peer = threadIdx.x;
    s.x[peer] = static_cast<const char*>(peer_address(p.group, kMailboxX, peer));
    s.topk_w[peer] = static_cast<const float*>(peer_address(p.group, kMailboxTopkW, peer));
    s.dst[peer] = static_cast<const int32_t*>(peer_address(p.group, kMailboxDst, peer));
  }
  __syncthreads();
  check_own_destinations(p);

  const int lane = threadIdx.x % 32;
  int32_t* scratch = own_area(p.group)->op_scratch;
  const int num_units = (p.nvs + kRowsPerUnit - 1) / kRowsPerUnit;
  for (;;) {
    int unit = 0;
    if (lane == 0) unit = atomicAdd(&scratch[kScratchNextUnit], 1);
    unit = __shfl_sync(kFullMask, unit, 0);
    if (unit >= num_units) break;
    const int32_t row0 = unit * kRowsPerUnit;
    const int32_t row = row0 + lane;
    Owner o{-1, 0};
    RowAction action = kByPrimary;  // lanes past the unit or the last row: nothing to do
    if (lane < kRowsPerUnit && row < p.nvs) {
      o = owner_of(p, row);
      action = row_action(p, s, row, o);
      if (action == kZero) p.recv_w[row] = 0.0f;
    }
    for (unsigned m = __ballot_sync(kFullMask, action == kZero); m; m &= m - 1) {
      zero_row<Vec>(p, row0 + __ffs(m) - 1, lane);
    }
    for (unsigned m = __ballot_sync(kFullMask, action == kPull); m; m &= m - 1) {
      const int i = __ffs(m) - 1;
      const Owner oi{__shfl_sync(kFullMask, o.src, i), __shfl_sync(kFullMask, o.entry, i)};
      pull_token<Vec>(p, s, row0 + i, oi, lane);
    }
  }
  // Every warp of a CTA has stopped taking units when it takes the exit ticket, so the last CTA
  // out may zero the counter for the next call (which the kernel boundary orders).
  if (last_cta_done(&scratch[kScratchCtasDone], false) && threadIdx.x == 0) {
    scratch[kScratchNextUnit] = 0;
  }
}

template <typename Vec>
cudaError_t launch_pull(const DispatchParams& p, cudaStream_t stream) {
  dispatch_pull_kernel<Vec><<<p.num_sms, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// Loaded on every device when a transport context is created (lazy loading while a peer spins
// in a barrier can deadlock).
[[maybe_unused]] const int kPreloaded[] = {
    register_kernel_for_preload(as_symbol(&dispatch_pull_kernel<uint4>)),
    register_kernel_for_preload(as_symbol(&dispatch_pull_kernel<uint32_t>)),
    register_kernel_for_preload(as_symbol(&dispatch_pull_kernel<uint16_t>)),
};

}  // namespace

cudaError_t launch_dispatch(const DispatchParams& p, cudaStream_t stream) {
  cudaError_t err = launch_entry_rendezvous(p.group, kOpDispatch, p.x, p.topk_w, p.dst, stream);
  if (err != cudaSuccess) return err;
  // Rows are byte copies: the widest vector that divides the row size (rows are then aligned,
  // XLA buffers being at least 16-byte aligned).
  if (p.row_bytes % 16 == 0) {
    err = launch_pull<uint4>(p, stream);
  } else if (p.row_bytes % 4 == 0) {
    err = launch_pull<uint32_t>(p, stream);
  } else {
    err = launch_pull<uint16_t>(p, stream);
  }
  if (err != cudaSuccess) return err;
  // No rank may release or reuse its x, topk_w or dst while a peer still reads them.
  return launch_exit_rendezvous(p.group, kOpDispatch, stream);
}

}  // namespace moonep
