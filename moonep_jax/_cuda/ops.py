"""The CUDA implementation (`implementation="cuda"`): one function per backend op, with the names
and signatures of docs/CONTRACT.md, the same as `moonep_jax._xla`'s. Each is one XLA FFI call (or
two, for the planner) defined in its area's module; this module is the table."""

from moonep_jax._cuda.comm import combine, combine_weights, dispatch, prefetch, reduce_grad
from moonep_jax._cuda.grouped_matmul import grouped_matmul, grouped_matmul_dw, grouped_matmul_dx
from moonep_jax._cuda.plan import plan

__all__ = ["combine", "combine_weights", "dispatch", "grouped_matmul", "grouped_matmul_dw",
           "grouped_matmul_dx", "plan", "prefetch", "reduce_grad"]
