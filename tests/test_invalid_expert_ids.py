"""Expert ids outside `[-1, E)` (xla reference): dropped like -1, counted, and checkable.

The GPU counterpart (CUDA planner bitwise equal to the xla one on invalid ids, count included) is
`test_plan_cuda.py::test_plan_with_invalid_ids_bitwise_equal_to_xla`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import NamedSharding, PartitionSpec as P

import moonep_jax
from moonep_jax.layer import moe_ffn
from moonep_jax.plan import plan

from _routings import distinct_top_k, drop_entries

R, S, K, E, H, F = 4, 8, 3, 16, 8, 4


def make_config(**overrides):
    kwargs = dict(num_experts=E, top_k=K, tokens_per_rank=S, hidden=H, ffn_hidden=F, num_ranks=R,
                  implementation="xla")
    return moonep_jax.EPConfig(**{**kwargs, **overrides})


def routing_with_invalid_ids(seed):
    """A skewed global `[R*S, K]` routing with -1 entries, the same with ~20% of its entries
    replaced by invalid ids, and the mask of those entries."""
    rng = np.random.default_rng(seed)
    hot = np.where(np.arange(E) < E // R, np.log(8.0), 0.0)  # rank 0's experts 8x as hot
    topk_idx = drop_entries(distinct_top_k(rng, hot, R, S, K), rng, 0.1).reshape(R * S, K)
    invalid = rng.random(topk_idx.shape) < 0.2
    invalid[rng.integers(R * S), rng.integers(K)] = True  # never none
    choices = np.array([E, E + 3, 1000, 2**31 - 1, -2, -(2**31)], np.int64)
    bad = topk_idx.copy()
    bad[invalid] = rng.choice(choices, size=int(invalid.sum())).astype(np.int32)
    return topk_idx, bad, invalid


def layer_inputs(seed):
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((R * S, H)).astype(np.float32)
    topk_w = rng.random((R * S, K)).astype(np.float32)
    w_gate_up = (rng.standard_normal((E, H, 2 * F)) / np.sqrt(H)).astype(np.float32)
    w_down = (rng.standard_normal((E, F, H)) / np.sqrt(F)).astype(np.float32)
    return x, topk_w, w_gate_up, w_down


def layer_and_count(cfg, mesh):
    """Global `(x, topk_idx, topk_w, w_gate_up, w_down) -> (out, num_invalid_ids [R])`."""
    def per_rank(x, topk_idx, topk_w, w_gate_up, w_down):
        out = moe_ffn(x, topk_idx, topk_w, {"w_gate_up": w_gate_up, "w_down": w_down}, cfg)
        return out, plan(topk_idx, cfg).num_invalid_ids

    return jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))


def test_layer_with_invalid_ids_equals_the_layer_with_those_ids_dropped(mesh_factory, seed):
    """Output and gradients bitwise equal to the same routing with the invalid ids set to -1."""
    cfg, mesh = make_config(), mesh_factory(R)
    _, bad, invalid = routing_with_invalid_ids(seed)
    as_dropped = np.where(invalid, -1, bad)
    x, topk_w, w_gate_up, w_down = layer_inputs(seed)
    layer = layer_and_count(cfg, mesh)

    @jax.jit
    def run(topk_idx):
        def loss(x, topk_w, w_gate_up, w_down):
            out, count = layer(x, topk_idx, topk_w, w_gate_up, w_down)
            return (out * out).sum(), (out, count)

        grads, (out, count) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            x, topk_w, w_gate_up, w_down)
        return out, count, grads

    out_bad, count_bad, grads_bad = jax.tree.map(np.asarray, run(bad))
    out_ref, count_ref, grads_ref = jax.tree.map(np.asarray, run(as_dropped))
    assert count_bad.tolist() == invalid.reshape(R, -1).sum(axis=1).tolist()
    assert count_ref.tolist() == [0] * R
    assert np.array_equal(out_bad, out_ref)
    for got, want in zip(grads_bad, grads_ref):
        assert np.array_equal(got, want)


def test_check_expert_ids_raises_naming_the_count(mesh_factory, seed):
    cfg, mesh = make_config(check_expert_ids=True), mesh_factory(R)
    valid, bad, invalid = routing_with_invalid_ids(seed)
    x, topk_w, w_gate_up, w_down = layer_inputs(seed)
    checked = jax.jit(checkify.checkify(layer_and_count(cfg, mesh)))

    error, (_, count) = checked(x, valid, topk_w, w_gate_up, w_down)
    error.throw()  # a routing without invalid ids passes
    assert np.asarray(count).tolist() == [0] * R

    error, _ = checked(x, bad, topk_w, w_gate_up, w_down)
    per_rank = invalid.reshape(R, -1).sum(axis=1)
    with pytest.raises(checkify.JaxRuntimeError) as raised:
        error.throw()
    # checkify reports one failing shard (not necessarily the first): its rank and count.
    reported = re.search(r"`topk_idx` of EP rank (\d+) has (\d+) expert ids outside "
                         rf"\[-1, E\) = \[-1, {E}\)", str(raised.value))
    assert reported, str(raised.value)
    assert int(reported[2]) == per_rank[int(reported[1])] > 0


def test_check_expert_ids_without_checkify_fails_at_trace_time(mesh_factory):
    cfg, mesh = make_config(check_expert_ids=True), mesh_factory(R)
    f = jax.jit(jax.shard_map(lambda t: plan(t, cfg).dst, mesh=mesh, in_specs=P("ep"),
                              out_specs=P("ep")))
    with pytest.raises(ValueError, match="checkify"):
        f.lower(jax.ShapeDtypeStruct((R * S, K), np.int32))


def test_check_expert_ids_must_be_a_bool():
    with pytest.raises(TypeError, match="`EPConfig.check_expert_ids` must be a bool"):
        make_config(check_expert_ids=1)


def make_module(framework, mesh, seed, **kwargs):
    kwargs = dict(hidden=H, ffn_hidden=F, num_experts=E, top_k=K, mesh=mesh, **kwargs)
    if framework == "flax":
        from flax import nnx

        import moonep_jax.flax

        return moonep_jax.flax.MoE(**kwargs, rngs=nnx.Rngs(seed))
    import moonep_jax.equinox

    return moonep_jax.equinox.shard(moonep_jax.equinox.MoE(**kwargs, key=jax.random.key(seed)))


@pytest.mark.parametrize("framework", ["flax", "equinox"])
def test_modules_count_invalid_ids_in_aux(mesh_factory, seed, monkeypatch, framework):
    """A broken router's invalid ids reach `aux["num_invalid_ids"]` (summed over the batch)."""
    from moonep_jax import moe_block

    mesh = mesh_factory(R)
    route = moe_block.route

    def broken_route(logits, top_k, **kwargs):  # every even token's first choice becomes E + 7
        topk_idx, topk_w = route(logits, top_k, **kwargs)
        even = jnp.arange(topk_idx.shape[0]) % 2 == 0
        return topk_idx.at[:, 0].set(jnp.where(even, E + 7, topk_idx[:, 0])), topk_w

    x = jax.device_put(np.random.default_rng(seed).standard_normal((R * S, H)).astype(np.float32),
                       NamedSharding(mesh, P("ep")))
    moe = make_module(framework, mesh, seed, implementation="xla")
    monkeypatch.setattr(moe_block, "route", broken_route)
    moe_block._sharded_block.cache_clear()  # the cached block was traced with the real router
    try:
        _, aux = jax.jit(lambda x: moe(x))(x)
    finally:
        moe_block._sharded_block.cache_clear()
    assert aux["num_invalid_ids"].dtype == np.int32 and aux["num_invalid_ids"].shape == ()
    assert int(aux["num_invalid_ids"]) == R * S // 2
