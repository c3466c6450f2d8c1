"""moe_ffn (xla reference) against a dense, no-EP SwiGLU MoE on the globally gathered batch.

The dense reference evaluates every (token, k) entry with its expert's weights directly; its
gradients come from `jax.grad`. The EP layer must agree in fp32 (rtol 1e-5) in the forward and in
the gradients w.r.t. `x`, `topk_w` and both weight tensors: under `jax.jit`, inside `lax.scan`,
under `jax.checkpoint`, and on a ("data", "ep") mesh. Routings are skewed and include repeated
ids and dropped (-1) entries. Everything runs under `jax.jit`: without it, shard_map runs the
planner op by op, which costs minutes of compilation on CPU for no extra coverage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moonep_jax
from moonep_jax.layer import moe_ffn
from moonep_jax.plan import plan

from _routings import distinct_top_k, drop_entries, repeat_first_choice

H, F = 8, 4
TOL = dict(rtol=1e-5, atol=1e-5)


def make_config(R, S=6, K=3, E=None, B=None):
    return moonep_jax.EPConfig(num_experts=E or max(2 * R, 8), top_k=K, tokens_per_rank=S,
                               hidden=H, ffn_hidden=F, num_ranks=R, prefetch_slots=B,
                               implementation="xla")


def inputs(seed, cfg, replicas=1, drop=0.15):
    """Global `(x, topk_idx, topk_w, w_gate_up, w_down, d_out)`, tokens of every replica."""
    rng = np.random.default_rng(seed)
    R, S, K, E = cfg.num_ranks * replicas, cfg.tokens_per_rank, cfg.top_k, cfg.num_experts
    hot = np.where(np.arange(E) < cfg.epn, np.log(8.0), 0.0)  # rank 0's experts 8x as hot
    topk_idx = drop_entries(repeat_first_choice(distinct_top_k(rng, hot, R, S, K), rng, 0.2),
                            rng, drop).reshape(R * S, K)
    x = rng.standard_normal((R * S, H)).astype(np.float32)
    topk_w = rng.random((R * S, K)).astype(np.float32)
    w_gate_up = (rng.standard_normal((E, H, 2 * F)) / np.sqrt(H)).astype(np.float32)
    w_down = (rng.standard_normal((E, F, H)) / np.sqrt(F)).astype(np.float32)
    d_out = rng.standard_normal((R * S, H)).astype(np.float32)
    return x, topk_idx, topk_w, w_gate_up, w_down, d_out


def dense_moe(x, topk_idx, topk_w, w_gate_up, w_down):
    """`out[t] = sum over valid k of topk_w[t, k] * ffn_e(x[t])`, every entry computed directly."""
    out = jnp.zeros_like(x)
    for k in range(topk_idx.shape[1]):
        valid, expert = topk_idx[:, k] >= 0, jnp.maximum(topk_idx[:, k], 0)
        h = jnp.einsum("th,thf->tf", x, w_gate_up[expert])
        y = jnp.einsum("tf,tfh->th", jax.nn.silu(h[:, :F]) * h[:, F:], w_down[expert])
        out = out + jnp.where(valid[:, None], topk_w[:, k:k + 1] * y, 0.0)
    return out


def ep_moe(cfg, mesh, token_spec=P("ep")):
    """The layer on global arrays: tokens split by `token_spec`, experts by "ep"."""
    def per_rank(x, topk_idx, topk_w, w_gate_up, w_down):
        return moe_ffn(x, topk_idx, topk_w, {"w_gate_up": w_gate_up, "w_down": w_down}, cfg)

    return jax.shard_map(per_rank, mesh=mesh, out_specs=token_spec,
                         in_specs=(token_spec, token_spec, token_spec, P("ep"), P("ep")))


def value_and_grads(layer, x, topk_idx, topk_w, w_gate_up, w_down, d_out):
    """The output and the gradients of `sum(out * d_out)` w.r.t. x, topk_w and both weights."""
    def loss(x, topk_w, w_gate_up, w_down):
        out = layer(x, topk_idx, topk_w, w_gate_up, w_down)
        return jnp.sum(out * d_out), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, topk_w, w_gate_up, w_down)
    return jax.tree.map(np.asarray, (out, grads))


def assert_matches(layer, reference, args):
    topk_idx = args[1]
    out, grads = value_and_grads(layer, *args)
    ref_out, ref_grads = value_and_grads(reference, *args)
    np.testing.assert_allclose(out, ref_out, **TOL)
    for name, grad, ref in zip(("x", "topk_w", "w_gate_up", "w_down"), grads, ref_grads):
        np.testing.assert_allclose(grad, ref, **TOL, err_msg=f"gradient w.r.t. {name}")
    d_topk_w = grads[1]
    assert np.all(d_topk_w[topk_idx < 0] == 0), "dropped entries must get zero gradient"


def per_rank_layer(cfg):
    def layer(x, topk_idx, topk_w, w_gate_up, w_down):
        return moe_ffn(x, topk_idx, topk_w, {"w_gate_up": w_gate_up, "w_down": w_down}, cfg)

    return layer


# ---- equality with the dense reference ----------------------------------------------------------


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_matches_dense_reference_under_jit(mesh_factory, seed, R):
    cfg = make_config(R)
    assert_matches(jax.jit(ep_moe(cfg, mesh_factory(R))), dense_moe, inputs(seed, cfg))


def test_dropped_entries_contribute_nothing(mesh_factory, seed):
    """Half the entries dropped, some tokens entirely: their rows are zero, and so are grads."""
    cfg = make_config(4)
    args = inputs(seed, cfg, drop=0.5)
    layer = jax.jit(ep_moe(cfg, mesh_factory(4)))
    out, (d_x, d_topk_w, _, _) = value_and_grads(layer, *args)
    topk_idx = args[1]
    all_dropped = np.all(topk_idx < 0, axis=1)
    assert all_dropped.any() and not all_dropped.all()
    assert np.all(out[all_dropped] == 0) and np.all(d_x[all_dropped] == 0)
    assert_matches(layer, dense_moe, args)


def scanned(layer):
    """Three residual layers `x + layer(x, ...)`, one per slice of the stacked arguments."""
    def run(x, topk_idx, topk_w, w_gate_up, w_down):
        def one_layer(x, params):
            return x + layer(x, *params), None

        return jax.lax.scan(one_layer, x, (topk_idx, topk_w, w_gate_up, w_down))[0]

    return run


def test_matches_dense_reference_inside_scan_over_three_layers(mesh_factory, seed):
    cfg = make_config(4)
    layers = [inputs(seed + i, cfg) for i in range(3)]
    stacked = [np.stack([layer[i] for layer in layers]) for i in (1, 2, 3, 4)]
    x, d_out = layers[0][0], layers[0][5]
    per_layer = P(None, "ep")
    ep_layers = jax.shard_map(scanned(per_rank_layer(cfg)), mesh=mesh_factory(4),
                              in_specs=(P("ep"),) + (per_layer,) * 4, out_specs=P("ep"))
    assert_matches(jax.jit(ep_layers), scanned(dense_moe), (x, *stacked, d_out))


def test_matches_dense_reference_under_checkpoint(mesh_factory, seed):
    cfg = make_config(2)
    layer = jax.shard_map(jax.checkpoint(per_rank_layer(cfg)), mesh=mesh_factory(2),
                          in_specs=P("ep"), out_specs=P("ep"))
    assert_matches(jax.jit(layer), dense_moe, inputs(seed, cfg))


def test_matches_dense_reference_on_a_data_by_ep_mesh(mesh_factory, seed):
    """Tokens split over ("data", "ep"); experts over "ep", replicated over "data"."""
    cfg = make_config(4)
    mesh = mesh_factory((2, 4), ("data", "ep"))
    layer = ep_moe(cfg, mesh, token_spec=P(("data", "ep")))
    assert_matches(jax.jit(layer), dense_moe, inputs(seed, cfg, replicas=2))


# ---- inference overflow (B < epn) ---------------------------------------------------------------


def overflow_case(seed):
    """R=2, epn=3, B=1; every entry on rank 0's experts, so rank 1 computes several of them."""
    cfg = make_config(2, E=6, K=2, B=1)
    args = list(inputs(seed, cfg, drop=0.0))
    rng = np.random.default_rng(seed)
    args[1] = distinct_top_k(rng, np.where(np.arange(6) < 3, 0.0, -np.inf), 1, 12, 2)[0]
    return cfg, args


