// moonep_prefetch: pull this rank's replica slots straight from the home ranks' expert weights,
// for several weight arrays (a layer's projections) in one rendezvous and one copy kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/transport.cuh"

namespace moonep {

// Weight arrays one prefetch copies: each publishes its w_local into one of the op's mailbox
// slots in the entry rendezvous.
constexpr int kMaxPrefetchWeights = kMailboxesPerOp;

// One weight array of a prefetch: every expert is `expert_bytes` of plain bytes.
struct PrefetchWeight {
  const void* w_local;   // [experts_per_rank, expert_bytes] this rank's expert weights
  void* w_slots;         // [num_slots, expert_bytes] result (XLA result buffer)
  int64_t expert_bytes;  // product of the trailing dims times the element size; a multiple of 2
};

struct PrefetchParams {
  GroupView group;                                // this rank's EP group
  PrefetchWeight weights[kMaxPrefetchWeights];    // [0, num_weights) used
  int32_t num_weights;                            // 1 <= num_weights <= kMaxPrefetchWeights
  const int32_t* experts_to_copy;                 // [num_ranks, num_slots] Plan.experts_to_copy
  int32_t experts_per_rank;                       // epn, the same for every weight array
  int32_t num_slots;                              // B
  int32_t num_sms;                                // CTAs of the copy kernel
  bool zero_unused_slots;                         // write zeros into unused slots (else untouched)
};

// For every weight array w: w_slots[b] = w_local of the home rank of e = experts_to_copy[rank, b],
// row e % epn, exactly; unused slots (-1) and slots naming an expert outside [0, R * epn)
// (reported as bad plan data) are zero when `zero_unused_slots`, else untouched. Publishes every
// w_local's address, barriers once, copies every (array, slot) in one kernel (remote reads over
// NVLink), then one exit barrier keeps every w_local alive until all readers are done. Launches
// only; returns cudaErrorInvalidValue for a num_weights outside [1, kMaxPrefetchWeights].
cudaError_t launch_prefetch(const PrefetchParams& params, cudaStream_t stream);

}  // namespace moonep
