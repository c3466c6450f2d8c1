"""Dispatch and combine (xla reference): exact payload movement, two-stage sums, their VJPs.

Expected values are rebuilt in NumPy from the plans' `dst` alone (decode (dest, row) per entry),
so these tests check data movement independently of how the planner balanced the entries.
Payloads are traceable (values encode source rank, token and k) or small integers, so every
comparison is `np.array_equal`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moonep_jax
from moonep_jax import DROPPED
from moonep_jax.combine import combine
from moonep_jax.dispatch import dispatch
from moonep_jax.plan import plan

from _routings import distinct_top_k, drop_entries, repeat_first_choice


def make_config(R, S=6, K=3, E=None, H=8, tp=1):
    return moonep_jax.EPConfig(num_experts=E or max(2 * R, 8), top_k=K, tokens_per_rank=S, hidden=H,
                               ffn_hidden=4, num_ranks=R, token_padding=tp, implementation="xla")


def skewed_routing(seed, cfg, drop=0.15, duplicates=0.3):
    """Global `[R, S, K]`: rank 0's experts 8x as hot, some repeated ids, some -1 entries."""
    rng = np.random.default_rng(seed)
    R, S, K, E = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k, cfg.num_experts
    hot = np.where(np.arange(E) < cfg.epn, np.log(8.0), 0.0)
    topk_idx = repeat_first_choice(distinct_top_k(rng, hot, R, S, K), rng, duplicates)
    return drop_entries(topk_idx, rng, drop)


def run_per_rank(fn, mesh, *global_args):
    """Runs `fn` on every rank (inputs split on axis 0); outputs stacked on a new rank axis."""
    stacked = jax.jit(jax.shard_map(
        lambda *args: jax.tree.map(lambda leaf: leaf[None], fn(*args)),
        mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(*global_args)
    return jax.tree.map(np.asarray, stacked)


def entries(dst, cfg):
    """Yields `(src rank, token, k, dest, row)` of every valid entry of the `[R, N]` plans."""
    for r in range(cfg.num_ranks):
        for i, v in enumerate(dst[r]):
            if v == DROPPED:
                continue
            raw = v if v >= 0 else -v - 1
            yield r, i // cfg.top_k, i % cfg.top_k, raw // cfg.nvs, raw % cfg.nvs


def flat_tokens(a, cfg):
    return a.reshape((cfg.num_ranks * cfg.tokens_per_rank,) + a.shape[2:])


# ---- dispatch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("R, tp, dtype", [(1, 1, np.float32), (2, 4, np.float32),
                                          (4, 1, jnp.bfloat16), (8, 3, np.float32)])
def test_dispatch_moves_every_entry_to_its_row_and_zeroes_the_rest(mesh_factory, seed, R, tp,
                                                                   dtype):
    cfg = make_config(R, tp=tp)
    S, K, H = cfg.tokens_per_rank, cfg.top_k, cfg.hidden
    rng = np.random.default_rng(seed)
    topk_idx = skewed_routing(seed, cfg)
    # Row of (r, t) = [r + 1, t + 1, random ints]; weight of (r, t, k) = its flat id + 1.
    x = rng.integers(-50, 50, size=(R, S, H)).astype(np.float32)
    x[..., 0], x[..., 1] = np.arange(R)[:, None] + 1, np.arange(S)[None, :] + 1
    x = x.astype(dtype)
    topk_w = (np.arange(R * S * K, dtype=np.float32) + 1).reshape(R, S, K)

    def per_rank(x, topk_w, topk_idx):
        p = plan(topk_idx, cfg)
        recv_x, recv_w = dispatch(x, topk_w, p, cfg)
        return recv_x, recv_w, p.dst

    recv_x, recv_w, dst = run_per_rank(per_rank, mesh_factory(R), flat_tokens(x, cfg),
                                       flat_tokens(topk_w, cfg), flat_tokens(topk_idx, cfg))

    expected_x = np.zeros((R, cfg.nvs, H), dtype)
    expected_w = np.zeros((R, cfg.nvs), np.float32)
    owners = np.zeros((R, cfg.nvs), np.int32)
    for r, t, k, d, row in entries(dst, cfg):
        expected_x[d, row], expected_w[d, row] = x[r, t], topk_w[r, t, k]
        owners[d, row] += 1
    assert owners.max() <= 1, "two entries planned onto one row"
    assert owners.sum() == np.count_nonzero(topk_idx >= 0)
    assert recv_x.dtype == dtype and recv_w.dtype == np.float32
    assert np.array_equal(recv_x, expected_x)
    assert np.array_equal(recv_w, expected_w)


