// moonep_dispatch: every receiver pulls each token it receives once per call from the token's
// rank and writes it to all its receive rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/constants.h"
#include "kernels/transport.cuh"

namespace moonep {

struct DispatchParams {
  GroupView group;              // this rank's EP group (rank, peers' transport areas, timeout)
  const void* x;                // [num_tokens, row_bytes] this rank's token rows (published)
  const float* topk_w;          // [num_tokens * top_k] route weight per entry (published)
  const int32_t* dst;           // [num_tokens * top_k] Plan.dst (published: receivers read it)
  const int32_t* recv_src;      // [nvs] Plan.recv_src, -1 = padding or unused row
  const int32_t* recv_primary;  // [nvs] Plan.recv_primary, the row holding the same token's row
  void* recv_x;                 // [nvs, row_bytes] result: received rows (XLA result buffer)
  float* recv_w;                // [nvs] result: received route weights (XLA result buffer)
  int64_t row_bytes;            // H * element size; rows are byte copies
  int32_t num_tokens;           // S
  int32_t top_k;                // K <= kMaxTopK
  int32_t nvs;                  // NvS receive rows per rank
  int32_t num_sms;              // CTAs of the data kernel
};

// Every rank publishes its x, topk_w and dst, barriers, then walks its own receive rows in one
// pass: for each primary row (recv_primary[row] == row) it reads the token's row ONCE from the
// source rank that recv_src names and writes it to the primary row and to every duplicate row
// that the source's dst of the token's K entries names on this rank, with each row's weight;
// rows that no entry owns (recv_src == -1) are zeroed in recv_x and recv_w. Exit barrier (no
// rank releases its operands while a peer reads them). Every receive row is written exactly
// once. A row whose plan disagrees with the source's dst (or whose primary does) is zeroed
// and reported as bad plan data, as is a dst naming a rank outside the group (by its own rank).
// Launches only: no host synchronisation, allocation or host-side state (CUDA-graph safe).
cudaError_t launch_dispatch(const DispatchParams& params, cudaStream_t stream);

}  // namespace moonep
