"""The router and the Flax NNX / Equinox MoE modules (xla implementation, 8 simulated CPU devices).

Forward passes are checked against the functional path (`moe_ffn` called directly inside
`jax.shard_map` with the same parameters and routing), the router against NumPy, and training,
shardings and the aux-loss-free bias against their documented behaviour.
"""

from __future__ import annotations

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import moonep_jax
import moonep_jax.equinox as meqx
import moonep_jax.flax as mflax
from moonep_jax import moe_block, router
from moonep_jax.layer import moe_ffn

H, F, FS, E, K = 16, 8, 12, 16, 2
FRAMEWORKS = ("flax", "equinox")

# (mesh shape, axis names, data_axes, axis type): pure EP under Explicit axes, and a
# ("data", "ep") = (2, 4) mesh under Auto axes.
MESHES = {
    "ep8-explicit": ((8,), ("ep",), (), AxisType.Explicit),
    "data2-ep4-auto": ((2, 4), ("data", "ep"), ("data",), AxisType.Auto),
}


def make_mesh(name):
    shape, names, data_axes, axis_type = MESHES[name]
    size = int(np.prod(shape))
    if jax.device_count() < size:
        pytest.skip(f"needs {size} devices, have {jax.device_count()}")
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                         devices=jax.devices()[:size])
    return mesh, data_axes


def build(framework, mesh, seed, **options):
    """A module with a skewed router: row 0 of `router_w` strongly prefers the low experts."""
    kwargs = dict(mesh=mesh, implementation="xla", **options)
    if framework == "flax":
        moe = mflax.MoE(H, F, E, K, rngs=nnx.Rngs(seed), **kwargs)
    else:
        moe = meqx.MoE(H, F, E, K, key=jax.random.key(seed), **kwargs)
    hot = np.linspace(4.0, 0.0, E, dtype=np.float32)  # feature 0 of the tokens is always 1
    router_w = np.asarray(moe.params()["router_w"]).copy()
    router_w[0] = hot
    return set_param(moe, "router_w", jnp.asarray(router_w))


def set_param(moe, name, value):
    """`moe` with parameter `name` replaced (placed like the old value)."""
    value = jax.device_put(value, moe.params()[name].sharding)
    if isinstance(moe, nnx.Module):
        getattr(moe, name)[...] = value
        return moe
    moe = eqx.tree_at(lambda m: getattr(m, name), moe, value)
    return meqx.shard(moe)


def tokens(seed, mesh, data_axes, num_tokens):
    x = np.random.default_rng(seed).normal(size=(num_tokens, H)).astype(np.float32)
    x[:, 0] = 1.0
    return jax.device_put(x, NamedSharding(mesh, P((*data_axes, "ep"), None)))


def functional_path(x, params, mesh, data_axes, options):
    """`moe_ffn` called directly per shard with the router's routing, plus the shared expert."""
    token_axes = (*data_axes, "ep")
    shards = int(np.prod([mesh.shape[a] for a in token_axes]))
    cfg = moe_block.MoESpec(num_experts=E, top_k=K, hidden=H, ffn_hidden=F, mesh=mesh,
                         data_axes=data_axes, implementation="xla",
                         **options).ep_config(x.shape[0])
    assert cfg.tokens_per_rank * shards == x.shape[0]

    def per_shard(x, p):
        logits = x @ p["router_w"]
        topk_idx, topk_w = router.route(logits, K, score_fn=options.get("score_fn", "softmax"),
                                        bias=p.get("router_bias"))
        y = moe_ffn(x, topk_idx, topk_w, {"w_gate_up": p["w_gate_up"], "w_down": p["w_down"]},
                    cfg)
        if "shared_w_gate_up" in p:
            h = x @ p["shared_w_gate_up"]
            y = y + (jax.nn.silu(h[:, :FS]) * h[:, FS:]) @ p["shared_w_down"]
        return y, topk_idx

    specs = {name: spec for name, spec in moe_block.param_specs(
        moe_block.MoESpec(num_experts=E, top_k=K, hidden=H, ffn_hidden=F, mesh=mesh,
                       **options)).items() if name in params}
    return jax.jit(jax.shard_map(
        per_shard, mesh=mesh, in_specs=(P(token_axes, None), specs),
        out_specs=(P(token_axes, None), P(token_axes, None))))(x, params)