# ---- combine ------------------------------------------------------------------------------------


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_combine_of_dispatch_sums_each_tokens_valid_entries(mesh_factory, seed, R):
    cfg = make_config(R, K=4, tp=2)
    rng = np.random.default_rng(seed)
    topk_idx = skewed_routing(seed, cfg)
    x = rng.integers(-20, 20, size=(R * cfg.tokens_per_rank, cfg.hidden)).astype(np.float32)
    topk_w = np.zeros((R * cfg.tokens_per_rank, cfg.top_k), np.float32)

    def per_rank(x, topk_w, topk_idx):
        p = plan(topk_idx, cfg)
        recv_x, _ = dispatch(x, topk_w, p, cfg)
        return combine(recv_x, p, cfg)

    out = run_per_rank(per_rank, mesh_factory(R), x, topk_w, flat_tokens(topk_idx, cfg))
    num_valid = (flat_tokens(topk_idx, cfg) >= 0).sum(axis=1)
    assert np.array_equal(out.reshape(x.shape), num_valid[:, None] * x)


def two_stage_sum(y, dst, cfg):
    """CONTRACT.md's combine in NumPy: per-rank fp32 sums rounded to y's dtype, then summed."""
    R, S, K = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k
    out = np.zeros((R, S, cfg.hidden), y.dtype)
    by_token = {}
    for r, t, k, d, row in entries(dst, cfg):
        by_token.setdefault((r, t), []).append((k, d, row))
    for (r, t), token_entries in by_token.items():
        partials = {}  # dict order = order of each rank's lowest k (entries come in ascending k)
        for _, d, row in token_entries:
            partials[d] = partials.get(d, np.float32(0)) + y[d, row].astype(np.float32)
        total = np.zeros(cfg.hidden, np.float32)
        for partial in partials.values():
            total = total + partial.astype(y.dtype).astype(np.float32)
        out[r, t] = total.astype(y.dtype)
    return out


@pytest.mark.parametrize("R", [2, 4])
def test_combine_rounds_per_rank_partials_once_in_fixed_order(mesh_factory, seed, R):
    cfg = make_config(R, K=6, H=16)
    rng = np.random.default_rng(seed)
    topk_idx = skewed_routing(seed, cfg, duplicates=0.5)
    y = rng.standard_normal((R * cfg.nvs, cfg.hidden)).astype(jnp.bfloat16)

    def per_rank(y, topk_idx):
        p = plan(topk_idx, cfg)
        return combine(y, p, cfg), p.dst

    out, dst = run_per_rank(per_rank, mesh_factory(R), y, flat_tokens(topk_idx, cfg))
    expected = two_stage_sum(y.reshape(R, cfg.nvs, cfg.hidden), dst, cfg)
    assert out.dtype == jnp.bfloat16
    assert np.array_equal(out.view(np.uint16), expected.view(np.uint16))


# ---- VJPs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("R", [2, 8])
def test_dispatch_vjp_is_combine_plus_weight_gather(mesh_factory, seed, R):
    cfg = make_config(R, tp=2)
    S, K, H, nvs = cfg.tokens_per_rank, cfg.top_k, cfg.hidden, cfg.nvs
    rng = np.random.default_rng(seed)
    topk_idx = skewed_routing(seed, cfg)
    x = rng.standard_normal((R * S, H)).astype(np.float32)
    topk_w = rng.random((R * S, K)).astype(np.float32)
    # Integer cotangents on every row, padding and tail included: those must not leak back.
    d_recv_x = rng.integers(-9, 9, size=(R * nvs, H)).astype(np.float32)
    d_recv_w = rng.integers(1, 99, size=(R * nvs,)).astype(np.float32)

    def per_rank(x, topk_w, topk_idx, d_recv_x, d_recv_w):
        p = plan(topk_idx, cfg)
        _, vjp = jax.vjp(lambda x, w: dispatch(x, w, p, cfg), x, topk_w)
        d_x, d_w = vjp((d_recv_x, d_recv_w))
        return d_x, d_w, p.dst

    d_x, d_w, dst = run_per_rank(per_rank, mesh_factory(R), x, topk_w, flat_tokens(topk_idx, cfg),
                                 d_recv_x, d_recv_w)
    d_recv_x, d_recv_w = d_recv_x.reshape(R, nvs, H), d_recv_w.reshape(R, nvs)
    expected_x, expected_w = np.zeros((R, S, H), np.float32), np.zeros((R, S, K), np.float32)
    for r, t, k, d, row in entries(dst, cfg):
        expected_x[r, t] += d_recv_x[d, row]
        expected_w[r, t, k] = d_recv_w[d, row]
    assert np.array_equal(d_x, expected_x)
    assert np.array_equal(d_w, expected_w)
    assert np.all(d_w[topk_idx < 0] == 0)


