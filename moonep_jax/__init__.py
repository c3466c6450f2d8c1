"""moonep_jax: MoonEP-style perfectly balanced expert parallelism for JAX.

Every op runs per EP rank inside `jax.shard_map` over `EPConfig.axis_name`:

    plan = moonep_jax.plan(topk_idx, cfg)
    recv_x, recv_w = moonep_jax.dispatch(x, topk_w, plan, cfg)
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

# The framework modules import Flax / Equinox, which the core does not need: they load on first
# attribute access (`moonep_jax.flax.MoE` after a plain `import moonep_jax`).
_FRAMEWORK_MODULES = ("flax", "equinox")


def __getattr__(name: str):
    if name in _FRAMEWORK_MODULES:
        import importlib

        return importlib.import_module(f"moonep_jax.{name}")
    raise AttributeError(f"module 'moonep_jax' has no attribute {name!r}")


__all__ = [
    "DROPPED", "CudaOptions", "EPConfig", "Plan", "TransportError", "bootstrap",
    "check_transport_errors", "combine", "dispatch",
    "grouped_matmul", "moe_ffn", "plan", "prefetch", "reduce_grad", "resolved_implementation",
    "routing",
]
