// moonep_prefetch: pull this rank's replica slots straight from the home ranks' expert weights.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/transport.cuh"

namespace moonep {

struct PrefetchParams {
  GroupView group;                 // this rank's EP group
  const void* w_local;             // [experts_per_rank, expert_bytes] this rank's expert weights
  const int32_t* experts_to_copy;  // [num_ranks, num_slots] Plan.experts_to_copy, -1 = unused
  void* w_slots;                   // [num_slots, expert_bytes] result (XLA result buffer)
  int64_t expert_bytes;            // D0 * D1 * element size; experts are byte copies
  int32_t experts_per_rank;        // epn
  int32_t num_slots;               // B
  int32_t num_sms;                 // CTAs of the copy kernel
  bool zero_unused_slots;          // write zeros into unused slots (else leave them untouched)
};

// w_slots[b] = w_local of the home rank of e = experts_to_copy[rank, b], row e % epn, exactly;
// unused slots (-1) and slots naming an expert outside [0, R * epn) (reported as bad plan data)
// are zero when `zero_unused_slots`, else untouched. Publishes w_local's address, barriers, copies (remote reads over NVLink), then an
// exit barrier keeps every w_local alive until all readers are done. Launches only.
cudaError_t launch_prefetch(const PrefetchParams& params, cudaStream_t stream);

}  // namespace moonep
