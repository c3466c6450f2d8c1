"""prefetch, reduce_grad and grouped_matmul (xla reference) on hand-built plans.

Plans are built in NumPy (random slot tables with fan-in and unused slots, random group sizes
with padding-free gaps and a free tail), so these ops are tested independently of the planner.
Values are small integers wherever the summation order is not part of the contract, so every
check is exact; `reduce_grad`, whose order is the contract, is checked bitwise on random floats.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moonep_jax
from moonep_jax.experts import grouped_matmul, prefetch, reduce_grad

D0, D1 = 4, 3


def make_config(R, epn=3, B=None):
    return moonep_jax.EPConfig(num_experts=R * epn, top_k=2, tokens_per_rank=8, hidden=D0,
                               ffn_hidden=D1, num_ranks=R, prefetch_slots=B, implementation="xla")


def slot_table(rng, cfg):
    """`[R, B]` random expert ids with fan-in (few distinct experts) and some unused (-1) slots."""
    popular = rng.choice(cfg.num_experts, size=max(1, cfg.num_experts // 3), replace=False)
    table = rng.choice(popular, size=(cfg.num_ranks, cfg.num_slots))
    return np.where(rng.random(table.shape) < 0.25, -1, table).astype(np.int32)


def group_sizes(rng, table, cfg, overflow):
    """`[R, G]` rows per group: own experts and used slots (plus any expert if `overflow`)."""
    R, E, epn = cfg.num_ranks, cfg.num_experts, cfg.epn
    sizes = np.zeros((R, cfg.num_groups), np.int32)
    for r in range(R):
        can_be_full = np.zeros(cfg.num_groups, bool)
        can_be_full[r * epn:(r + 1) * epn] = True
        can_be_full[:E] |= overflow
        can_be_full[E:] = table[r] >= 0
        rows = rng.integers(0, cfg.nvs + 1)  # rows past cu_seqlens[-1] stay free
        weights = can_be_full * rng.random(cfg.num_groups)
        if weights.sum() > 0:
            sizes[r] = rng.multinomial(rows, weights / weights.sum())
    return sizes


def rank_plan(cu_seqlens, experts_to_copy, cfg):
    """A `Plan` with the two fields these ops read (`cu_seqlens` may be None for prefetch and
    reduce_grad); the other fields only need their shapes."""
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    if cu_seqlens is None:
        cu_seqlens = zeros(cfg.num_groups)
    return moonep_jax.Plan(dst=zeros(cfg.num_entries), cu_seqlens=cu_seqlens,
                           zero_fill=zeros(cfg.num_groups, 2), experts_to_copy=experts_to_copy,
                           recv_src=zeros(cfg.nvs), recv_primary=zeros(cfg.nvs),
                           num_invalid_ids=zeros(1))


def run_per_rank(fn, mesh, *global_args):
    stacked = jax.jit(jax.shard_map(
        lambda *args: jax.tree.map(lambda leaf: leaf[None], fn(*args)),
        mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(*global_args)
    return jax.tree.map(np.asarray, stacked)


def replicated(table, cfg):
    """The full `[R, B]` table once per rank, for inputs split over ranks."""
    return np.tile(table, (cfg.num_ranks, 1))


def small_ints(rng, shape, dtype=np.float32):
    return rng.integers(-4, 5, size=shape).astype(dtype)


# ---- prefetch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("R, dtype", [(1, np.float32), (2, jnp.bfloat16), (4, np.float32),
                                      (8, np.float32)])
def test_prefetch_copies_slot_experts_exactly_and_zeroes_unused_slots(mesh_factory, seed, R,
                                                                      dtype):
    cfg = make_config(R)
    rng = np.random.default_rng(seed)
    table = slot_table(rng, cfg)
    w = rng.standard_normal((cfg.num_experts, D0, D1)).astype(dtype)
    slots = run_per_rank(lambda w, t: prefetch(w, rank_plan(None, t, cfg), cfg), mesh_factory(R),
                         w, replicated(table, cfg))
    expected = np.where((table >= 0)[..., None, None], w[np.maximum(table, 0)], np.zeros((), dtype))
    assert slots.dtype == dtype
    assert np.array_equal(slots, expected)


@pytest.mark.parametrize("R", [2, 4])
def test_prefetch_backend_of_several_arrays_equals_one_call_per_array(mesh_factory, seed, R):
    """The xla backend of one call with weight arrays of different trailing dims and dtypes
    (moe_ffn's forward passes both projections at once) returns, per array, exactly the slots of
    a call with that array alone, and those are the home experts (zero where unused)."""
    from moonep_jax import _xla

    cfg = make_config(R)
    rng = np.random.default_rng(seed)
    table = slot_table(rng, cfg)
    ws = (rng.standard_normal((cfg.num_experts, D0, D1)).astype(jnp.bfloat16),
          rng.standard_normal((cfg.num_experts, 5)).astype(np.float32),
          rng.standard_normal((cfg.num_experts, 2, 3, 7)).astype(np.float32))

    def both(t, *ws):
        p = rank_plan(None, t, cfg)
        return _xla.prefetch(ws, p, cfg), tuple(_xla.prefetch((w,), p, cfg)[0] for w in ws)

    together, one_by_one = run_per_rank(both, mesh_factory(R), replicated(table, cfg), *ws)
    assert len(together) == len(ws)
    for w, slots, alone in zip(ws, together, one_by_one):
        used = (table >= 0).reshape(table.shape + (1,) * (w.ndim - 1))
        expected = np.where(used, w[np.maximum(table, 0)], np.zeros((), w.dtype))
        assert slots.dtype == w.dtype and slots.shape == expected.shape
        assert np.array_equal(slots, alone) and np.array_equal(slots, expected)


@pytest.mark.parametrize("R", [2, 4])
def test_prefetch_gradient_reduces_slot_cotangents_to_home(mesh_factory, seed, R):
    cfg = make_config(R)
    rng = np.random.default_rng(seed)
    table = slot_table(rng, cfg)
    w = rng.standard_normal((cfg.num_experts, D0, D1)).astype(np.float32)
    d_slots = small_ints(rng, (R * cfg.num_slots, D0, D1))
    mesh = mesh_factory(R)

    def loss(w):
        slots = jax.shard_map(lambda w, t: prefetch(w, rank_plan(None, t, cfg), cfg), mesh=mesh,
                              in_specs=P("ep"), out_specs=P("ep"))(w, replicated(table, cfg))
        return jnp.sum(slots * d_slots)

    d_w = np.asarray(jax.jit(jax.grad(loss))(w))
    expected = np.zeros_like(w)
    for rb, e in enumerate(table.reshape(-1)):
        if e >= 0:
            expected[e] += d_slots[rb]
    assert np.array_equal(d_w, expected)


# ---- reduce_grad --------------------------------------------------------------------------------


def ordered_reduction(g_local, g_slots, table):
    """CONTRACT.md's reduce_grad in NumPy fp32: (rank, slot) ascending, matching slots only."""
    g = g_local.copy()
    for rb, e in enumerate(table.reshape(-1)):
        if e >= 0:
            g[e] = g[e] + g_slots[rb]
    return g


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_reduce_grad_is_bitwise_the_ordered_sum(mesh_factory, seed, R):
    cfg = make_config(R, epn=2)
    rng = np.random.default_rng(seed)
    table = slot_table(rng, cfg)
    g_local = rng.standard_normal((cfg.num_experts, D0, D1)).astype(np.float32)
    g_slots = (rng.standard_normal((R * cfg.num_slots, D0, D1)) * 1e3).astype(np.float32)
    unreplicated = np.setdiff1d(np.arange(cfg.num_experts), table)
    g_local[unreplicated, 0, 0] = -0.0  # skipped slots must not turn -0.0 into +0.0

    out = run_per_rank(lambda g, s, t: reduce_grad(g, s, rank_plan(None, t, cfg), cfg),
                       mesh_factory(R), g_local, g_slots, replicated(table, cfg))
    expected = ordered_reduction(g_local, g_slots, table)
    assert np.array_equal(out.reshape(expected.shape).view(np.uint32), expected.view(np.uint32))


# ---- grouped_matmul -----------------------------------------------------------------------------


def group_of_rows(cu_seqlens, nvs):
    return np.searchsorted(cu_seqlens, np.arange(nvs), side="right")


def weight_of_group(g, r, w, table, cfg):
    return w[g] if g < cfg.num_experts else w[table[r, g - cfg.num_experts]]


def grouped_matmul_inputs(rng, cfg, overflow):
    R, nvs = cfg.num_ranks, cfg.nvs
    table = slot_table(rng, cfg)
    cu = np.cumsum(group_sizes(rng, table, cfg, overflow), axis=1).astype(np.int32)
    w = small_ints(rng, (cfg.num_experts, D0, D1))
    w_slots = np.where((table >= 0)[..., None, None], w[np.maximum(table, 0)], 0)
    x = small_ints(rng, (R * nvs, D0))
    return table, cu, w, w_slots.reshape(R * cfg.num_slots, D0, D1), x


def run_grouped_matmul(cfg, mesh, table, cu, w, w_slots, x):
    def per_rank(x, w, w_slots, cu, t):
        return grouped_matmul(x, w, w_slots, rank_plan(cu, t, cfg), cfg)

    return run_per_rank(per_rank, mesh, x, w, w_slots, cu.reshape(-1), replicated(table, cfg))


@pytest.mark.parametrize("R, B", [(1, None), (2, None), (4, None), (8, None), (2, 1), (4, 2)])
def test_grouped_matmul_equals_per_row_products(mesh_factory, seed, R, B):
    """B < epn includes overflow groups (remote experts in their global rows)."""
    cfg = make_config(R, B=B)
    rng = np.random.default_rng(seed)
    table, cu, w, w_slots, x = grouped_matmul_inputs(rng, cfg, overflow=not cfg.trainable)
    y = run_grouped_matmul(cfg, mesh_factory(R), table, cu, w, w_slots, x)

    x = x.reshape(R, cfg.nvs, D0)
    expected = np.zeros((R, cfg.nvs, D1), np.float32)
    for r in range(R):
        for row, g in enumerate(group_of_rows(cu[r], cfg.nvs)):
            if g < cfg.num_groups:
                expected[r, row] = x[r, row] @ weight_of_group(g, r, w, table, cfg)
    assert np.array_equal(y, expected)


@pytest.mark.parametrize("R", [2, 4])
def test_grouped_matmul_vjp_gives_row_and_group_gradients(mesh_factory, seed, R):
    cfg = make_config(R)
    rng = np.random.default_rng(seed)
    table, cu, w, w_slots, x = grouped_matmul_inputs(rng, cfg, overflow=False)
    d_y = small_ints(rng, (R * cfg.nvs, D1))

    def per_rank(x, w, w_slots, cu, t, d_y):
        plan = rank_plan(cu, t, cfg)
        _, vjp = jax.vjp(lambda *a: grouped_matmul(*a, plan, cfg), x, w, w_slots)
        return vjp(d_y)

    d_x, d_w, d_slots = run_per_rank(per_rank, mesh_factory(R), x, w, w_slots, cu.reshape(-1),
                                     replicated(table, cfg), d_y)
    x, d_y = x.reshape(R, cfg.nvs, D0), d_y.reshape(R, cfg.nvs, D1)
    E, epn = cfg.num_experts, cfg.epn
    expected_x = np.zeros_like(x)
    expected_w = np.zeros((R, epn, D0, D1), np.float32)
    expected_slots = np.zeros((R, cfg.num_slots, D0, D1), np.float32)
    for r in range(R):
        for row, g in enumerate(group_of_rows(cu[r], cfg.nvs)):
            if g == cfg.num_groups:
                continue
            expected_x[r, row] = d_y[r, row] @ weight_of_group(g, r, w, table, cfg).T
            outer = np.outer(x[r, row], d_y[r, row])
            if g < E:
                expected_w[r, g - r * epn] += outer
            else:
                expected_slots[r, g - E] += outer
    assert np.array_equal(d_x, expected_x)
    assert np.array_equal(d_w, expected_w)
    assert np.array_equal(d_slots, expected_slots)


def test_weight_gradient_through_prefetch_is_complete(mesh_factory, seed):
    """`jax.grad` w.r.t. `w_local` of `grouped_matmul(x, w, prefetch(w))` counts every replica."""
    R = 4
    cfg = make_config(R)
    rng = np.random.default_rng(seed)
    table, cu, w, _, x = grouped_matmul_inputs(rng, cfg, overflow=False)
    d_y = small_ints(rng, (R * cfg.nvs, D1))
    mesh = mesh_factory(R)

    def per_rank(x, w, cu, t):
        plan = rank_plan(cu, t, cfg)
        return grouped_matmul(x, w, prefetch(w, plan, cfg), plan, cfg)

    def loss(w):
        y = jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(
            x, w, cu.reshape(-1), replicated(table, cfg))
        return jnp.sum(y * d_y)

    d_w = np.asarray(jax.jit(jax.grad(loss))(w))
    x, d_y = x.reshape(R, cfg.nvs, D0), d_y.reshape(R, cfg.nvs, D1)
    expected = np.zeros_like(w)
    for r in range(R):
        for row, g in enumerate(group_of_rows(cu[r], cfg.nvs)):
            if g < cfg.num_groups:
                e = g if g < cfg.num_experts else table[r, g - cfg.num_experts]
                expected[e] += np.outer(x[r, row], d_y[r, row])
    assert np.array_equal(d_w, expected)


def test_grouped_matmul_gradient_with_overflow_slots_is_rejected(mesh_factory, seed):
    cfg = make_config(2, B=1)
    rng = np.random.default_rng(seed)
    table, cu, w, w_slots, x = grouped_matmul_inputs(rng, cfg, overflow=True)
    mesh = mesh_factory(2)

    def loss(x):
        def per_rank(x, w, w_slots, cu, t):
            return grouped_matmul(x, w, w_slots, rank_plan(cu, t, cfg), cfg)

        return jnp.sum(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(
            x, w, w_slots, cu.reshape(-1), replicated(table, cfg)))

    with pytest.raises(ValueError, match=r"`moonep_jax.grouped_matmul`: gradients need "
                                         r"prefetch_slots == epn \(= 3\); got prefetch_slots = 1"):
        jax.grad(loss)(x)


# ---- trace-time validation ----------------------------------------------------------------------


def trace_grouped_matmul(cfg, mesh, x_dtype, w_dtype, num_slots):
    R, nvs, B = cfg.num_ranks, cfg.nvs, cfg.num_slots

    def per_rank(x, w, w_slots, cu, t):
        return grouped_matmul(x, w, w_slots, rank_plan(cu, t, cfg), cfg)

    args = [jax.ShapeDtypeStruct((R * nvs, D0), x_dtype),
            jax.ShapeDtypeStruct((R * cfg.epn, D0, D1), w_dtype),
            jax.ShapeDtypeStruct((R * num_slots, D0, D1), w_dtype),
            jax.ShapeDtypeStruct((R * cfg.num_groups,), np.int32),
            jax.ShapeDtypeStruct((R * R, B), np.int32)]
    return jax.eval_shape(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")),
                          *args)


def test_grouped_matmul_rejects_wrong_slot_count_and_mixed_dtypes(mesh_factory):
    cfg, mesh = make_config(2), mesh_factory(2)
    with pytest.raises(ValueError, match=r"`w_slots` must have shape \[B, D0, D1\] = \[3, 4, 3\]; "
                                         r"got \[2, 4, 3\]"):
        trace_grouped_matmul(cfg, mesh, np.float32, np.float32, num_slots=2)
    with pytest.raises(TypeError, match=r"`w_local` must have the dtype of `x` \(bfloat16\); "
                                        r"got float32"):
        trace_grouped_matmul(cfg, mesh, jnp.bfloat16, np.float32, num_slots=3)


def test_reduce_grad_requires_float32_gradients(mesh_factory):
    cfg = make_config(2)

    def per_rank(g, s, t):
        return reduce_grad(g, s, rank_plan(None, t, cfg), cfg)

    args = [jax.ShapeDtypeStruct((2 * cfg.epn, D0, D1), jnp.bfloat16),
            jax.ShapeDtypeStruct((2 * cfg.num_slots, D0, D1), np.float32),
            jax.ShapeDtypeStruct((4, cfg.num_slots), np.int32)]
    with pytest.raises(TypeError, match="`g_local` must have dtype float32; got bfloat16"):
        jax.eval_shape(jax.shard_map(per_rank, mesh=mesh_factory(2), in_specs=P("ep"),
                                     out_specs=P("ep")), *args)
