"""Grouped GEMMs on the GPU: the CuTe DSL kernels behind `moonep_gmm_fwd`, `_dx` and `_dw`.

Rows of the `[NvS, .]` activations are grouped by `plan.cu_seqlens [G]` (G = E + B); group
`g < E` multiplies by this rank's `w_local[g - rank*epn]`, group `g >= E` by `w_slots[g - E]`.
bf16 operands, fp32 accumulation, rows past `cu_seqlens[-1]` written zero (CONTRACT.md
"grouped_matmul"). Inference overflow (a group of another rank's expert, `B < epn`) is not
supported by these kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moonep_jax import _ffi
from moonep_jax.config import EPConfig
from moonep_jax.plan_types import Plan

# Rows per M tile of the ragged-M kernels (kernels/grouped_gemm.h: kGmmTileM).
TILE_M = 128
# TMA needs every row stride to be a multiple of 16 bytes.
ALIGN_ELEMS = 8


def max_tiles(num_rows: int, num_groups: int) -> int:
    """Entries of the tile-table scratch (kernels/grouped_gemm.h: gmm_max_tiles)."""
    return -(-num_rows // TILE_M) + num_groups + 1


def _check(name: str, arrays: dict[str, jax.Array], cfg: EPConfig | None = None) -> None:
    _ffi.lib()  # raises with the reason when the extension is missing
    if cfg is not None and not cfg.trainable:
        raise NotImplementedError(
            f"`{name}`: the CUDA grouped GEMM needs B == epn (no inference overflow groups); "
            f"got B={cfg.num_slots}, epn={cfg.epn}. Use implementation='xla'.")
    for arg, a in arrays.items():
        if a.dtype != jnp.bfloat16:
            raise TypeError(f"`{name}`: `{arg}` must be bfloat16; got {a.dtype}.")
        if a.shape[-1] % ALIGN_ELEMS:
            raise ValueError(f"`{name}`: the last dimension of `{arg}` must be a multiple of "
                             f"{ALIGN_ELEMS}; got shape {list(a.shape)}.")


def _rows(target: str, a, w_local, w_slots, cu_seqlens, ep_rank, out_cols: int):
    aval = jax.typeof(a)
    out_t = aval.update(shape=(a.shape[0], out_cols))
    table_t = aval.update(shape=(max_tiles(a.shape[0], cu_seqlens.shape[0]), 4), dtype=jnp.int32)
    out, _ = jax.ffi.ffi_call(target, (out_t, table_t))(
        a, w_local, w_slots, cu_seqlens, ep_rank)
    return out


def grouped_matmul(x, w_local, w_slots, cu_seqlens, ep_rank):
    """`y [NvS, D1]`: `x [NvS, D0]` rows of group g times its weights; `ep_rank [1] int32`."""
    _check("moonep_gmm_fwd", {"x": x, "w_local": w_local, "w_slots": w_slots})
    return _rows("moonep_gmm_fwd", x, w_local, w_slots, cu_seqlens, ep_rank, w_local.shape[2])


def grouped_matmul_dx(dy, w_local, w_slots, cu_seqlens, ep_rank):
    """`dx [NvS, D0]`: `dy [NvS, D1]` rows of group g times its weights transposed."""
    _check("moonep_gmm_dx", {"dy": dy, "w_local": w_local, "w_slots": w_slots})
    return _rows("moonep_gmm_dx", dy, w_local, w_slots, cu_seqlens, ep_rank, w_local.shape[1])


def grouped_matmul_dw(x, dy, cu_seqlens, ep_rank, num_local: int, num_slots: int):
    """`(dw_local [epn, D0, D1], dw_slots [B, D0, D1])` fp32: `x_g^T dy_g` per local expert/slot."""
    _check("moonep_gmm_dw", {"x": x, "dy": dy})
    aval = jax.typeof(x)
    d0, d1 = x.shape[1], dy.shape[1]
    return jax.ffi.ffi_call("moonep_gmm_dw", (
        aval.update(shape=(num_local, d0, d1), dtype=jnp.float32),
        aval.update(shape=(num_slots, d0, d1), dtype=jnp.float32),
    ))(x, dy, cu_seqlens, ep_rank)


def _ep_rank(cfg: EPConfig) -> jax.Array:
    return jax.lax.axis_index(cfg.axis_name).astype(np.int32).reshape(1)


# ---- backend functions (docs/CONTRACT.md), called per rank inside shard_map --------------------

def gmm_impl(x, w_local, w_slots, plan: Plan, cfg: EPConfig):
    _check("gmm_impl", {}, cfg)
    return grouped_matmul(x, w_local, w_slots, plan.cu_seqlens, _ep_rank(cfg))


def gmm_dx_impl(dy, w_local, w_slots, plan: Plan, cfg: EPConfig):
    _check("gmm_dx_impl", {}, cfg)
    return grouped_matmul_dx(dy, w_local, w_slots, plan.cu_seqlens, _ep_rank(cfg))


def gmm_dw_impl(x, dy, plan: Plan, cfg: EPConfig):
    _check("gmm_dw_impl", {}, cfg)
    return grouped_matmul_dw(x, dy, plan.cu_seqlens, _ep_rank(cfg), cfg.epn, cfg.num_slots)
