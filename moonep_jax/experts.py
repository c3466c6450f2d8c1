"""Expert weights: prefetch of replica slots, the grouped GEMM, and replica gradient reduction.

Public ops (per EP rank, inside `jax.shard_map` over `cfg.axis_name`):
  `prefetch`        copies the weights of the experts this rank replicates into its B slots;
                    backward reduces the slot cotangents to the home ranks.
  `grouped_matmul`  multiplies each group of receive rows by its expert's weights.
  `reduce_grad`     adds every replica's weight gradient to its home rank's gradient.

`_prefetch_xla`, `_reduce_grad_xla`, `_grouped_matmul_xla`, `_grouped_matmul_dx_xla` and
`_grouped_matmul_dw_xla` are the pure-JAX reference backends (signatures in docs/CONTRACT.md); `weight_grad_counts` fixes the shapes of
the weight gradients both `grouped_matmul_dw` backends return.

The xla grouped GEMM computes masked segments: for each candidate group (this rank's experts and
its slots; every expert when B < epn) one dense product of all NvS rows, kept on the rows of that
group. It costs (candidates x NvS) rows of GEMM, negligible at CPU test sizes, and each row is an
ordinary fp32-accumulated dot of that row alone. `lax.ragged_dot` would need the weights of all G
groups stacked in group order, i.e. a concatenation of local, replica and (for overflow) remote
weights, and its CPU lowering also decomposes into one product per group; it buys nothing here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from moonep_jax import _checks
from moonep_jax.config import EPConfig
from moonep_jax.plan_types import Plan

_F32 = jnp.float32


def _weight_dims(op: str, name: str, w, leading: int, leading_name: str) -> tuple[int, int]:
    """Checks `w` is a floating `[leading, D0, D1]` array; returns `(D0, D1)`."""
    _checks.check_floating(op, name, w)
    if w.ndim != 3:
        raise ValueError(f"`{op}`: `{name}` must have shape [{leading_name}, D0, D1]; "
                         f"got {list(w.shape)}.")
    _checks.check_array(op, name, w, f"[{leading_name}, D0, D1]", [leading, *w.shape[1:]])
    return w.shape[1], w.shape[2]


def _check_common(op: str, plan, cfg: EPConfig) -> None:
    _checks.check_config(op, cfg)
    _checks.check_plan(op, plan, cfg)
    _checks.check_ep_axis(op, cfg)


# ---- prefetch -----------------------------------------------------------------------------------


def prefetch(w_local: jax.Array, plan: Plan, cfg: EPConfig) -> jax.Array:
    """Fills this rank's replica slots with the weights of the experts it computes remotely.

    Args:
      w_local: `[epn, D0, D1]` floating, this rank's experts (`rank*epn ...`).
      plan: this rank's `Plan`.
      cfg: the layer's `EPConfig`.

    Returns:
      `w_slots [B, D0, D1]`: `w_slots[b]` = the home weights of `plan.experts_to_copy[rank, b]`,
      exactly; unused slots are zero. Differentiable: the slot cotangents are reduced to their
      home ranks, so `jax.grad` w.r.t. `w_local` is complete.

    Raises:
      TypeError / ValueError: at trace time, for wrong shapes, dtypes, `cfg` or EP axis.
    """
    op = "moonep_jax.prefetch"
    _check_common(op, plan, cfg)
    _weight_dims(op, "w_local", w_local, cfg.epn, "epn")
    (w_local,) = _checks.vary_together([w_local], cfg.axis_name)
    return _prefetch(w_local, plan, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _prefetch(w_local, plan, cfg):
    (w_slots,) = _checks.implementation(cfg).prefetch((w_local,), plan, cfg)
    return w_slots


def _prefetch_fwd(w_local, plan, cfg):
    return _prefetch(w_local, plan, cfg), plan


def _prefetch_bwd(cfg, plan, d_slots):
    zeros = _checks.zeros_varying_like((cfg.epn,) + d_slots.shape[1:], _F32, d_slots)
    d_local = _checks.implementation(cfg).reduce_grad(zeros, d_slots.astype(_F32), plan, cfg)
    return d_local.astype(d_slots.dtype), None  # w_slots and w_local share a dtype


_prefetch.defvjp(_prefetch_fwd, _prefetch_bwd)


def _prefetch_xla(w_locals: tuple[jax.Array, ...], plan: Plan, cfg: EPConfig, *,
                  zero_unused_slots: bool = True) -> tuple[jax.Array, ...]:
    """Reference prefetch, per weight array: all-gather every expert, take this rank's slot
    experts (unused slots are always zero, which also satisfies `zero_unused_slots=False`:
    "unspecified")."""
    del zero_unused_slots
    slot_expert = plan.experts_to_copy[lax.axis_index(cfg.axis_name)]  # [B]
    used = slot_expert >= 0

    def slots_of(w_local):
        every_expert = lax.all_gather(w_local, cfg.axis_name, tiled=True)  # [E, ...]
        mask = used.reshape((-1,) + (1,) * (w_local.ndim - 1))
        return jnp.where(mask, every_expert[jnp.maximum(slot_expert, 0)],
                         jnp.zeros((), w_local.dtype))

    return tuple(slots_of(w_local) for w_local in w_locals)


# ---- reduce_grad --------------------------------------------------------------------------------


def reduce_grad(g_local: jax.Array, g_slots: jax.Array, plan: Plan, cfg: EPConfig) -> jax.Array:
    """Adds every replica slot's weight gradient to the gradient of its home expert.

    Args:
      g_local: `[epn, D0, D1] float32`, this rank's gradient of its own experts.
      g_slots: `[B, D0, D1] float32`, this rank's gradient of its replica slots.
      plan: this rank's `Plan`.
      cfg: the layer's `EPConfig`.

    Returns:
      `[epn, D0, D1] float32`: `g_local[e]`, then for (source rank r, slot b) ascending with
      `experts_to_copy[r, b] == e`, plus rank r's `g_slots[b]`, in fp32 and in that order (slots
      of other experts are skipped, not added as zeros). Deterministic and bitwise reproducible.

    Raises:
      TypeError / ValueError: at trace time, for wrong shapes, dtypes, `cfg` or EP axis.
    """
    op = "moonep_jax.reduce_grad"
    _check_common(op, plan, cfg)
    d0, d1 = _weight_dims(op, "g_local", g_local, cfg.epn, "epn")
    _checks.check_array(op, "g_local", g_local, "[epn, D0, D1]", [cfg.epn, d0, d1], _F32)
    _checks.check_array(op, "g_slots", g_slots, "[B, D0, D1]", [cfg.num_slots, d0, d1], _F32)
    g_local, g_slots = _checks.vary_together([g_local, g_slots], cfg.axis_name)
    return _checks.implementation(cfg).reduce_grad(g_local, g_slots, plan, cfg)


def _reduce_grad_xla(g: jax.Array, g_slots: jax.Array, plan: Plan, cfg: EPConfig, *,
                     g_partial: jax.Array | None = None) -> jax.Array:
    """Reference reduction: all-gather the slot gradients, add them in (rank, slot) order.

    Each replicated expert's sum starts from `g_partial` (fp32; `g` itself when None) and is
    rounded to g's dtype once; the other experts keep `g`.
    """
    R, B, epn = cfg.num_ranks, cfg.num_slots, cfg.epn
    every_slot = lax.all_gather(g_slots, cfg.axis_name).reshape((R * B,) + g_slots.shape[1:])
    local_expert = plan.experts_to_copy.reshape(R * B) - lax.axis_index(cfg.axis_name) * epn
    replicated = jnp.isin(jnp.arange(epn), local_expert)

    def add_slot(rb, sums):
        le = local_expert[rb]
        mine = (le >= 0) & (le < epn)
        le = jnp.clip(le, 0, epn - 1)
        return sums.at[le].set(jnp.where(mine, sums[le] + every_slot[rb], sums[le]))

    sums = lax.fori_loop(0, R * B, add_slot, g if g_partial is None else g_partial)
    return jnp.where(replicated[:, None, None], sums.astype(g.dtype), g)


def weight_grad_counts(cfg: EPConfig, for_reduce_grad: bool) -> tuple[int, int]:
    """`(P, B')`: fp32 partial and slot matrices that `grouped_matmul_dw` returns
    (docs/CONTRACT.md).

    For the public op every local expert's gradient is in the weights' dtype and every slot has
    one (P = 0, B' = B). For moe_ffn, which reduces replicas next, replicated experts give fp32
    partials (P = epn) and used slots fp32 gradients (B' = B), and with R = 1, where no slot can
    be used, neither exists (P = B' = 0).
    """
    if not for_reduce_grad:
        return 0, cfg.num_slots
    return (cfg.epn, cfg.num_slots) if cfg.replicas_possible else (0, 0)


# ---- grouped_matmul -----------------------------------------------------------------------------


def grouped_matmul(x: jax.Array, w_local: jax.Array, w_slots: jax.Array, plan: Plan,
                   cfg: EPConfig) -> jax.Array:
    """Multiplies every group of receive rows by its expert's weights (per EP rank).

    Group `g < E` (this rank's experts, and inference overflow experts) uses the home rank's
    weights: `w_local` for this rank's own, read in place from the home rank for overflow (an
    all-gather in the xla reference). Group `E + b` uses `w_slots[b]`.

    Args:
      x: `[NvS, D0]` floating, rows laid out by `plan.cu_seqlens` (as `dispatch` returns them).
      w_local: `[epn, D0, D1]`, x's dtype, this rank's experts.
      w_slots: `[B, D0, D1]`, x's dtype, this rank's replicas (from `prefetch`).
      plan: this rank's `Plan`.
      cfg: the layer's `EPConfig`.

    Returns:
      `[NvS, D1]` in x's dtype, accumulated in fp32; rows past `cu_seqlens[-1]` are zero.
      Differentiable when `B == epn`.

    Raises:
      TypeError / ValueError: at trace time, for wrong shapes, dtypes, `cfg` or EP axis, and
        when gradients are taken with `B < epn`.
    """
    op = "moonep_jax.grouped_matmul"
    _check_common(op, plan, cfg)
    d0, d1 = _weight_dims(op, "w_local", w_local, cfg.epn, "epn")
    _checks.check_array(op, "w_slots", w_slots, "[B, D0, D1]", [cfg.num_slots, d0, d1])
    _checks.check_array(op, "x", x, "[NvS, D0]", [cfg.nvs, d0])
    _checks.check_floating(op, "x", x)
    _checks.check_same_dtype(op, "w_local", w_local, "x", x)
    _checks.check_same_dtype(op, "w_slots", w_slots, "x", x)
    x, w_local, w_slots = _checks.vary_together([x, w_local, w_slots], cfg.axis_name)
    return _grouped_matmul(x, w_local, w_slots, plan, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_matmul(x, w_local, w_slots, plan, cfg):
    return _checks.implementation(cfg).grouped_matmul(x, w_local, w_slots, plan, cfg)


def _grouped_matmul_fwd(x, w_local, w_slots, plan, cfg):
    _checks.check_trainable("moonep_jax.grouped_matmul", cfg)
    return _grouped_matmul(x, w_local, w_slots, plan, cfg), (x, w_local, w_slots, plan)


def _grouped_matmul_bwd(cfg, residuals, d_y):
    x, w_local, w_slots, plan = residuals
    d_x = _checks.implementation(cfg).grouped_matmul_dx(d_y, w_local, w_slots, plan, cfg)
    d_local, _, d_slots = _checks.implementation(cfg).grouped_matmul_dw(x, d_y, plan, cfg)
    return d_x, d_local, d_slots.astype(w_slots.dtype), None  # x, w_local, w_slots share a dtype


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _row_groups(plan: Plan, cfg: EPConfig) -> jax.Array:
    """`[NvS] int32` group of every receive row; G for rows past `cu_seqlens[-1]`."""
    rows = jnp.arange(cfg.nvs, dtype=jnp.int32)
    return jnp.searchsorted(plan.cu_seqlens, rows, side="right").astype(jnp.int32)


def _segments(lhs, weights, first_group, row_group, transpose: bool, out):
    """For c in [0, C): rows of group `first_group + c` get `lhs @ weights[c]` (or its `.T`)."""
    contract = ((1,), (1,) if transpose else (0,)), ((), ())

    def segment(c, out):
        product = lax.dot_general(lhs, weights[c], contract, preferred_element_type=_F32)
        return jnp.where((row_group == first_group + c)[:, None], product, out)

    return lax.fori_loop(0, weights.shape[0], segment, out)


def _weights_by_group(lhs, w_local, w_slots, plan, cfg: EPConfig, transpose: bool):
    """The masked-segment product of every non-empty group (see the module docstring)."""
    row_group = _row_groups(plan, cfg)
    out_dim = w_local.shape[1] if transpose else w_local.shape[2]
    out = _checks.zeros_varying_like((cfg.nvs, out_dim), _F32, lhs)
    if cfg.trainable:
        # B == epn: every remote expert has a slot, so only this rank's own groups are non-empty.
        first_own = lax.axis_index(cfg.axis_name) * cfg.epn
        out = _segments(lhs, w_local, first_own, row_group, transpose, out)
    else:
        every_expert = lax.all_gather(w_local, cfg.axis_name, tiled=True)  # overflow reads
        out = _segments(lhs, every_expert, 0, row_group, transpose, out)
    out = _segments(lhs, w_slots, cfg.num_experts, row_group, transpose, out)
    return out.astype(lhs.dtype)


def _grouped_matmul_xla(x, w_local, w_slots, plan: Plan, cfg: EPConfig) -> jax.Array:
    """Reference grouped GEMM `y[rows of g] = x[rows of g] @ W_g`."""
    return _weights_by_group(x, w_local, w_slots, plan, cfg, transpose=False)


def _grouped_matmul_dx_xla(d_y, w_local, w_slots, plan: Plan, cfg: EPConfig) -> jax.Array:
    """Reference input gradient `dx[rows of g] = dy[rows of g] @ W_g^T`."""
    return _weights_by_group(d_y, w_local, w_slots, plan, cfg, transpose=True)


def _grouped_matmul_dw_xla(x, d_y, plan: Plan, cfg: EPConfig, *,
                for_reduce_grad: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference weight gradients `dW_g = x[rows of g]^T @ dy[rows of g]` (training, B == epn).

    Returns:
      `(dw_local [epn, D0, D1] x.dtype, dw_partial [P, D0, D1] f32, dw_slots [B', D0, D1] f32)`
      with `(P, B') = weight_grad_counts(cfg, for_reduce_grad)`. With partials, the reference
      gives every local expert's fp32 gradient (only the replicated ones are specified); unused
      slots are always zero (which also satisfies "unspecified").
    """
    num_partials, num_slots = weight_grad_counts(cfg, for_reduce_grad)
    row_group = _row_groups(plan, cfg)

    def group_grad(g):
        x_g = jnp.where((row_group == g)[:, None], x, jnp.zeros((), x.dtype))
        return lax.dot_general(x_g, d_y, (((0,), (0,)), ((), ())), preferred_element_type=_F32)

    first_own = lax.axis_index(cfg.axis_name) * cfg.epn
    d_local = lax.map(group_grad, first_own + jnp.arange(cfg.epn, dtype=jnp.int32))
    d_slots = lax.map(group_grad, cfg.num_experts + jnp.arange(num_slots, dtype=jnp.int32))
    return d_local.astype(x.dtype), d_local[:num_partials], d_slots