def test_inference_with_overflow_experts_matches_dense_reference(mesh_factory, seed):
    cfg, args = overflow_case(seed)
    mesh = mesh_factory(2)
    cu_seqlens = jax.jit(jax.shard_map(lambda i: plan(i, cfg).cu_seqlens[None], mesh=mesh,
                                       in_specs=P("ep"), out_specs=P("ep")))(args[1])
    rows = np.diff(np.asarray(cu_seqlens), prepend=0, axis=1)
    assert rows[1, :3].any(), "rank 1 should compute an overflow expert in its global row"
    out = jax.jit(ep_moe(cfg, mesh))(*args[:5])
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense_moe(*args[:5])), **TOL)


def test_gradients_with_overflow_slots_are_rejected(mesh_factory, seed):
    cfg, args = overflow_case(seed)
    layer = ep_moe(cfg, mesh_factory(2))
    x, topk_idx, topk_w, w_gate_up, w_down, _ = args
    grad_x = jax.grad(lambda x: jnp.sum(layer(x, topk_idx, topk_w, w_gate_up, w_down)))
    with pytest.raises(ValueError, match=r"`moonep_jax.moe_ffn`: gradients need prefetch_slots "
                                         r"== epn \(= 3\); got prefetch_slots = 1"):
        jax.eval_shape(grad_x, x)


