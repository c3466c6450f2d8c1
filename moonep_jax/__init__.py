"""moonep_jax: MoonEP-style perfectly balanced expert parallelism for JAX."""

from moonep_jax.config import DROPPED, CudaOptions, EPConfig
from moonep_jax.plan_types import Plan
from moonep_jax._impl import resolved_implementation

__all__ = ["DROPPED", "CudaOptions", "EPConfig", "Plan", "resolved_implementation"]
