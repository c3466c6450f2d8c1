"""Combine: return every receive row to its token and sum each token's K rows (unweighted).

`combine` is the public, differentiable op; its backward is a dispatch of the output cotangent
with the same plan. `_combine_xla` and `_combine_weights_xla` are the pure-JAX reference backends;
the latter gathers per-row weights back to `[S, K]` (the weight part of dispatch's backward).

Numerics (docs/CONTRACT.md, MoonEP's two-stage rounding): per token, the rows that went to the
same destination rank are summed in fp32 in ascending k and rounded to y's dtype once; those
partial sums are summed in fp32, ordered by their lowest k, and rounded again. The order is fixed,
so every implementation gives the same bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from moonep_jax import _checks
from moonep_jax.config import EPConfig
from moonep_jax.dispatch import decode_dst
from moonep_jax.plan_types import Plan

_OP = "moonep_jax.combine"


def combine(y: jax.Array, plan: Plan, cfg: EPConfig) -> jax.Array:
    """Sums every token's K expert outputs back on the token's rank (per EP rank).

    Call inside `jax.shard_map` over `cfg.axis_name`. The sum is unweighted: scale the rows by
    `recv_w` before (as `moe_ffn` does).

    Args:
      y: `[NvS, H]` floating, this rank's expert output rows, laid out as `dispatch` returned them.
      plan: this rank's `Plan`, the one the rows were dispatched with.
      cfg: the layer's `EPConfig`.

    Returns:
      `[S, H]` in y's dtype: for each token, the two-stage sum of its valid entries' rows; a token
      whose entries are all dropped gets zeros.

    Raises:
      TypeError / ValueError: at trace time, for wrong shapes, dtypes, `cfg` or EP axis.
    """
    _checks.check_config(_OP, cfg)
    _checks.check_array(_OP, "y", y, "[NvS, H]", [cfg.nvs, cfg.hidden])
    _checks.check_floating(_OP, "y", y)
    _checks.check_plan(_OP, plan, cfg)
    _checks.check_ep_axis(_OP, cfg)
    (y,) = _checks.vary_together([y], cfg.axis_name)
    return _combine(y, plan, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _combine(y, plan, cfg):
    return _checks.implementation(cfg).combine(y, plan, cfg)


def _combine_fwd(y, plan, cfg):
    return _combine(y, plan, cfg), plan


def _combine_bwd(cfg, plan, d_out):
    # Dispatch without weights: the recv_w it also returns is discarded.
    no_weights = jnp.zeros((cfg.tokens_per_rank, cfg.top_k), jnp.float32)
    d_y, _ = _checks.implementation(cfg).dispatch(d_out, no_weights, plan, cfg)
    return d_y, None  # the plan is integer: no cotangent


_combine.defvjp(_combine_fwd, _combine_bwd)


# ---- xla reference backends ---------------------------------------------------------------------


def _return_rows(rows: jax.Array, plan: Plan, cfg: EPConfig) -> jax.Array:
    """Sends each receive row back to its source; returns `[S, K, ...]` per local entry.

    The inverse of dispatch's exchange: row `r` goes to rank `recv_src[r] // N` at position `r`
    of a `[R, NvS, ...]` buffer; after one `all_to_all` each entry reads (dest, row) of what came
    back. Dropped entries read zeros.
    """
    S, K, R, N, nvs = cfg.tokens_per_rank, cfg.top_k, cfg.num_ranks, cfg.num_entries, cfg.nvs
    owned = plan.recv_src >= 0
    source = jnp.where(owned, plan.recv_src // N, R)  # out of bounds: the scatter drops the row
    send = jnp.zeros((R, nvs) + rows.shape[1:], rows.dtype)
    send = send.at[source, jnp.arange(nvs)].set(rows, mode="drop", unique_indices=True)
    returned = lax.all_to_all(send, cfg.axis_name, 0, 0, tiled=True)  # [R dest ranks, NvS, ...]
    dest, row, valid = decode_dst(plan.dst, nvs)
    per_entry = returned[dest, row]
    mask = valid.reshape((N,) + (1,) * (rows.ndim - 1))
    per_entry = jnp.where(mask, per_entry, jnp.zeros((), rows.dtype))
    return per_entry.reshape((S, K) + rows.shape[1:])


def _combine_xla(y: jax.Array, plan: Plan, cfg: EPConfig) -> jax.Array:
    """Reference combine: the inverse exchange, then the two-stage sum vectorised over tokens."""
    S, K = cfg.tokens_per_rank, cfg.top_k
    rows = _return_rows(y, plan, cfg).astype(jnp.float32)  # [S, K, H]
    dest, _, valid = decode_dst(plan.dst.reshape(S, K), cfg.nvs)
    same_rank = valid[:, :, None] & valid[:, None, :] & (dest[:, :, None] == dest[:, None, :])
    first_on_rank = valid & ~jnp.any(same_rank & jnp.tri(K, k=-1, dtype=bool)[None], axis=2)

    # Stage 1, for each k that is the first on its rank: the fp32 sum of the rows on that rank in
    # ascending k2 >= k (no lower k2 shares the rank). Stage 2: those partial sums, rounded to y's
    # dtype, summed in the order of their lowest k. Masked terms are skipped, not added as zeros.
    out = jnp.zeros((S, cfg.hidden), jnp.float32)
    for k in range(K):
        partial = jnp.zeros((S, cfg.hidden), jnp.float32)
        for k2 in range(k, K):
            partial = jnp.where(same_rank[:, k, k2, None], partial + rows[:, k2], partial)
        partial = _round_to(partial, y.dtype)
        out = jnp.where(first_on_rank[:, k, None], out + partial, out)
    return _round_to(out, y.dtype).astype(y.dtype)


def _round_to(x: jax.Array, dtype) -> jax.Array:
    """fp32 `x` rounded to the nearest value of `dtype` (ties to even), still as fp32.

    The contract's intermediate rounding must survive compilation: XLA:GPU's excess-precision
    simplification removes an f32 -> bf16 -> f32 convert pair (and it did, on 2xH200: the
    reference then disagreed with the CUDA combine in ~15 % of bf16 elements by 1 ulp). For
    bf16 the rounding is therefore done on the bit pattern, which no float rewrite can skip.
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return x
    if dtype != jnp.bfloat16:  # fp16: the CUDA kernels take bf16/fp32 only, no twin to match
        return x.astype(dtype).astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    lsb = (bits >> 16) & jnp.uint32(1)
    rounded = (bits + jnp.uint32(0x7FFF) + lsb) & jnp.uint32(0xFFFF0000)
    # NaN stays NaN (the carry could otherwise turn a NaN payload into -0.0); inf/overflow round
    # to inf exactly as the convert does.
    return jnp.where(jnp.isnan(x), x, lax.bitcast_convert_type(rounded, jnp.float32))


def _combine_weights_xla(recv_w: jax.Array, plan: Plan, cfg: EPConfig) -> jax.Array:
    """Reference weight gather: `topk_w[t, k] = recv_w[row of (t, k)]`, 0 for dropped entries."""
    return _return_rows(recv_w, plan, cfg)