# ---- trace-time validation ----------------------------------------------------------------------


def trace_layer(cfg, mesh, params, x_dtype=np.float32):
    R, S, K = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k

    def per_rank(x, topk_idx, topk_w, params):
        return moe_ffn(x, topk_idx, topk_w, params, cfg)

    args = (jax.ShapeDtypeStruct((R * S, H), x_dtype), jax.ShapeDtypeStruct((R * S, K), np.int32),
            jax.ShapeDtypeStruct((R * S, K), np.float32), params)
    return jax.eval_shape(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")),
                          *args)


def weights(cfg, dtype=np.float32, down_shape=None):
    E = cfg.num_experts
    return {"w_gate_up": jax.ShapeDtypeStruct((E, H, 2 * F), dtype),
            "w_down": jax.ShapeDtypeStruct(down_shape or (E, F, H), dtype)}


def test_params_must_hold_both_weights(mesh_factory):
    cfg, mesh = make_config(2), mesh_factory(2)
    with pytest.raises(ValueError, match=r"`params` must have keys 'w_gate_up' and 'w_down'; "
                                         r"missing \['w_down'\]"):
        trace_layer(cfg, mesh, {"w_gate_up": weights(cfg)["w_gate_up"]})
    with pytest.raises(TypeError, match="`params` must be a mapping"):
        moe_ffn(np.zeros((6, H), np.float32), np.zeros((6, 3), np.int32),
                np.zeros((6, 3), np.float32), [1, 2], cfg)


def test_weight_shapes_and_dtypes_are_checked(mesh_factory):
    cfg, mesh = make_config(2), mesh_factory(2)
    with pytest.raises(ValueError, match=r"`params\['w_down'\]` must have shape \[epn, F, H\] = "
                                         r"\[4, 4, 8\]; got \[4, 8, 4\]"):
        trace_layer(cfg, mesh, weights(cfg, down_shape=(cfg.num_experts, H, F)))
    with pytest.raises(TypeError, match=r"`params\['w_gate_up'\]` must have the dtype of `x`"):
        trace_layer(cfg, mesh, weights(cfg, jnp.bfloat16))


