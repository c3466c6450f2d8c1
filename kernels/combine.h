// moonep_combine: the rank that holds a token's rows sums them (stage 1) and pushes that partial
// row to the token's home (or the home reads a lone row in place), which sums them (stage 2); or,
// without staging slots, the home reads every row in place and does both stages.
// moonep_combine_weights: zero-copy gather of every entry's weight, read in place from its owner.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/transport.cuh"

namespace moonep {

enum class RowType : int32_t { kBF16, kF32 };

struct CombineParams {
  GroupView group;            // this rank's EP group
  const void* y;              // [nvs, hidden] this rank's expert outputs (XLA operand buffer)
  const int32_t* dst;         // [num_tokens * top_k] Plan.dst (peers read it: XLA operand)
  void* out;                  // [num_tokens, hidden] result, y's dtype
  void* staging;              // [num_tokens, staging_slots, hidden] y's dtype (XLA result
                              // buffer): slot j of token t receives the stage-1 partial of the
                              // j-th other rank (in the order of their lowest k) that holds two
                              // or more of t's rows
  int32_t staging_slots;      // min(R - 1, K / 2) (a token has at most that many remote ranks
                              // holding two or more of its rows), the same on every rank: the
                              // owners sum; 0: the home reads every row in place
  RowType row_type;           // dtype of y and out
  int32_t hidden;             // H
  int32_t num_tokens;         // S
  int32_t top_k;              // K <= kMaxTopK
  int32_t nvs;                // NvS
  int32_t num_sms;            // CTAs of the data kernel
};

// out[t] = cast( sum over destination ranks d of t's entries, ordered by their lowest k, of
// fp32(cast( sum over k ascending with dest_k == d of fp32(y_d[row_k]) )) ), every sum starting at
// +0.0 (docs/CONTRACT.md); dropped entries, and entries that decode out of range (reported as bad
// plan data), contribute nothing. With staging slots, one row per (token, other destination rank)
// crosses the link: entry barrier (publishes staging, dst and y); each rank reads its peers' dst
// and, for each of their tokens with two or more entries on it, sums those rows (stage 1) and
// stores the partial into the home's staging; middle barrier; each rank sums its tokens (stage 2)
// from the staged partials, the single rows of the other groups read in place from their owners,
// and the stage 1 of its own rows; exit barrier (keeps every y alive until its readers are done).
// Without: entry barrier, the home reads every row in place, exit barrier. Launches only
// (CUDA-graph safe).
cudaError_t launch_combine(const CombineParams& params, cudaStream_t stream);

struct CombineWeightsParams {
  GroupView group;            // this rank's EP group
  const float* recv_w;        // [nvs] this rank's received-weight cotangents (XLA operand buffer)
  const int32_t* dst;         // [num_entries] Plan.dst
  float* topk_w;              // [num_entries] result: d topk_w[t, k] = d recv_w of entry (t, k)'s
                              // own row (duplicates included); 0 for dropped entries and
                              // entries that decode out of range (reported as bad plan data)
  int32_t num_entries;        // S * K
  int32_t nvs;                // NvS
  int32_t num_sms;            // CTAs of the data kernel
};

cudaError_t launch_combine_weights(const CombineWeightsParams& params, cudaStream_t stream);

}  // namespace moonep
