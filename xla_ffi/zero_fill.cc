// XLA FFI handler `moonep_zero_rows`: zero the padding row ranges of a bf16 `[NvS, H]` buffer.
//
// The Python side aliases operand 0 to result 0 (`input_output_aliases={0: 0}`), so the kernel
// zeroes the result buffer in place and every other row keeps the operand's value.
#include <cuda_runtime.h>

#include <string>

#include "kernels/zero_fill.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error ZeroRowsImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> buf,
                        ffi::Buffer<ffi::S32> zero_fill, ffi::ResultBuffer<ffi::BF16> out) {
  auto buf_dims = buf.dimensions();
  auto zero_fill_dims = zero_fill.dimensions();
  if (buf_dims.size() != 2 || out->dimensions().size() != 2 ||
      out->element_count() != buf.element_count()) {
    return ffi::Error::InvalidArgument(
        "moonep_zero_rows: `buf` and the result must both have shape [NvS, H].");
  }
  if (zero_fill_dims.size() != 2 || zero_fill_dims[1] != 2) {
    return ffi::Error::InvalidArgument("moonep_zero_rows: `zero_fill` must have shape [G, 2].");
  }
  if (buf_dims[1] % 8 != 0) {
    return ffi::Error::InvalidArgument("moonep_zero_rows: H must be a multiple of 8; got H=" +
                                       std::to_string(buf_dims[1]) + ".");
  }
  moonep::ZeroRowsParams params{
      .buf = out->untyped_data(),
      .num_rows = static_cast<int32_t>(buf_dims[0]),
      .row_elems = static_cast<int32_t>(buf_dims[1]),
      .zero_fill = zero_fill.typed_data(),
      .num_groups = static_cast<int32_t>(zero_fill_dims[0]),
  };
  if (out->untyped_data() != buf.untyped_data()) {
    // XLA could not alias the operand with the result: start from a copy of the operand.
    cudaError_t e = cudaMemcpyAsync(out->untyped_data(), buf.untyped_data(), buf.size_bytes(),
                                    cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) {
      return ffi::Error::Internal(std::string("moonep_zero_rows: copy: ") + cudaGetErrorString(e));
    }
  }
  if (cudaError_t e = moonep::launch_zero_rows(params, stream); e != cudaSuccess) {
    return ffi::Error::Internal(std::string("moonep_zero_rows: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

}  // namespace

// Not kCmdBufferCompatible, like the grouped GEMM: the CuTe DSL wrapper is not capture-safe.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepZeroRows, ZeroRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // buf [NvS, H], aliased to out
                                  .Arg<ffi::Buffer<ffi::S32>>()   // zero_fill [G, 2]
                                  .Ret<ffi::Buffer<ffi::BF16>>());  // out [NvS, H]