def test_layer_reads_no_unspecified_weight_or_gradient(mesh_factory, seed, monkeypatch):
    """moe_ffn asks prefetch for used slots only (`zero_unused_slots=False`) and grouped_matmul_dw
    for the reduce_grad layout (`for_reduce_grad=True`: unused slot gradients, the weights'-dtype matrices
    of replicated experts and the fp32 partials of the others are unspecified): here the xla
    backends fill all of those with NaN, a legal "unspecified", and the layer's output and
    gradients must still match the dense reference."""
    import inspect

    from jax import lax

    from moonep_jax import _xla

    poisoned_ops = []
    prefetch_xla, grouped_matmul_dw_xla = _xla.prefetch, _xla.grouped_matmul_dw

    def arguments(backend, args, kwargs):
        bound = inspect.signature(backend).bind(*args, **kwargs).arguments
        cfg = bound["cfg"]
        return cfg, bound["plan"].experts_to_copy, lax.axis_index(cfg.axis_name)

    def nan_where(keep, a):
        return jnp.where(keep[:, None, None], a, jnp.nan)

    def poisoned_prefetch(*args, zero_unused_slots=True, **kwargs):
        out = prefetch_xla(*args, **kwargs)
        if zero_unused_slots:
            return out
        poisoned_ops.append("prefetch")
        _, experts_to_copy, rank = arguments(prefetch_xla, args, kwargs)
        return tuple(nan_where(experts_to_copy[rank] >= 0, slots) for slots in out)

    def poisoned_grouped_matmul_dw(*args, for_reduce_grad=False, **kwargs):
        d_local, d_partial, d_slots = grouped_matmul_dw_xla(*args, for_reduce_grad=for_reduce_grad,
                                                            **kwargs)
        if not for_reduce_grad:
            return d_local, d_partial, d_slots
        poisoned_ops.append("grouped_matmul_dw")
        cfg, experts_to_copy, rank = arguments(grouped_matmul_dw_xla, args, kwargs)
        replicated = jnp.isin(rank * cfg.epn + jnp.arange(cfg.epn), experts_to_copy)
        if d_partial.shape[0]:
            d_partial = nan_where(replicated, d_partial)
        if d_slots.shape[0]:
            d_slots = nan_where(experts_to_copy[rank] >= 0, d_slots)
        return nan_where(~replicated, d_local), d_partial, d_slots

    monkeypatch.setattr(_xla, "prefetch", poisoned_prefetch)
    monkeypatch.setattr(_xla, "grouped_matmul_dw", poisoned_grouped_matmul_dw)
    cfg = make_config(2, S=8, E=8)
    args = inputs(seed, cfg)
    assert_matches(jax.jit(ep_moe(cfg, mesh_factory(2))), dense_moe, args)
    assert {"prefetch", "grouped_matmul_dw"} <= set(poisoned_ops)
    # The routing must leave some slots unused and use some, or the poison proves nothing.
    p = jax.jit(jax.shard_map(lambda idx: plan(idx, cfg).experts_to_copy, mesh=mesh_factory(2),
                              in_specs=P("ep"), out_specs=P("ep")))(args[1])
    slots = np.asarray(p)[:2]  # the full [R, B] table, rank 0's copy
    assert (slots >= 0).any() and (slots < 0).any(), slots


def test_a_given_plan_is_used_and_not_planned_again(mesh_factory, seed, monkeypatch):
    """`moe_ffn(..., plan=p)` plans nothing itself and gives the same result as planning inside;
    a plan of the wrong shapes is refused by name."""
    from moonep_jax import _xla

    cfg, mesh = make_config(2), mesh_factory(2)
    x, topk_idx, topk_w, w_gate_up, w_down, _ = inputs(seed, cfg)
    plans = []
    monkeypatch.setattr(_xla, "plan", lambda *a, plan_xla=_xla.plan: plans.append(1) or plan_xla(*a))

    def per_rank(x, topk_idx, topk_w, w_gate_up, w_down, given: bool):
        params = {"w_gate_up": w_gate_up, "w_down": w_down}
        p = plan(topk_idx, cfg) if given else None
        return moe_ffn(x, topk_idx, topk_w, params, cfg, plan=p)

    outs = {}
    for given in (True, False):
        plans.clear()
        layer = jax.shard_map(lambda *a, given=given: per_rank(*a, given), mesh=mesh,
                              in_specs=P("ep"), out_specs=P("ep"))
        outs[given] = np.asarray(jax.jit(layer)(x, topk_idx, topk_w, w_gate_up, w_down))
        assert len(plans) == 1, (given, len(plans))
    np.testing.assert_array_equal(outs[True], outs[False])

    other = make_config(2, S=2 * cfg.tokens_per_rank)
    with pytest.raises(ValueError, match=r"`moonep_jax.moe_ffn`: `plan.dst` must have shape"):
        jax.eval_shape(jax.shard_map(
            lambda idx, x, w, a, b: moe_ffn(x, idx, w, {"w_gate_up": a, "w_down": b}, cfg,
                                            plan=plan(jnp.concatenate([idx, idx]), other)),
            mesh=mesh, in_specs=P("ep"), out_specs=P("ep")), topk_idx, x, topk_w, w_gate_up, w_down)
