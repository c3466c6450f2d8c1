// moonep_dispatch: zero-copy scatter of token rows into the destination ranks' receive buffers,
// plus the plan decoding and the entry/exit rendezvous shared by every zero-copy op (combine,
// prefetch, reduce_grad).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/constants.h"
#include "kernels/transport.cuh"

namespace moonep {

// ErrorRecord code for plan data that decodes out of range (a dst naming a rank outside the
// group, a receive row whose primary is not a row, a slot naming an expert outside [-1, E)). The
// entry or row is skipped, never written through; the first one is recorded with its value.
// NOTE: outside transport.cuh's ErrorCode range on purpose, so that the two never collide.
constexpr uint32_t kErrorBadPlanData = 16;


#ifdef __CUDACC__

__device__ inline void report_bad_plan_data(const GroupView& g, int op_slot, int64_t value,
                                            const char* what) {
  record_error(g, kErrorBadPlanData, current_epoch(g, op_slot), -1, value, what);
}

// An entry's destination rank and row, decoded from Plan.dst (`dest * nvs + row`, or
// `-(dest * nvs + row) - 1` for a duplicate); dest == -1 when the entry is dropped or names a
// rank outside the group (reported as bad plan data).
struct Destination {
  int32_t dest;
  int32_t row;
  bool primary;
};

__device__ __forceinline__ Destination decode_destination(const GroupView& g, int op_slot,
                                                          int32_t v, int32_t nvs) {
  if (v == kDropped) return {-1, 0, false};
  const int32_t raw = v >= 0 ? v : -v - 1;  // v > kDropped, so -v - 1 cannot overflow
  const int32_t dest = raw / nvs;
  if (dest >= g.num_ranks) {
    report_bad_plan_data(g, op_slot, v, "plan.dst names a rank outside the group");
    return {-1, 0, false};
  }
  return {dest, raw - dest * nvs, v >= 0};
}

#endif  // __CUDACC__

// A kernel's address as the `const void*` that CUDA's runtime API (and the preload list) takes.
template <typename Kernel>
const void* as_symbol(Kernel* kernel) {
  return reinterpret_cast<const void*>(kernel);
}

// Rendezvous of a zero-copy op `op_slot` (an OpSlot). Entry: advance the op's epoch, publish up
// to two buffer addresses into the op's mailbox slots 0 and 1 (nullptr: not published), barrier
// (the op's barrier slot 0); afterwards every peer's addresses are readable with
// `peer_address(g, mailbox_slot(op_slot, i), peer)`. Exit: barrier (slot 1), so that no buffer
// is released or reused while a peer still reads or writes it.
cudaError_t launch_entry_rendezvous(const GroupView& group, int op_slot, const void* address0,
                                    const void* address1, cudaStream_t stream);
cudaError_t launch_exit_rendezvous(const GroupView& group, int op_slot, cudaStream_t stream);

struct DispatchParams {
  GroupView group;              // this rank's EP group (rank, peers' transport areas, timeout)
  const void* x;                // [num_tokens, row_bytes] this rank's token rows
  const float* topk_w;          // [num_tokens * top_k] route weight per entry
  const int32_t* dst;           // [num_tokens * top_k] Plan.dst (encoded destination per entry)
  const int32_t* recv_src;      // [nvs] Plan.recv_src, -1 = padding or unused row
  const int32_t* recv_primary;  // [nvs] Plan.recv_primary, the row holding the same token's row
  void* recv_x;                 // [nvs, row_bytes] result: received rows (XLA result buffer)
  float* recv_w;                // [nvs] result: received route weights (XLA result buffer)
  int64_t row_bytes;            // H * element size; rows are byte copies
  int32_t num_tokens;           // S
  int32_t top_k;                // K <= kMaxTopK
  int32_t nvs;                  // NvS receive rows per rank
  int32_t num_sms;              // CTAs of the data kernels
};

// Every rank publishes its recv_x / recv_w addresses, barriers, then sends each token's row once
// per destination rank (its primary entries) straight into the destination's recv_x and each
// entry's weight into the destination's recv_w; exit barrier; then fills its own duplicate rows
// from their primary rows and zeroes rows that no entry owns (recv_src == -1) in both results.
// Launches only: no host synchronisation, allocation or host-side state (CUDA-graph safe).
cudaError_t launch_dispatch(const DispatchParams& params, cudaStream_t stream);

}  // namespace moonep
