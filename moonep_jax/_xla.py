"""The pure-JAX reference implementation (`implementation="xla"`): one function per backend op,
with the names and signatures of docs/CONTRACT.md, the same as `moonep_jax._cuda.ops`'s. Each is
defined next to its public op, whose differentiation rule is written with it; this module is
the table."""

from moonep_jax.combine import _combine_weights_xla as combine_weights
from moonep_jax.combine import _combine_xla as combine
from moonep_jax.dispatch import _dispatch_xla as dispatch
from moonep_jax.experts import _grouped_matmul_dw_xla as grouped_matmul_dw
from moonep_jax.experts import _grouped_matmul_dx_xla as grouped_matmul_dx
from moonep_jax.experts import _grouped_matmul_xla as grouped_matmul
from moonep_jax.experts import _prefetch_xla as prefetch
from moonep_jax.experts import _reduce_grad_xla as reduce_grad
from moonep_jax.plan import _plan_xla as plan

__all__ = ["combine", "combine_weights", "dispatch", "grouped_matmul", "grouped_matmul_dw",
           "grouped_matmul_dx", "plan", "prefetch", "reduce_grad"]
