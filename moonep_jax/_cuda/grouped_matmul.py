"""Grouped GEMMs on the GPU: the CuTe DSL kernels behind `moonep_grouped_matmul`, `_dx` and `_dw`.

Rows of the `[NvS, .]` activations are grouped by `plan.cu_seqlens [G]` (G = E + B); group
`g < E` multiplies by its home rank's `w_local[g % epn]`, group `g >= E` by `w_slots[g - E]`.
bf16 operands, fp32 accumulation, rows past `cu_seqlens[-1]` written zero (CONTRACT.md
"grouped_matmul").

Inference overflow (B < epn, decided statically from the shapes): a non-empty group `g < E` of
another rank's expert reads that expert's weights in place from the home rank's `w_local` over
NVLink. The forward and dX calls then publish `w_local`'s address to the EP group and barrier on
entry and exit (`kernels/grouped_matmul.h`), so they need the transport attributes; with B == epn
no overflow group exists, there is no barrier and the attributes are not read. dW needs B == epn
(gradients are refused at trace time with overflow).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moonep_jax import _checks, _ffi
from moonep_jax.config import EPConfig
from moonep_jax.experts import weight_grad_counts
from moonep_jax.plan_types import Plan

# TMA needs every row stride to be a multiple of 16 bytes.
ALIGN_ELEMS = 8


def tile_m() -> int:
    """Rows per M tile of the ragged-M kernels, as the loaded extension was built."""
    return _ffi.lib().GROUPED_MATMUL_TILE_M


def table_rows(num_rows: int, num_groups: int, overflow: bool) -> int:
    """Rows of the tile-table scratch (kernels/grouped_matmul.h: grouped_matmul_table_rows): the
    CuTe table, its schedule row, then with overflow a count row and the overflow table. Asked of
    the extension, whose kernels fill it."""
    return _ffi.lib().grouped_matmul_table_rows(num_rows, num_groups, overflow)


# With B == epn the handlers never read the transport attributes; these only fill the binding.
_NO_TRANSPORT = dict(mesh_devices=np.array([-1], np.int32), num_ranks=np.int32(1),
                     timeout_ns=np.int64(0))


def transport_attrs(cfg: EPConfig) -> dict:
    """The attributes an overflow call needs to find its EP group (moonep_jax/_cuda/transport.py)."""
    from moonep_jax._cuda import transport

    return dict(mesh_devices=transport.mesh_devices(cfg), num_ranks=np.int32(cfg.num_ranks),
                timeout_ns=np.int64(round(cfg.cuda.timeout_s * 1e9)))


def _check(name: str, arrays: dict[str, jax.Array]) -> None:
    _ffi.lib()  # raises with the reason when the extension is missing
    for arg, a in arrays.items():
        if a.dtype != jnp.bfloat16:
            raise TypeError(f"`{name}`: `{arg}` must be bfloat16; got {a.dtype}.")
        if a.shape[-1] % ALIGN_ELEMS:
            raise ValueError(f"`{name}`: the last dimension of `{arg}` must be a multiple of "
                             f"{ALIGN_ELEMS}; got shape {list(a.shape)}.")


def _rows(target: str, a, w_local, w_slots, cu_seqlens, ep_rank, out_cols: int,
          transport: dict | None):
    overflow = w_slots.shape[0] < w_local.shape[0]
    if overflow and transport is None:
        raise ValueError(
            f"`{target}`: with B = {w_slots.shape[0]} < epn = {w_local.shape[0]} (inference "
            "overflow) the call reads peers' weights and needs `transport` "
            "(`transport_attrs(cfg)`, inside `jax.shard_map`).")
    aval = jax.typeof(a)
    out_t = aval.update(shape=(a.shape[0], out_cols))
    columns = _ffi.lib().GROUPED_MATMUL_TABLE_CONSTANTS["TABLE_COLUMNS"]
    table_t = aval.update(shape=(table_rows(a.shape[0], cu_seqlens.shape[0], overflow), columns),
                          dtype=jnp.int32)
    out, _ = jax.ffi.ffi_call(target, (out_t, table_t))(
        a, w_local, w_slots, cu_seqlens, ep_rank, **(transport if overflow else _NO_TRANSPORT))
    return out


def grouped_matmul_of_groups(x, w_local, w_slots, cu_seqlens, ep_rank,
                             transport: dict | None = None):
    """`y [NvS, D1]`: `x [NvS, D0]` rows of group g times its weights; `ep_rank [1] int32`.

    `transport` (`transport_attrs(cfg)`) is required when B < epn (overflow groups possible).
    """
    _check("moonep_grouped_matmul", {"x": x, "w_local": w_local, "w_slots": w_slots})
    return _rows("moonep_grouped_matmul", x, w_local, w_slots, cu_seqlens, ep_rank,
                 w_local.shape[2], transport)


def grouped_matmul_dx_of_groups(dy, w_local, w_slots, cu_seqlens, ep_rank,
                                transport: dict | None = None):
    """`dx [NvS, D0]`: `dy [NvS, D1]` rows of group g times its weights transposed."""
    _check("moonep_grouped_matmul_dx", {"dy": dy, "w_local": w_local, "w_slots": w_slots})
    return _rows("moonep_grouped_matmul_dx", dy, w_local, w_slots, cu_seqlens, ep_rank,
                 w_local.shape[1], transport)


def grouped_matmul_dw_of_groups(x, dy, cu_seqlens, ep_rank, experts_to_copy, num_local: int,
                                num_partials: int, num_slots: int, *,
                                zero_unused_slots: bool = True):
    """`(dw_local [epn, D0, D1] bf16, dw_partial [P, D0, D1] f32, dw_slots [B', D0, D1] f32)`:
    `x_g^T dy_g` per local expert and slot, accumulated in fp32.

    With `num_partials = 0` every local expert's gradient is in `dw_local`. With `num_partials =
    epn`, an expert that `experts_to_copy [R, B]` replicates somewhere has its fp32 gradient in
    `dw_partial` instead (its `dw_local` matrix is left for reduce_grad), the others' in
    `dw_local`. `num_slots` is B or 0 (no slot gradients). Slot matrices without rows are zero, or
    left unwritten with `zero_unused_slots=False`.
    """
    _check("moonep_grouped_matmul_dw", {"x": x, "dy": dy})
    aval = jax.typeof(x)
    d0, d1 = x.shape[1], dy.shape[1]
    schedule_slots = _ffi.lib().GROUPED_MATMUL_TABLE_CONSTANTS["DW_SCHEDULE_SLOTS"]
    dw_local, dw_partial, dw_slots, _, _ = jax.ffi.ffi_call("moonep_grouped_matmul_dw", (
        aval.update(shape=(num_local, d0, d1)),
        aval.update(shape=(num_partials, d0, d1), dtype=jnp.float32),
        aval.update(shape=(num_slots, d0, d1), dtype=jnp.float32),
        aval.update(shape=(num_local,), dtype=jnp.int32),  # replica_flags scratch
        # schedule scratch: the matrices with work and the work-item counter (kernels/constants.h)
        aval.update(shape=(schedule_slots + num_slots,), dtype=jnp.int32),
    ))(x, dy, cu_seqlens, ep_rank, experts_to_copy,
       zero_unused_slots=np.int32(zero_unused_slots))
    return dw_local, dw_partial, dw_slots


def _ep_rank(cfg: EPConfig) -> jax.Array:
    return jax.lax.axis_index(cfg.axis_name).astype(np.int32).reshape(1)


# ---- backend functions (docs/CONTRACT.md), called per rank inside shard_map --------------------

def _overflow_transport(cfg: EPConfig) -> dict | None:
    return None if cfg.trainable else transport_attrs(cfg)


def grouped_matmul(x, w_local, w_slots, plan: Plan, cfg: EPConfig):
    return grouped_matmul_of_groups(x, w_local, w_slots, plan.cu_seqlens, _ep_rank(cfg),
                                    _overflow_transport(cfg))


def grouped_matmul_dx(d_y, w_local, w_slots, plan: Plan, cfg: EPConfig):
    return grouped_matmul_dx_of_groups(d_y, w_local, w_slots, plan.cu_seqlens, _ep_rank(cfg),
                                       _overflow_transport(cfg))


def grouped_matmul_dw(x, d_y, plan: Plan, cfg: EPConfig, *, for_reduce_grad: bool = False):
    _checks.check_trainable("moonep_jax._cuda.grouped_matmul.grouped_matmul_dw", cfg)
    num_partials, num_slots = weight_grad_counts(cfg, for_reduce_grad)
    # Slots without rows are exactly the unused ones: the planner fills a slot only for an
    # expert it allocates rows to (moonep_algorithm.md §3.4, alloc > 0).
    return grouped_matmul_dw_of_groups(x, d_y, plan.cu_seqlens, _ep_rank(cfg),
                                       plan.experts_to_copy, cfg.epn, num_partials, num_slots,
                                       zero_unused_slots=not for_reduce_grad)
