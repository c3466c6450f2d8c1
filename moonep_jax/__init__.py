"""moonep_jax: MoonEP-style perfectly balanced expert parallelism for JAX.

Every op runs per EP rank inside `jax.shard_map` over `EPConfig.axis_name`:

    plan = moonep_jax.plan(topk_idx, cfg)
    recv_x, recv_w, plan = moonep_jax.dispatch(x, topk_w, plan, cfg)
    w_slots = moonep_jax.prefetch(w_local, plan, cfg)
    y = moonep_jax.grouped_matmul(recv_x, w_local, w_slots, plan, cfg)
    out = moonep_jax.combine(y, plan, cfg)
    out = moonep_jax.moe_ffn(x, topk_idx, topk_w, params, cfg)   # all of it, SwiGLU experts
"""

from moonep_jax import routing
from moonep_jax._cuda.transport import TransportError, bootstrap, check_transport_errors
from moonep_jax._impl import resolved_implementation
from moonep_jax.combine import combine
from moonep_jax.config import DROPPED, CudaOptions, EPConfig
from moonep_jax.dispatch import dispatch
from moonep_jax.experts import grouped_matmul, prefetch, reduce_grad
from moonep_jax.layer import moe_ffn
from moonep_jax.plan import plan
from moonep_jax.plan_types import Plan

__all__ = [
    "DROPPED", "CudaOptions", "EPConfig", "Plan", "TransportError", "bootstrap",
    "check_transport_errors", "combine", "dispatch",
    "grouped_matmul", "moe_ffn", "plan", "prefetch", "reduce_grad", "resolved_implementation",
    "routing",
]
