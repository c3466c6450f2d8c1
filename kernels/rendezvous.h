// What every zero-copy op shares: the entry/exit rendezvous (epoch, address publication,
// barriers), the decoding of Plan.dst, and the report of plan data that decodes out of range.
// Included by dispatch, combine, prefetch, reduce_grad and the grouped GEMM's overflow path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/constants.h"
#include "kernels/transport.cuh"

namespace moonep {

#ifdef __CUDACC__

// Plan data that decodes out of range (a dst naming a rank outside the group, a receive row whose
// primary is not a row, a slot naming an expert outside [-1, E)): the entry or row is skipped,
// never written through, and the first one is recorded (kErrBadPlanData) with its value; the host
// reads it with `moonep_jax.check_transport_errors()`.
__device__ inline void report_bad_plan_data(const GroupView& g, int op_slot, int64_t value,
                                            const char* what) {
  record_error(g, kErrBadPlanData, current_epoch(g, op_slot), -1, value, what);
}

// An entry's destination rank and row, decoded from Plan.dst (`dest * nvs + row`, or
// `-(dest * nvs + row) - 1` for a duplicate); dest == -1 when the entry is dropped or names a
// rank outside the group (reported as bad plan data).
struct Destination {
  int32_t dest;
  int32_t row;
  bool primary;
};

// `report`: whether a rank outside the group is recorded as bad plan data (false where another
// rank's plan is read: its own rank records it).
__device__ __forceinline__ Destination decode_destination(const GroupView& g, int op_slot,
                                                          int32_t v, int32_t nvs,
                                                          bool report = true) {
  if (v == kDropped) return {-1, 0, false};
  const int32_t raw = v >= 0 ? v : -v - 1;  // v > kDropped, so -v - 1 cannot overflow
  const int32_t dest = raw / nvs;
  if (dest >= g.num_ranks) {
    if (report) report_bad_plan_data(g, op_slot, v, "plan.dst names a rank outside the group");
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

// The buffer addresses one call of a zero-copy op publishes, one per mailbox slot of the op;
// nullptr: not published. Bounded by the op's kMailboxesPerOp slots.
struct PublishedAddresses {
  const void* address[kMailboxesPerOp];
};

// Rendezvous of a zero-copy op `op_slot` (an OpSlot). Entry: advance the op's epoch, publish
// `addresses.address[i]` into the op's mailbox slot i (i < kMailboxesPerOp), barrier (the op's
// barrier slot 0); afterwards every peer's addresses are readable with
// `peer_address(g, mailbox_slot(op_slot, i), peer)` (translated into this process's mapping of
// a peer process's pool). Middle (ops of two phases): barrier (slot 2), after which every peer's
// first-phase writes are visible; the published buffers stay valid. Exit: barrier (slot 1), so
// that no buffer is released or reused while a peer still reads or writes it. A group of one
// (R = 1) has no peer: its entry only advances the epoch and publishes, and its middle and exit
// are not launched. Defined in kernels/rendezvous.cu.
cudaError_t launch_entry_rendezvous(const GroupView& group, int op_slot,
                                    const PublishedAddresses& addresses, cudaStream_t stream);
// The ops that publish up to three addresses, into mailbox slots 0, 1 and 2.
inline cudaError_t launch_entry_rendezvous(const GroupView& group, int op_slot,
                                           const void* address0, const void* address1,
                                           const void* address2, cudaStream_t stream) {
  return launch_entry_rendezvous(group, op_slot, PublishedAddresses{{address0, address1, address2}},
                                 stream);
}
inline cudaError_t launch_entry_rendezvous(const GroupView& group, int op_slot,
                                           const void* address0, const void* address1,
                                           cudaStream_t stream) {
  return launch_entry_rendezvous(group, op_slot, address0, address1, nullptr, stream);
}
cudaError_t launch_middle_rendezvous(const GroupView& group, int op_slot, cudaStream_t stream);
cudaError_t launch_exit_rendezvous(const GroupView& group, int op_slot, cudaStream_t stream);

}  // namespace moonep
