"""CUDA backend of `moonep_jax.plan`: one XLA FFI call (`moonep_plan`, xla_ffi/plan.cc).

Per rank, inside `jax.shard_map` over the EP axis. The kernels exchange the `[R, E]` expert counts
with peer stores (no rank centralises anything, no multicast), run the balancing replicated on
every rank, and write each entry's receive-side record straight into the destination rank's
`recv_src` / `recv_primary` result buffers. The plan is bit-identical to the xla reference
(`moonep_jax.plan._plan_xla`).

Expert ids outside `[-1, E)` are dropped like -1 and counted in `Plan.num_invalid_ids`, as in the
xla reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moonep_jax import _ffi
from moonep_jax._cuda import transport
from moonep_jax.config import EPConfig
from moonep_jax.plan_types import Plan


def plan(topk_idx: jax.Array, cfg: EPConfig) -> Plan:
    """The CUDA planner: `topk_idx [S, K] int32` -> this rank's `Plan` (docs/CONTRACT.md).

    Raises:
      NotImplementedError: `cfg` exceeds what the CUDA planner supports (E or R too large).
      ValueError: the mesh's devices cannot be found (see `moonep_jax.bootstrap`).
    """
    _check_supported(cfg)
    typ = jax.typeof(topk_idx)  # results keep the operand's varying-mesh-axis annotation

    def result(*shape):
        return typ.update(shape=shape, dtype=jnp.int32)

    G, R, B, nvs = cfg.num_groups, cfg.num_ranks, cfg.num_slots, cfg.nvs
    call = jax.ffi.ffi_call(
        "moonep_plan",
        (result(cfg.num_entries), result(G), result(G, 2), result(R, B), result(nvs), result(nvs),
         result(1)))
    dst, cu_seqlens, zero_fill, experts_to_copy, recv_src, recv_primary, num_invalid_ids = call(
        topk_idx,
        num_experts=np.int64(cfg.num_experts),
        top_k=np.int64(cfg.top_k),
        tokens_per_rank=np.int64(cfg.tokens_per_rank),
        num_ranks=np.int64(R),
        num_slots=np.int64(B),
        token_padding=np.int64(cfg.token_padding),
        nvs=np.int64(nvs),
        mesh_devices=transport.mesh_devices(cfg),
        timeout_ns=np.int64(round(cfg.cuda.timeout_s * 1e9)),
    )
    return Plan(dst=dst, cu_seqlens=cu_seqlens, zero_fill=zero_fill,
                experts_to_copy=experts_to_copy, recv_src=recv_src, recv_primary=recv_primary,
                num_invalid_ids=num_invalid_ids)


def _check_supported(cfg: EPConfig) -> None:
    lib = _ffi.lib()
    if cfg.num_experts > lib.MAX_EXPERTS:
        raise NotImplementedError(
            f"`moonep_jax.plan` (implementation='cuda'): the CUDA planner supports "
            f"`EPConfig.num_experts` <= {lib.MAX_EXPERTS}; got E={cfg.num_experts}. "
            "Use implementation='xla'.")
    if cfg.num_ranks > lib.MAX_RANKS:
        raise NotImplementedError(
            f"`moonep_jax.plan` (implementation='cuda'): the CUDA transport supports "
            f"`EPConfig.num_ranks` <= {lib.MAX_RANKS}; got R={cfg.num_ranks}. "
            "Use implementation='xla'.")