OPTIONS = {
    "softmax": {},
    "sigmoid-bias-shared": {"score_fn": "sigmoid", "router_bias": True, "shared_ffn_hidden": FS},
}


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("mesh_name,option_name", [("ep8-explicit", "softmax"),
                                                   ("data2-ep4-auto", "sigmoid-bias-shared")])
def test_forward_equals_functional_moe_ffn(framework, mesh_name, option_name, seed):
    mesh, data_axes = make_mesh(mesh_name)
    options = OPTIONS[option_name]
    moe = build(framework, mesh, seed, data_axes=data_axes, **options)
    if options.get("router_bias"):  # a non-zero bias, so that it really steers the selection
        bias = np.random.default_rng(seed).normal(scale=0.3, size=E).astype(np.float32)
        moe = set_param(moe, "router_bias", jnp.asarray(bias))
    x = tokens(seed + 1, mesh, data_axes, num_tokens=64)

    if framework == "flax":
        y, aux = nnx.jit(lambda m, x: m(x))(moe, x)
    else:
        y, aux = eqx.filter_jit(lambda m, x: m(x))(moe, x)
    y_ref, topk_idx = functional_path(x, moe.params(), mesh, data_axes, options)

    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-6)
    counts = np.bincount(np.asarray(topk_idx).ravel(), minlength=E)
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), counts)
    expected_maxvio = counts.max() / counts.mean() - 1
    assert expected_maxvio > 1.0, "the routing must be skewed for the balance check to mean much"
    np.testing.assert_allclose(float(aux["maxvio"]), expected_maxvio, rtol=1e-6)
    shards = int(np.prod(mesh.devices.shape))
    slots_per_rank = 64 // shards * K
    np.testing.assert_array_equal(np.asarray(aux["recv_slots"]), np.full(shards, slots_per_rank))


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_route_matches_numpy_with_bias_for_selection_only(score_fn, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(32, E)).astype(np.float32)
    bias = rng.normal(scale=0.5, size=E).astype(np.float32)
    topk_idx, topk_w = router.route(jnp.asarray(logits), 3, score_fn=score_fn,
                                    bias=jnp.asarray(bias))

    if score_fn == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    expected_idx = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :3]
    expected_w = np.take_along_axis(scores, expected_idx, -1)
    expected_w /= expected_w.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(topk_idx), expected_idx)
    np.testing.assert_allclose(np.asarray(topk_w), expected_w, rtol=1e-5)
    unbiased_idx = np.argsort(-scores, axis=-1, kind="stable")[:, :3]
    assert not np.array_equal(unbiased_idx, expected_idx), "the bias must change some selection"

    grad_bias = jax.grad(lambda b: jnp.sum(router.route(
        jnp.asarray(logits), 3, score_fn=score_fn, bias=b)[1] ** 2))(jnp.asarray(bias))
    np.testing.assert_array_equal(np.asarray(grad_bias), np.zeros(E, np.float32))


def test_update_bias_follows_sign_rule():
    bias = jnp.asarray([0.5, -0.25, 0.0, 1.0], jnp.float32)
    counts = jnp.asarray([5, 1, 3, 3], jnp.int32)  # mean 3
    new = router.update_bias(bias, counts, 0.125)
    np.testing.assert_array_equal(np.asarray(new),
                                  np.asarray([0.375, -0.125, 0.0, 1.0], np.float32))


# optax's Adam bias correction raises `float ** int32` under the suite's strict dtype promotion,
# so optimizer steps trace with standard promotion.
def standard_promotion():
    return jax.numpy_dtype_promotion("standard")


