// tokens_per_expert: per-rank histogram of routed expert ids (ids -1 are dropped entries).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moonep {

struct HistogramParams {
  const int32_t* topk_idx;       // [num_entries] expert id per routed entry, -1 = dropped
  int32_t* tokens_per_expert;    // [num_experts] output counts
  int32_t* num_invalid;          // [1] output: entries with an id outside [-1, num_experts)
  int64_t num_entries;
  int32_t num_experts;
  int32_t num_sms;               // CTAs to use
};

// Counts ids in [0, num_experts); -1 is ignored; any other id is counted in num_invalid and
// never used as an index. Writes every output element (no pre-zeroing needed by the caller).
cudaError_t launch_histogram(const HistogramParams& params, cudaStream_t stream);

}  // namespace moonep
