"""CuTe DSL kernel `zero_rows`: zero the padding row ranges of a `[NvS, H]` bf16 buffer in place.

Group `g` owns the rows `[zero_fill[g, 0], zero_fill[g, 0] + zero_fill[g, 1])` (the plan's
`zero_fill [G, 2]`, `(first padding row, number of padding rows)`). One CTA per group zeroes its
range with 16-byte stores. Ranges are clamped to `[0, NvS)` so a corrupt plan cannot write out of
bounds.
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

THREADS = 256
# 8 bf16 = 16 bytes per store; the launcher requires H % 8 == 0.
ELEMS_PER_STORE = 8


@cute.kernel
def zero_rows_kernel(buf: cute.Tensor, zero_fill: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    group, _, _ = cute.arch.block_idx()
    num_rows = cute.size(buf, mode=[0])
    first = cutlass.min(cutlass.max(zero_fill[group, 0], 0), num_rows)
    end = cutlass.min(first + cutlass.max(zero_fill[group, 1], 0), num_rows)
    # ((1, 8), (NvS, H/8)): mode 0 is one 16-byte vector, mode 1 indexes (row, vector column).
    vectors = cute.zipped_divide(buf, (1, ELEMS_PER_STORE))
    num_vector_cols = cute.size(vectors, mode=[1, 1])
    zeros = cute.make_rmem_tensor(cute.make_layout((1, ELEMS_PER_STORE)), buf.element_type)
    zeros.fill(0)
    for row in range(first, end):
        for col in range(tidx, num_vector_cols, THREADS):
            cute.autovec_copy(zeros, vectors[(None, (row, col))])


@cute.jit
def zero_rows(buf: cute.Tensor, zero_fill: cute.Tensor, stream: cuda.CUstream):
    num_groups = cute.size(zero_fill, mode=[0])
    zero_rows_kernel(buf, zero_fill).launch(
        grid=(num_groups, 1, 1), block=(THREADS, 1, 1), stream=stream)


def compile_zero_rows(options: str):
    """Compiles `zero_rows` for `buf [NvS, H]` bf16 (H % 8 == 0, 16-byte aligned), `zero_fill [G, 2]`."""
    buf = make_fake_compact_tensor(
        cutlass.BFloat16, (cute.sym_int32(), cute.sym_int32(divisibility=ELEMS_PER_STORE)),
        stride_order=(1, 0), assumed_align=16)
    zero_fill = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(), 2), stride_order=(1, 0),
                                         assumed_align=4)
    return cute.compile(zero_rows, buf, zero_fill, make_fake_stream(), options=options)


# function_prefix -> compile function; build_aot.py exports each as <prefix>.{h,o}.
EXPORTS = {"moonep_zero_rows": compile_zero_rows}
