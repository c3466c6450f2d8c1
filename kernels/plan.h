// The CUDA MoonEP planner (generation 1; moonep_algorithm.md §3, docs/CONTRACT.md), bit-identical to
// the xla reference `moonep_jax/plan.py::_plan_xla`. Knows nothing of XLA: the handler
// (xla_ffi/plan.cc) fills PlanParams and calls launch_plan on XLA's stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/transport.cuh"

namespace moonep {

// The local entries are cut into token-aligned chunks of about kPlanChunkEntries entries: one
// CTA each for the histogram and for the routing (the grid of both kernels), and one [E] row of
// per-chunk counts in the planner scratch, so at most min(kMaxPlanChunks, kPlanChunkCountInts / E)
// chunks.
constexpr int kMaxPlanChunks = 256;
constexpr int kPlanChunkEntries = 512;
constexpr int kPlanChunkCountInts = 64 * 1024;

struct PlanParams {
  // Sizes (per rank; DESIGN §2).
  int num_experts;    // E <= kMaxExperts
  int top_k;          // K <= kMaxTopK (kernels/constants.h)
  int num_tokens;     // S
  int num_slots;      // B
  int token_padding;  // tp
  int nvs;            // NvS
  GroupView group;    // rank, R and every rank's PeerArea
  // Operand.
  const int32_t* topk_idx;  // [S, K]
  // Results (the Plan fields, docs/CONTRACT.md).
  int32_t* dst;              // [N]
  int32_t* cu_seqlens;       // [E + B]
  int32_t* zero_fill;        // [E + B, 2]
  int32_t* experts_to_copy;  // [R, B]
  int32_t* recv_src;         // [NvS]
  int32_t* recv_primary;     // [NvS]
  int32_t* num_invalid_ids;  // [1] entries of topk_idx with ids outside [-1, E)
};

// Enqueues the planner on `stream`: two kernels, each ending with a cross-GPU barrier (none in a
// group of one) in its last CTA to finish. Every rank of the group must call it with the same sizes. Expert ids outside
// [-1, E) are dropped like -1 and counted in num_invalid_ids, exactly as the xla reference does.
cudaError_t launch_plan(const PlanParams& params, cudaStream_t stream);

// What launch_plan enqueues for these sizes, counted by capturing it into a CUDA graph on the
// current device (nothing runs): kernel nodes and any other nodes. For tests/test_plan_cuda.py.
cudaError_t plan_graph_nodes(int num_experts, int top_k, int num_tokens, int num_ranks,
                             int* kernel_nodes, int* other_nodes);

}  // namespace moonep
