// moonep_reduce_grad: each home rank adds its replicas' weight gradients, read in place from the
// ranks that computed them, to its local expert gradients.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/transport.cuh"

namespace moonep {

struct ReduceGradParams {
  GroupView group;                 // this rank's EP group
  const float* g_local;            // [experts_per_rank, expert_elems] this rank's local grads
  const float* g_slots;            // [num_slots, expert_elems] this rank's replica-slot grads
                                   // (XLA operand buffer, read by the home ranks)
  const int32_t* experts_to_copy;  // [num_ranks, num_slots] Plan.experts_to_copy, -1 = unused
  float* g;                        // [experts_per_rank, expert_elems] result
  int64_t expert_elems;            // D0 * D1
  int32_t experts_per_rank;        // epn
  int32_t num_slots;               // B
  int32_t num_sms;                 // CTAs of the reduce kernel
};

// g[e] = g_local[e]; then for (source rank r, slot b) ascending with experts_to_copy[r, b] == this
// rank's expert e: g[e] = g[e] + g_slots of rank r [b], in fp32 (docs/CONTRACT.md; bitwise equal
// to the xla reference). Publishes g_slots' address, barriers, reads the peers' slot gradients in
// place over NVLink, then an exit barrier keeps every g_slots alive until all readers are done.
// Slots naming an expert outside [-1, E) are skipped and reported as bad plan data. Launches only.
cudaError_t launch_reduce_grad(const ReduceGradParams& params, cudaStream_t stream);

}  // namespace moonep