@pytest.mark.parametrize("R", [1, 4])
def test_combine_vjp_is_dispatch_of_the_output_cotangent(mesh_factory, seed, R):
    cfg = make_config(R, tp=3)
    S, H, nvs = cfg.tokens_per_rank, cfg.hidden, cfg.nvs
    rng = np.random.default_rng(seed)
    topk_idx = skewed_routing(seed, cfg)
    y = rng.standard_normal((R * nvs, H)).astype(np.float32)
    d_out = rng.standard_normal((R * S, H)).astype(np.float32)

    def per_rank(y, topk_idx, d_out):
        p = plan(topk_idx, cfg)
        _, vjp = jax.vjp(lambda y: combine(y, p, cfg), y)
        return vjp(d_out)[0], p.dst

    d_y, dst = run_per_rank(per_rank, mesh_factory(R), y, flat_tokens(topk_idx, cfg), d_out)
    d_out = d_out.reshape(R, S, H)
    expected = np.zeros((R, nvs, H), np.float32)
    for r, t, _, d, row in entries(dst, cfg):
        expected[d, row] = d_out[r, t]
    assert np.array_equal(d_y, expected)


def test_gradient_of_replicated_tokens_is_summed_once_over_ranks(mesh_factory, seed):
    """Every rank dispatches the same replicated `x`; its gradient is the sum over ranks."""
    R = 4
    cfg = make_config(R)
    S, H, nvs = cfg.tokens_per_rank, cfg.hidden, cfg.nvs
    rng = np.random.default_rng(seed)
    topk_idx = flat_tokens(skewed_routing(seed, cfg), cfg)
    x = rng.standard_normal((S, H)).astype(np.float32)
    topk_w = np.ones((R * S, cfg.top_k), np.float32)
    weights = rng.integers(-9, 9, size=(R * nvs, H)).astype(np.float32)
    mesh = mesh_factory(R)

    def recv_rows(x, topk_w, topk_idx):
        return jax.shard_map(lambda x, w, i: dispatch(x, w, plan(i, cfg), cfg)[0], mesh=mesh,
                             in_specs=(P(), P("ep"), P("ep")), out_specs=P("ep"))(x, topk_w,
                                                                                  topk_idx)

    d_x = jax.jit(jax.grad(lambda x: jnp.sum(recv_rows(x, topk_w, topk_idx) * weights)))(x)
    dst = run_per_rank(lambda i: plan(i, cfg).dst, mesh, topk_idx)
    weights = weights.reshape(R, nvs, H)
    expected = np.zeros((S, H), np.float32)
    for _, t, _, d, row in entries(dst, cfg):
        expected[t] += weights[d, row]
    np.testing.assert_allclose(np.asarray(d_x), expected, rtol=1e-6, atol=1e-5)


# ---- trace-time validation ----------------------------------------------------------------------


def trace_on_ranks(fn, cfg, mesh, *shapes_dtypes):
    args = [jax.ShapeDtypeStruct((cfg.num_ranks * s[0],) + s[1:], d) for s, d in shapes_dtypes]
    return jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")),
                          *args)


def dispatch_traced(cfg, mesh, x_shape, x_dtype, w_dtype=np.float32):
    def per_rank(x, topk_w, topk_idx):
        return dispatch(x, topk_w, plan(topk_idx, cfg), cfg)[0]

    S, K = cfg.tokens_per_rank, cfg.top_k
    return trace_on_ranks(per_rank, cfg, mesh, (x_shape, x_dtype), ((S, K), w_dtype),
                          ((S, K), np.int32))


