"""`moe_ffn`: one expert-parallel SwiGLU MoE layer end to end (plan, dispatch, experts, combine).

The layer owns its `custom_vjp` rather than composing the ops' own rules, for two reasons: the
backward re-prefetches the replica weights instead of keeping `w_slots` alive as residuals (they
are as large as this rank's experts), and each replica's weight gradient is reduced into the home
gradient in the fixed order of `reduce_grad`, starting from the local gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from moonep_jax import _checks
from moonep_jax.config import EPConfig
from moonep_jax.plan import plan as make_plan
from moonep_jax.plan_types import Plan

_OP = "moonep_jax.moe_ffn"
_F32 = jnp.float32
# Backend keyword of prefetch: unused replica slots are left unwritten. The layer's GEMMs read only
# used slots, and zeroing all B = epn slots of a training layer moves more bytes than the replicas
# themselves (grouped_matmul_dw with for_reduce_grad leaves unused slot gradients unwritten
# likewise).
_USED_SLOTS_ONLY = {"zero_unused_slots": False}


def moe_ffn(x: jax.Array, topk_idx: jax.Array, topk_w: jax.Array,
            params: Mapping[str, jax.Array], cfg: EPConfig, *,
            plan: Plan | None = None) -> jax.Array:
    """Routes tokens to their top-K SwiGLU experts across the EP axis and sums the results.

    `out[t] = sum_k topk_w[t, k] * ffn_{topk_idx[t, k]}(x[t])` with
    `ffn_e(v) = (silu(v @ Wg_e) * (v @ Wu_e)) @ Wd_e`, computed with MoonEP's balanced plan: every
    rank computes exactly its share of the entries. Call inside `jax.shard_map` over
    `cfg.axis_name`; all shapes are per EP rank.

    Args:
      x: `[S, H]` floating, this rank's tokens.
      topk_idx: `[S, K] int32` routed expert ids; -1 drops an entry (zero contribution, zero
        gradient). An id outside `[-1, E)` (E, 1000, -2, ...) is invalid: it is dropped exactly
        like -1 (the output and gradients equal those of the routing with it set to -1, in both
        implementations, never a device trap) and counted in `moonep_jax.plan(...)`'s
        `num_invalid_ids` (the modules' `aux["num_invalid_ids"]`). `cfg.check_expert_ids=True`
        makes it an error: run under `jax.experimental.checkify.checkify` and `.throw()` raises,
        naming the EP rank and the count.
      topk_w: `[S, K] float32` route weights.
      params: a mapping with `w_gate_up [epn, H, 2F]` (`[..., :F]` the gate, SiLU applied,
        `[..., F:]` the up projection) and `w_down [epn, F, H]`, both in x's dtype: this rank's
        experts `rank*epn ... rank*epn + epn - 1`.
      cfg: the layer's `EPConfig`.
      plan: this rank's `moonep_jax.plan(topk_idx, cfg)` when the caller has it already (the
        modules read `recv_src` and `num_invalid_ids` from it), so that it is not planned twice;
        planned here when None.

    Returns:
      `[S, H]` in x's dtype. Each received row's SwiGLU activation is scaled by its route weight
      in fp32 and rounded to x's dtype before the down projection, whose rows the (unweighted,
      two-stage) combine sums. Differentiable w.r.t. `x`, `topk_w`
      and both weights when `B == epn`; the weight gradients include every replica's share.

    Raises:
      TypeError / ValueError: at trace time, for wrong shapes, dtypes, `params`, `cfg` or EP axis,
        and when gradients are taken with `B < epn`. Forward-mode autodiff (`jax.jvp`,
        `jax.jacfwd`) is not supported: the layer defines reverse-mode rules only
        (`jax.custom_vjp`); use `jax.grad`, `jax.vjp` or `jax.jacrev`.
      checkify.JaxRuntimeError: from `.throw()` under `checkify.checkify`, with
        `cfg.check_expert_ids`, when `topk_idx` holds invalid ids.
    """
    _checks.check_config(_OP, cfg)
    S, K, H, F, epn = cfg.tokens_per_rank, cfg.top_k, cfg.hidden, cfg.ffn_hidden, cfg.epn
    _checks.check_array(_OP, "x", x, "[S, H]", [S, H])
    _checks.check_floating(_OP, "x", x)
    _checks.check_array(_OP, "topk_idx", topk_idx, "[S, K]", [S, K], jnp.int32)
    _checks.check_array(_OP, "topk_w", topk_w, "[S, K]", [S, K], _F32)
    w_gate_up, w_down = _params(params)
    _checks.check_array(_OP, "params['w_gate_up']", w_gate_up, "[epn, H, 2F]", [epn, H, 2 * F])
    _checks.check_array(_OP, "params['w_down']", w_down, "[epn, F, H]", [epn, F, H])
    _checks.check_same_dtype(_OP, "params['w_gate_up']", w_gate_up, "x", x)
    _checks.check_same_dtype(_OP, "params['w_down']", w_down, "x", x)
    _checks.check_ep_axis(_OP, cfg)

    if plan is None:
        plan = make_plan(topk_idx, cfg)
    else:
        _checks.check_plan(_OP, plan, cfg)
    x, topk_w, w_gate_up, w_down = _checks.vary_together([x, topk_w, w_gate_up, w_down],
                                                         cfg.axis_name)
    return _moe_ffn(x, topk_w, w_gate_up, w_down, plan, cfg)


def _params(params) -> tuple[jax.Array, jax.Array]:
    if not isinstance(params, Mapping):
        raise TypeError(f"`{_OP}`: `params` must be a mapping with keys 'w_gate_up' and "
                        f"'w_down'; got {type(params).__name__}.")
    missing = [k for k in ("w_gate_up", "w_down") if k not in params]
    if missing:
        raise ValueError(f"`{_OP}`: `params` must have keys 'w_gate_up' and 'w_down'; missing "
                         f"{missing} (got keys {sorted(params)}).")
    return params["w_gate_up"], params["w_down"]


# ---- the layer and its backward -----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _moe_ffn(x, topk_w, w_gate_up, w_down, plan, cfg):
    out, _ = _forward(x, topk_w, w_gate_up, w_down, plan, cfg)
    return out


def _slot_prefetch(plan: Plan, cfg: EPConfig):
    """`(w, ...) -> (w_slots, ...)` of this plan, used slots only, every array in one backend
    call. With R = 1 no slot is ever used (no other rank's experts exist), so nothing is copied:
    each `w` itself (its first B matrices) stands in for its slots, whose groups are empty, and
    with B = epn no slot memory is allocated."""
    if not cfg.replicas_possible:
        return lambda *ws: tuple(w[:cfg.num_slots] for w in ws)
    impl = _checks.implementation(cfg)
    return lambda *ws: impl.prefetch(ws, plan, cfg, **_USED_SLOTS_ONLY)


def _forward(x, topk_w, w_gate_up, w_down, plan: Plan, cfg: EPConfig):
    """The layer; returns `(out, (recv_x, recv_w, h))`, the rows its backward needs.

    The route weight scales each row's activation (F wide, in the SwiGLU's own pass) rather than
    its output (H wide, a pass of its own): `(w * act) @ W_down = w * (act @ W_down)`.
    """
    impl = _checks.implementation(cfg)
    prefetch = _slot_prefetch(plan, cfg)
    recv_x, recv_w = impl.dispatch(x, topk_w, plan, cfg)
    slots_gate_up, slots_down = prefetch(w_gate_up, w_down)  # one call: one rendezvous
    h = impl.grouped_matmul(recv_x, w_gate_up, slots_gate_up, plan, cfg)   # [NvS, 2F]
    y = impl.grouped_matmul(_weighted_swiglu(h, recv_w), w_down, slots_down, plan, cfg)
    out = impl.combine(y, plan, cfg)                                        # y [NvS, H] weighted
    return out, (recv_x, recv_w, h)


def _weight_grad(x, d_y, plan: Plan, cfg: EPConfig) -> jax.Array:
    """The complete gradient of one projection's local experts, in the weights' dtype.

    grouped_matmul_dw writes each expert that no slot replicates straight in the weights' dtype; a
    replicated expert's fp32 partial is then summed with its replicas' fp32 slot gradients in
    reduce_grad's fixed order and rounded once. No pass over all experts' gradients follows.
    """
    impl = _checks.implementation(cfg)
    d_local, d_partial, d_slots = impl.grouped_matmul_dw(x, d_y, plan, cfg, for_reduce_grad=True)
    if not cfg.replicas_possible:
        return d_local
    return impl.reduce_grad(d_local, d_slots, plan, cfg, g_partial=d_partial)


def _moe_ffn_fwd(x, topk_w, w_gate_up, w_down, plan, cfg):
    _checks.check_trainable(_OP, cfg)
    out, rows = _forward(x, topk_w, w_gate_up, w_down, plan, cfg)
    # The replica slots are not residuals: the backward prefetches them again.
    return out, (rows, w_gate_up, w_down, plan)


def _moe_ffn_bwd(cfg, residuals, d_out):
    (recv_x, recv_w, h), w_gate_up, w_down, plan = residuals
    impl = _checks.implementation(cfg)
    prefetch = _slot_prefetch(plan, cfg)
    no_weights = jnp.zeros((cfg.tokens_per_rank, cfg.top_k), _F32)
    d_y, _ = impl.dispatch(d_out, no_weights, plan, cfg)          # [NvS, H]: y is weighted

    # Each re-prefetch is tied to a backward value so XLA can neither CSE it with the forward's
    # prefetch (that would keep the slots alive as a residual) nor hoist it into the forward.
    # One projection per call here, unlike the forward: each projection's slots live only while
    # its own dX GEMM runs, which keeps the backward's peak memory down.
    w_down, d_y = lax.optimization_barrier((w_down, d_y))
    (slots_down,) = prefetch(w_down)
    d_act_w = impl.grouped_matmul_dx(d_y, w_down, slots_down, plan, cfg)      # [NvS, F]
    d_w_down = _weight_grad(_weighted_swiglu(h, recv_w), d_y, plan, cfg)
    d_h, d_recv_w = _weighted_swiglu_grad(h, recv_w, d_act_w)     # [NvS, 2F], [NvS] f32
    w_gate_up, d_h = lax.optimization_barrier((w_gate_up, d_h))
    (slots_gate_up,) = prefetch(w_gate_up)
    d_recv_x = impl.grouped_matmul_dx(d_h, w_gate_up, slots_gate_up, plan, cfg)
    d_w_gate_up = _weight_grad(recv_x, d_h, plan, cfg)

    d_x = impl.combine(d_recv_x, plan, cfg)
    d_topk_w = impl.combine_weights(d_recv_w, plan, cfg)
    return d_x, d_topk_w, d_w_gate_up, d_w_down, None  # the plan is integer: no cotangent


_moe_ffn.defvjp(_moe_ffn_fwd, _moe_ffn_bwd)


# ---- elementwise parts (fp32 math, rounded to the rows' dtype) ----------------------------------


def _weighted_swiglu(h: jax.Array, recv_w: jax.Array) -> jax.Array:
    """`recv_w[r] * silu(gate) * up` of `h = [gate | up]` (`[NvS, 2F]` -> `[NvS, F]`)."""
    gate, up = jnp.split(h.astype(_F32), 2, axis=1)
    return (recv_w[:, None] * jax.nn.silu(gate) * up).astype(h.dtype)


def _weighted_swiglu_grad(h: jax.Array, recv_w: jax.Array, d_act_w: jax.Array):
    """Cotangents of `h` and `recv_w` given the cotangent of `_weighted_swiglu(h, recv_w)`.

    With `act = silu(gate) * up`: `d recv_w = sum_f d_act_w * act` (F wide, in the same pass),
    `d act = d_act_w * recv_w`, `d gate = d act * up * silu'(gate)` with
    `silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))`, `d up = d act * silu(gate)`.
    """
    gate, up = jnp.split(h.astype(_F32), 2, axis=1)
    d_act_w = d_act_w.astype(_F32)
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    d_recv_w = jnp.sum(d_act_w * silu * up, axis=1)
    d_act = d_act_w * recv_w[:, None]
    d_gate = d_act * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = d_act * silu
    return jnp.concatenate([d_gate, d_up], axis=1).astype(h.dtype), d_recv_w