def regression_data(seed, mesh):
    """Inputs and targets of a smooth teacher, sharded over the tokens."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(128, H)).astype(np.float32)
    teacher = rng.normal(size=(H, H)).astype(np.float32) / np.sqrt(H)
    target = np.tanh(x @ teacher).astype(np.float32)
    sharding = NamedSharding(mesh, P("ep", None))
    return jax.device_put(x, sharding), jax.device_put(target, sharding)


def mse(y, target):
    return jnp.mean((y - target) ** 2)


def assert_expert_specs(tree_specs, expected):
    for name, spec in expected.items():
        assert tree_specs[name] == spec, (name, tree_specs[name], spec)


def test_flax_trains_with_optax_and_keeps_declared_shardings(seed):
    mesh, _ = make_mesh("ep8-explicit")
    moe = mflax.MoE(H, F, E, K, mesh=mesh, rngs=nnx.Rngs(seed), implementation="xla",
                    shared_ffn_hidden=FS, router_bias=True)
    declared = moe_block.param_specs(moe.spec)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    # Declared (metadata) and actual placement agree.
    metadata_specs = {k: v.get_value() for k, v in nnx.get_partition_spec(params).items()}
    assert_expert_specs(metadata_specs, {k: v for k, v in declared.items() if k != "router_bias"})
    assert_expert_specs({k: v.get_value().sharding.spec for k, v in params.items()},
                        {k: v for k, v in declared.items() if k != "router_bias"})
    assert "router_bias" not in params and moe.router_bias[...].sharding.spec == P(None)

    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    x, target = regression_data(seed, mesh)

    @jax.jit
    def step(params, rest, opt_state):
        def loss_fn(params):
            y, aux = nnx.merge(graphdef, params, rest)(x)
            return mse(y, target), aux
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads, aux

    losses = []
    with standard_promotion():
        for _ in range(15):
            params, opt_state, loss, grads, aux = step(params, rest, opt_state)
            losses.append(float(loss))
    assert losses[-1] < 0.6 * losses[0], losses
    assert_expert_specs({k: v.get_value().sharding.spec for k, v in grads.items()},
                        {k: v for k, v in declared.items() if k != "router_bias"})
    assert_expert_specs({k: v.get_value().sharding.spec for k, v in params.items()},
                        {k: v for k, v in declared.items() if k != "router_bias"})

    # The bias is state: untouched by the optimizer, moved only by update_router_bias.
    moe = nnx.merge(graphdef, params, rest)
    np.testing.assert_array_equal(np.asarray(moe.router_bias[...]), np.zeros(E, np.float32))
    moe.update_router_bias(aux["expert_counts"], 0.01)
    expected = router.update_bias(jnp.zeros(E, jnp.float32), aux["expert_counts"], 0.01)
    np.testing.assert_array_equal(np.asarray(moe.router_bias[...]), np.asarray(expected))
    assert np.any(np.asarray(expected) != 0)


def test_equinox_trains_with_filter_jit_and_filter_grad(seed):
    mesh, _ = make_mesh("ep8-explicit")
    moe = meqx.shard(meqx.MoE(H, F, E, K, mesh=mesh, key=jax.random.key(seed),
                              implementation="xla", shared_ffn_hidden=FS, router_bias=True))
    declared = moe.partition_specs()
    assert_expert_specs({k: v.sharding.spec for k, v in moe.params().items()}, declared)

    tx = optax.adamw(1e-2, weight_decay=0.0)
    opt_state = tx.init(eqx.filter(moe, eqx.is_inexact_array))
    x, target = regression_data(seed, mesh)

    @eqx.filter_jit
    def step(moe, opt_state):
        @eqx.filter_grad(has_aux=True)
        def grad_fn(moe):
            y, aux = moe(x)
            return mse(y, target), aux
        grads, aux = grad_fn(moe)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(moe, eqx.is_inexact_array))
        return eqx.apply_updates(moe, updates), opt_state, grads, mse(moe(x)[0], target)

    losses = []
    with standard_promotion():
        for _ in range(15):
            moe, opt_state, grads, loss = step(moe, opt_state)
            losses.append(float(loss))
    assert losses[-1] < 0.6 * losses[0], losses
    assert_expert_specs({k: v.sharding.spec for k, v in grads.params().items()}, declared)
    assert_expert_specs({k: v.sharding.spec for k, v in moe.params().items()}, declared)
    np.testing.assert_array_equal(np.asarray(grads.router_bias), np.zeros(E, np.float32))

    counts = jnp.asarray(np.arange(E, dtype=np.int32))
    updated = moe.update_router_bias(counts, 0.5)
    np.testing.assert_array_equal(np.asarray(updated.router_bias),
                                  np.asarray(router.update_bias(moe.router_bias, counts, 0.5)))


# ---- errors -------------------------------------------------------------------------------


def test_rejects_missing_mesh_axis():
    mesh, _ = make_mesh("ep8-explicit")
    with pytest.raises(ValueError, match="'model'.* not in the mesh axes"):
        mflax.MoE(H, F, E, K, mesh=mesh, rngs=nnx.Rngs(0), axis_name="model")


def test_rejects_experts_not_divisible_by_ranks():
    mesh, _ = make_mesh("ep8-explicit")
    with pytest.raises(ValueError, match="E % R == 0"):
        meqx.MoE(H, F, 12, K, mesh=mesh, key=jax.random.key(0))


def test_rejects_bad_score_fn_and_top_k():
    mesh, _ = make_mesh("ep8-explicit")
    with pytest.raises(ValueError, match="`score_fn` must be one of"):
        meqx.MoE(H, F, E, K, mesh=mesh, key=jax.random.key(0), score_fn="relu")
    with pytest.raises(ValueError, match="1 <= K <= E"):
        meqx.MoE(H, F, E, E + 1, mesh=mesh, key=jax.random.key(0))


def test_rejects_bad_token_shapes():
    mesh, _ = make_mesh("ep8-explicit")
    moe = meqx.MoE(H, F, E, K, mesh=mesh, key=jax.random.key(0), implementation="xla")
    with pytest.raises(ValueError,
                       match=r"`x` must have shape \[T, H\] = \[T, 16\]; got \[64, 4\]"):
        moe(jnp.zeros((64, 4), jnp.float32))
    with pytest.raises(ValueError, match="multiple of the 8 token shards"):
        moe(jnp.zeros((60, H), jnp.float32))


def test_update_router_bias_needs_a_bias():
    mesh, _ = make_mesh("ep8-explicit")
    moe = mflax.MoE(H, F, E, K, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="router_bias=False"):
        moe.update_router_bias(jnp.zeros(E, jnp.int32), 0.1)


# ---- GPU: the module on the CUDA implementation --------------------------------------------


@pytest.mark.gpu
def test_flax_module_cuda_matches_xla_forward_and_grads(seed):
    num_ranks = max(r for r in (1, 2, 4, 8) if r <= jax.device_count())
    if num_ranks < 2:
        pytest.skip("needs at least 2 GPUs")
    mesh = jax.make_mesh((num_ranks,), ("ep",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:num_ranks])
    moonep_jax.bootstrap(mesh, "ep")  # before tracing: tracing has no side effects
    hidden, ffn = 64, 32  # the CUDA grouped GEMM wants bf16 and rows of a multiple of 8 elements
    moes = {impl: mflax.MoE(hidden, ffn, E, K, mesh=mesh, rngs=nnx.Rngs(seed),
                            implementation=impl, shared_ffn_hidden=32, param_dtype=jnp.bfloat16)
            for impl in ("cuda", "xla")}
    x = np.random.default_rng(seed).normal(size=(64 * num_ranks, hidden)).astype(np.float32)
    x = jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, P("ep", None)))

    def value_and_grads(moe):
        graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

        @jax.jit
        def f(params, x):
            def loss(params, x):
                y, aux = nnx.merge(graphdef, params, rest)(x)
                return jnp.sum(y.astype(jnp.float32) ** 2), (y, aux)
            return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)

        (_, (y, aux)), (d_params, dx) = f(params, x)
        return y, aux, d_params, dx

    y_cuda, aux_cuda, dp_cuda, dx_cuda = value_and_grads(moes["cuda"])
    y_xla, aux_xla, dp_xla, dx_xla = value_and_grads(moes["xla"])
    for key in ("expert_counts", "recv_slots"):
        np.testing.assert_array_equal(np.asarray(aux_cuda[key]), np.asarray(aux_xla[key]))
    assert np.all(np.asarray(aux_cuda["recv_slots"]) == 64 * K)

    def close(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-2 * np.abs(b).max())

    close(y_cuda, y_xla)
    close(dx_cuda, dx_xla)
    for name in ("router_w", "w_gate_up", "w_down", "shared_w_gate_up", "shared_w_down"):
        close(dp_cuda[name].get_value(), dp_xla[name].get_value())
        declared = moe_block.param_specs(moes["cuda"].spec)[name]
        assert dp_cuda[name].get_value().sharding.spec == declared


# ---- eager calls ---------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_eager_calls_reuse_one_compiled_block_and_equal_jit(framework, seed):
    """An un-jitted `moe(x)` compiles the shard_mapped block once per configuration: the second
    eager call is fast (a generous bound: it was 35-70 s when every call ran the block op by op)
    and gives what the jitted call gives."""
    mesh, data_axes = make_mesh("ep8-explicit")
    moe = build(framework, mesh, seed)
    x = tokens(seed, mesh, data_axes, 64)
    y_jit, aux_jit = jax.jit(lambda x: moe(x))(x)
    jax.block_until_ready(moe(x))  # first eager call: compiles the block
    start = time.perf_counter()
    y, aux = jax.block_until_ready(moe(x))
    seconds = time.perf_counter() - start
    assert seconds < 2.0, f"second eager call took {seconds:.1f} s"
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_jit))
    for name in aux_jit:
        np.testing.assert_array_equal(np.asarray(aux[name]), np.asarray(aux_jit[name]))


# ---- what a new user meets: default meshes, unplaced inputs, forward-mode autodiff ---------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_unsharded_tokens_on_a_default_make_mesh_are_placed(framework, seed):
    """`jax.make_mesh` gives Explicit axes; an unsharded host `x` is resharded, not refused."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((8,), ("ep",), devices=jax.devices()[:8])
    assert mesh.axis_types == (AxisType.Explicit,)
    moe = build(framework, mesh, seed)
    x = tokens(seed, mesh, (), 64)
    y_placed, aux_placed = jax.jit(lambda x: moe(x))(x)
    y, aux = moe(np.asarray(x))  # a NumPy array: no sharding at all
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_placed))
    for name in aux_placed:
        np.testing.assert_array_equal(np.asarray(aux[name]), np.asarray(aux_placed[name]))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_forward_mode_autodiff_names_what_is_supported(framework, seed):
    mesh, data_axes = make_mesh("ep8-explicit")
    moe = build(framework, mesh, seed)
    x = tokens(seed, mesh, data_axes, 64)
    with pytest.raises(TypeError, match=r"forward-mode autodiff .* is not supported.*jax\.grad"):
        jax.jvp(lambda x: moe(x)[0], (x,), (x,))


def test_block_plans_each_layer_once(mesh_factory, monkeypatch):
    """The block hands its plan (the one its aux reads) to moe_ffn: one plan per block call."""
    from moonep_jax import _xla

    mesh = mesh_factory(4)
    spec = moe_block.MoESpec(num_experts=E, top_k=K, hidden=H, ffn_hidden=F, mesh=mesh,
                             implementation="xla")
    params = moe_block.init_params(jax.random.key(3), spec)
    plans = []
    monkeypatch.setattr(_xla, "plan", lambda *a, plan_xla=_xla.plan: plans.append(1) or plan_xla(*a))
    moe_block._sharded_block.cache_clear()  # trace now, even if an earlier test traced this spec
    y, aux = moe_block.moe_block(tokens(3, mesh, (), 32), params, spec)
    assert len(plans) == 1
    assert np.asarray(aux["recv_slots"]).tolist() == [8 * K] * 4