def test_dispatch_rejects_wrong_token_shape(mesh_factory):
    cfg = make_config(2)
    with pytest.raises(ValueError, match=r"`moonep_jax.dispatch`: `x` must have shape \[S, H\] = "
                                         r"\[6, 8\]; got \[6, 5\]"):
        dispatch_traced(cfg, mesh_factory(2), (6, 5), np.float32)


def test_dispatch_rejects_integer_tokens_and_non_f32_weights(mesh_factory):
    cfg, mesh = make_config(2), mesh_factory(2)
    with pytest.raises(TypeError, match="`x` must have a floating-point dtype; got int32"):
        dispatch_traced(cfg, mesh, (6, 8), np.int32)
    with pytest.raises(TypeError, match="`topk_w` must have dtype float32; got bfloat16"):
        dispatch_traced(cfg, mesh, (6, 8), np.float32, jnp.bfloat16)


def test_combine_rejects_rows_of_the_wrong_count(mesh_factory):
    cfg = make_config(2)

    def per_rank(y, topk_idx):
        return combine(y, plan(topk_idx, cfg), cfg)

    with pytest.raises(ValueError, match=r"`y` must have shape \[NvS, H\] = \[18, 8\]; got \[6, 8\]"):
        trace_on_ranks(per_rank, cfg, mesh_factory(2), ((6, 8), np.float32), ((6, 3), np.int32))


def hand_plan(cfg):
    N, G, nvs = cfg.num_entries, cfg.num_groups, cfg.nvs
    i32 = functools.partial(np.zeros, dtype=np.int32)
    return moonep_jax.Plan(dst=i32(N), cu_seqlens=i32(G), zero_fill=i32((G, 2)),
                           experts_to_copy=i32((cfg.num_ranks, cfg.num_slots)),
                           recv_src=i32(nvs), recv_primary=i32(nvs), num_invalid_ids=i32(1))


def test_ops_outside_shard_map_name_the_missing_axis():
    cfg = make_config(2)
    x = np.zeros((6, 8), np.float32)
    with pytest.raises(ValueError, match="the EP axis `ep` .* is not bound"):
        dispatch(x, np.zeros((6, 3), np.float32), hand_plan(cfg), cfg)
    with pytest.raises(ValueError, match="the EP axis `ep` .* is not bound"):
        combine(np.zeros((cfg.nvs, 8), np.float32), hand_plan(cfg), cfg)


def test_plan_and_config_types_are_checked():
    cfg = make_config(2)
    x, w = np.zeros((6, 8), np.float32), np.zeros((6, 3), np.float32)
    with pytest.raises(TypeError, match="`plan` must be a moonep_jax.Plan"):
        dispatch(x, w, {"dst": None}, cfg)
    with pytest.raises(TypeError, match="`cfg` must be a moonep_jax.EPConfig"):
        dispatch(x, w, hand_plan(cfg), {"num_ranks": 2})
    bad = hand_plan(cfg)
    bad = moonep_jax.Plan(**{**bad.__dict__, "recv_src": np.zeros(5, np.int32)})
    with pytest.raises(ValueError, match=r"`plan.recv_src` must have shape \[NvS\] = \[18\]"):
        dispatch(x, w, bad, cfg)


def test_bf16_rounding_on_bits_equals_the_convert(seed):
    """combine's bit-level bf16 rounding (immune to XLA's excess-precision rewrites) is RNE."""
    from moonep_jax.combine import _round_to

    rng = np.random.default_rng(seed)
    mantissas = rng.standard_normal(200_000).astype(np.float32)
    scales = np.exp2(rng.integers(-140, 120, mantissas.size)).astype(np.float32)
    ties = ((rng.integers(0, 2**16, 50_000).astype(np.uint32) << 16) | 0x8000).view(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, 1e-45, -1e-45],
                        np.float32)
    x = np.concatenate([mantissas * scales, ties, specials])
    got = np.asarray(jax.jit(lambda v: _round_to(v, jnp.bfloat16))(x))
    with np.errstate(invalid="ignore"):  # NaN -> bf16
        want = x.astype(jnp.bfloat16).astype(np.float32)
    assert np.array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    assert np.array_equal(np.isnan(got), np.isnan(want))
