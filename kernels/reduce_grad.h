// moonep_reduce_grad: each home rank adds its replicas' weight gradients, read in place from the
// ranks that computed them, to its local expert gradients.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/transport.cuh"

namespace moonep {

struct ReduceGradParams {
  GroupView group;                 // this rank's EP group
  const float* g_partial;          // [experts_per_rank, expert_elems] fp32 first term per expert
  const float* g_slots;            // [num_slots, expert_elems] this rank's replica-slot grads
                                   // (XLA operand buffer, read by the home ranks)
  const int32_t* experts_to_copy;  // [num_ranks, num_slots] Plan.experts_to_copy, -1 = unused
  void* g;                         // [experts_per_rank, expert_elems] result, fp32 or bf16
  bool g_is_bf16;
  int64_t expert_elems;            // D0 * D1
  int32_t experts_per_rank;        // epn
  int32_t num_slots;               // B
  int32_t num_sms;                 // CTAs of the reduce kernel
};

// For every expert e of this rank that some (source rank r, slot b) replicates:
// g[e] = g_partial[e], then for (r, b) ascending with experts_to_copy[r, b] == e,
// g[e] = g[e] + g_slots of rank r [b], in fp32, rounded once to g's dtype at the end
// (docs/CONTRACT.md; bitwise equal to the xla reference). Experts no slot replicates are not
// touched: `g` holds their gradient already (the caller aliases it; g_partial may alias g when g
// is fp32). Publishes g_slots' address, barriers, reads the peers' slot gradients in place over
// NVLink, then an exit barrier keeps every g_slots alive until all readers are done. Slots
// naming an expert outside [-1, E) are skipped and reported as bad plan data. Launches only.
cudaError_t launch_reduce_grad(const ReduceGradParams& params, cudaStream_t stream);

}  // namespace moonep
