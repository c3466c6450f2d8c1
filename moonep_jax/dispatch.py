"""Dispatch: move every routed entry's token row and route weight to its planned receive row.

`dispatch` is the public, differentiable op; `_dispatch_xla` is the pure-JAX reference backend.
Its backward is a combine of the row cotangents plus a gather of the weight cotangents back to
token-major order (DESIGN §4, moonep_algorithm.md §6).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from moonep_jax import _checks
from moonep_jax.config import DROPPED, EPConfig
from moonep_jax.plan_types import Plan

_OP = "moonep_jax.dispatch"


def dispatch(x: jax.Array, topk_w: jax.Array, plan: Plan,
             cfg: EPConfig) -> tuple[jax.Array, jax.Array]:
    """Sends each routed entry's token row and weight to its receive row (per EP rank).

    Call inside `jax.shard_map` over `cfg.axis_name`.

    Args:
      x: `[S, H]` floating, this rank's tokens.
      topk_w: `[S, K] float32` route weights; entries dropped by the plan are ignored.
      plan: this rank's `Plan` from `moonep_jax.plan`.
      cfg: the layer's `EPConfig`.

    Returns:
      `(recv_x [NvS, H] x.dtype, recv_w [NvS] float32)`: row `r` holds the token row and route
      weight of the entry that owns receive row `r` of this rank (duplicates included); padding
      rows and rows past `cu_seqlens[-1]` are zero. The plan already describes the receiver side
      and dispatch does not change it, so it is not returned.

    Raises:
      TypeError / ValueError: at trace time, for wrong shapes, dtypes, `cfg` or EP axis.
    """
    _checks.check_config(_OP, cfg)
    _checks.check_array(_OP, "x", x, "[S, H]", [cfg.tokens_per_rank, cfg.hidden])
    _checks.check_floating(_OP, "x", x)
    _checks.check_array(_OP, "topk_w", topk_w, "[S, K]", [cfg.tokens_per_rank, cfg.top_k],
                        jnp.float32)
    _checks.check_plan(_OP, plan, cfg)
    _checks.check_ep_axis(_OP, cfg)
    x, topk_w = _checks.vary_together([x, topk_w], cfg.axis_name)
    return _dispatch(x, topk_w, plan, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, topk_w, plan, cfg):
    return _checks.implementation(cfg).dispatch(x, topk_w, plan, cfg)


def _dispatch_fwd(x, topk_w, plan, cfg):
    return _dispatch(x, topk_w, plan, cfg), plan


def _dispatch_bwd(cfg, plan, cotangents):
    d_recv_x, d_recv_w = cotangents
    d_x = _checks.implementation(cfg).combine(d_recv_x, plan, cfg)
    d_topk_w = _checks.implementation(cfg).combine_weights(d_recv_w, plan, cfg)
    return d_x, d_topk_w, None  # the plan is integer: no cotangent


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


# ---- xla reference backend ----------------------------------------------------------------------


def decode_dst(dst: jax.Array, nvs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Splits `Plan.dst` into `(dest, row, valid)`, duplicates decoded like primaries.

    Args:
      dst: `[...] int32` encoded destinations (see `Plan.dst`).
      nvs: NvS.

    Returns:
      `dest`, `row` (both 0 where dropped) and `valid` (False for dropped entries), shaped as `dst`.
    """
    valid = dst != DROPPED
    raw = jnp.where(dst >= 0, dst, -(dst + 1))  # dst + 1 first: -DROPPED would overflow int32
    raw = jnp.where(valid, raw, 0)
    return raw // nvs, raw % nvs, valid


def _dispatch_xla(x: jax.Array, topk_w: jax.Array, plan: Plan,
                  cfg: EPConfig) -> tuple[jax.Array, jax.Array]:
    """Reference dispatch: one `all_to_all` of a `[R, NvS, ...]` send buffer per payload.

    Every entry (duplicates included) writes its row at (dest, row) of the send buffer; each
    receive row then takes the row sent by the source rank `plan.recv_src` names, so padding rows
    and rows nobody owns are zero without summing over sources.
    """
    S, K, R, N, nvs = cfg.tokens_per_rank, cfg.top_k, cfg.num_ranks, cfg.num_entries, cfg.nvs
    dest, row, valid = decode_dst(plan.dst, nvs)
    dest = jnp.where(valid, dest, R)  # out of bounds: the scatter drops the entry
    token = jnp.arange(N) // K

    def exchange(payload):  # payload [N, ...] -> [NvS, ...] on the receiver
        send = jnp.zeros((R, nvs) + payload.shape[1:], payload.dtype)
        send = send.at[dest, row].set(payload, mode="drop", unique_indices=True)
        received = lax.all_to_all(send, cfg.axis_name, 0, 0, tiled=True)  # [R sources, NvS, ...]
        owned = plan.recv_src >= 0
        source = jnp.where(owned, plan.recv_src // N, 0)
        rows = received[source, jnp.arange(nvs)]
        mask = owned.reshape((nvs,) + (1,) * (payload.ndim - 1))
        return jnp.where(mask, rows, jnp.zeros((), payload.dtype))

    recv_x = exchange(x[token])
    recv_w = exchange(topk_w.reshape(S * K))
    return recv_x, recv_w
