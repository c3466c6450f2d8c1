// moonep_combine / moonep_combine_weights: zero-copy gather of every entry's row (or weight) from
// the rank that computed it, read in place from the owner's buffer.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/transport.cuh"

namespace moonep {

enum class RowType : int32_t { kBF16, kF32 };

struct CombineParams {
  GroupView group;            // this rank's EP group
  const void* y;              // [nvs, hidden] this rank's expert outputs (XLA operand buffer)
  const int32_t* dst;         // [num_tokens * top_k] Plan.dst
  void* out;                  // [num_tokens, hidden] result, y's dtype
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
// plan data), contribute nothing. Publishes y's address, barriers, reads the owners' rows in place
// over NVLink, then an exit barrier keeps every y alive until all readers are done. Launches only
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
