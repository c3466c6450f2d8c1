// Launcher of the CuTe DSL `zero_rows` kernel (kernels/cutedsl/zero_rows.py): zero the padding
// row ranges of a `[num_rows, row_elems]` bf16 buffer in place.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moonep {

struct ZeroRowsParams {
  void* buf;                   // [num_rows, row_elems] bf16, row-major, 16-byte aligned
  int32_t num_rows;            // NvS
  int32_t row_elems;           // H; must be a multiple of 8 (16-byte stores)
  const int32_t* zero_fill;    // [num_groups, 2]: (first row, number of rows) per group
  int32_t num_groups;          // G
};

// Loads the exported kernel on every device (once per process). Call at bootstrap.
cudaError_t load_zero_rows();

// Zeroes every range of `zero_fill`, clamped to [0, num_rows), on `stream`'s device.
// Returns cudaErrorInvalidValue for a bad `row_elems` or a misaligned `buf`.
cudaError_t launch_zero_rows(const ZeroRowsParams& params, cudaStream_t stream);

}  // namespace moonep
