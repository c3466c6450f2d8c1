// moonep_dispatch: zero-copy scatter of token rows into the destination ranks' receive buffers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/constants.h"
#include "kernels/transport.cuh"

namespace moonep {

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
