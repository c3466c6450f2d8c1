// Integer division rounded up, for tile and block counts on the host and the device.
#pragma once

#include <cuda_runtime.h>

namespace moonep {

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

}  // namespace moonep
