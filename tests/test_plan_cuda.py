"""The CUDA planner against the xla reference, bit for bit, and the transport's mesh plumbing.

GPU tests (marked `gpu`) run the public `moonep_jax.plan` with implementation "cuda" and "xla" on
the same routings and require `np.array_equal` on every Plan field, on R = 1, 2 and all local GPUs,
over maxvio 0 / 0.2 / 1 / 10 / 20 with dropped (-1) entries and duplicate ids, and with invalid
ids (outside [-1, E)), which both drop and count. 1000 back-to-back calls with changing routings
(one chunk per kernel grid, or many chunks with the shapes changing from call to call) run in
subprocesses, once with XLA's default command buffers and once with them disabled. The CPU
tests cover how the transport finds EP groups and reports a mesh it cannot see.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import moonep_jax
from moonep_jax import _ffi, routing
from moonep_jax._cuda import transport

plan_module = importlib.import_module("moonep_jax.plan")

MAXVIOS = (0.0, 0.2, 1.0, 10.0, 20.0)
# (S, K, E, B, tp): training-style B = epn; inference overflow with B < epn and padding.
GEOMETRIES = ((256, 8, 32, None, 1), (96, 6, 48, 2, 4))


def _gpu_count() -> int:
    return len(jax.devices()) if jax.default_backend() == "gpu" else 0


def _rank_counts() -> list[int]:
    return sorted({r for r in (1, 2, _gpu_count()) if 1 <= r <= max(_gpu_count(), 1)})


def _mesh(R: int) -> jax.sharding.Mesh:
    if _gpu_count() < R:
        pytest.skip(f"needs {R} GPUs, have {_gpu_count()}")
    return jax.sharding.Mesh(np.array(jax.devices()[:R]), ("ep",))


def _config(R, S, K, E, B, tp, implementation, axis_name="ep"):
    return moonep_jax.EPConfig(num_experts=E, top_k=K, tokens_per_rank=S, hidden=8, ffn_hidden=8,
                               num_ranks=R, prefetch_slots=B, token_padding=tp,
                               axis_name=axis_name, implementation=implementation)


def _plan_both(mesh, topk_idx, cfg_cuda, cfg_xla):
    """Both plans of the global `topk_idx [R, S, K]`, as numpy Plans with a leading rank axis."""

    def per_rank(idx):
        plans = (plan_module.plan(idx, cfg_cuda), plan_module.plan(idx, cfg_xla))
        return jax.tree.map(lambda a: a[None], plans)

    R, S, K = topk_idx.shape
    f = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    sharded = jax.device_put(np.asarray(topk_idx, np.int32).reshape(R * S, K),
                             NamedSharding(mesh, P("ep")))
    return jax.tree.map(np.asarray, f(sharded))


def _routing(seed, R, S, K, E, maxvio):
    """Global `[R, S, K]` routing near `maxvio`, with 5% dropped entries and 5% duplicate tokens."""
    key = jax.random.key(seed)
    if maxvio == 0.0:  # exactly balanced counts: a permuted round-robin over all R*S*K entries
        perm = np.random.default_rng(seed).permutation(E)
        topk = perm[np.arange(R * S * K) % E].reshape(R, S, K)
    else:
        topk, _, _ = routing.lognormal_for_maxvio(key, R, S, K, E, maxvio)
    topk = routing.with_duplicates(jax.random.fold_in(key, 1), topk, 0.05)
    topk = routing.with_dropped(jax.random.fold_in(key, 2), topk, 0.05)
    return np.asarray(topk, np.int32)


def _assert_plans_equal(cuda, xla):
    for field in (f.name for f in dataclasses.fields(moonep_jax.Plan)):
        got, want = getattr(cuda, field), getattr(xla, field)
        assert got.shape == want.shape, field
        mismatch = np.argwhere(got != want)
        assert np.array_equal(got, want), (
            f"{field}: {len(mismatch)} mismatches, first at {mismatch[:3].tolist()}")


@pytest.mark.gpu
@pytest.mark.parametrize("R", _rank_counts())
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("maxvio", MAXVIOS)
def test_plan_bitwise_equal_to_xla(R, geometry, maxvio, seed):
    S, K, E, B, tp = geometry
    if E % R:
        pytest.skip(f"E={E} is not divisible by R={R}")
    mesh = _mesh(R)
    transport.bootstrap(mesh, "ep")
    topk = _routing(seed, R, S, K, E, maxvio)
    cuda, xla = _plan_both(mesh, topk, _config(R, S, K, E, B, tp, "cuda"),
                           _config(R, S, K, E, B, tp, "xla"))
    _assert_plans_equal(cuda, xla)
    assert (cuda.dst == moonep_jax.DROPPED).sum() == (topk == -1).sum()


@pytest.mark.gpu
def test_plan_record_shape_bitwise_equal_to_xla(seed):
    """The shape of record (S=8192, K=8, E=384) on all local GPUs, at the worst skew."""
    R = _gpu_count()
    if R == 0 or 384 % R:
        pytest.skip("needs 1, 2, 3, 4, 6 or 8 GPUs")
    mesh = _mesh(R)
    transport.bootstrap(mesh, "ep")
    topk = _routing(seed, R, 8192, 8, 384, 20.0)
    cuda, xla = _plan_both(mesh, topk, _config(R, 8192, 8, 384, None, 1, "cuda"),
                           _config(R, 8192, 8, 384, None, 1, "xla"))
    _assert_plans_equal(cuda, xla)


@pytest.mark.gpu
def test_plan_found_under_set_mesh(seed):
    """Under `jax.set_mesh` the op finds its bootstrapped mesh from the abstract one."""
    R = _gpu_count()
    mesh = _mesh(R)
    transport.bootstrap(mesh, "ep")
    S, K, E = 64, 4, 8 * R
    topk = _routing(seed, R, S, K, E, 1.0)
    with jax.set_mesh(mesh):
        cuda, xla = _plan_both(mesh, topk, _config(R, S, K, E, None, 2, "cuda"),
                               _config(R, S, K, E, None, 2, "xla"))
    _assert_plans_equal(cuda, xla)


@pytest.mark.gpu
@pytest.mark.parametrize("E, K, S, R", [(384, 8, 8192, 1), (384, 8, 8192, 8), (2048, 8, 256, 8),
                                        (32, 4, 16, 1)])
def test_plan_enqueues_two_kernels(E, K, S, R):
    """The planner as the FFI handler launches it, captured into a CUDA graph (nothing runs): two
    kernel nodes and nothing else, at the record shape, the largest E and a one-chunk grid."""
    assert _ffi.lib().plan_graph_nodes(E, K, S, R) == (2, 0)


# ---- back-to-back calls, with and without XLA command buffers (subprocesses: flags are global) ---

_BACK_TO_BACK = textwrap.dedent("""
    import hashlib, importlib, json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import moonep_jax
    from moonep_jax._cuda import transport
    plan_module = importlib.import_module("moonep_jax.plan")

    # Calls cycle through the shapes [S, K, experts per rank, fraction of invalid ids].
    seed, shapes = int(sys.argv[1]), json.loads(sys.argv[2])
    R, CALLS = len(jax.devices()), 1000
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
    transport.bootstrap(mesh, "ep")

    def plans(S, K, E):
        cfg = dict(num_experts=E, top_k=K, tokens_per_rank=S, hidden=8, ffn_hidden=8,
                   num_ranks=R, token_padding=2)
        cfgs = [moonep_jax.EPConfig(**cfg, implementation=i) for i in ("cuda", "xla")]
        return [jax.jit(jax.shard_map(lambda idx, c=c: jax.tree.map(lambda a: a[None],
                                                                    plan_module.plan(idx, c)),
                                      mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
                for c in cfgs]

    fns = [plans(S, K, epr * R) for S, K, epr, _ in shapes]
    rng = np.random.default_rng(seed)
    digests = [hashlib.sha256(), hashlib.sha256()]
    sharding = NamedSharding(mesh, P("ep"))
    outs = [[], []]
    for call in range(CALLS):
        S, K, epr, invalid = shapes[call % len(shapes)]
        E, fs = epr * R, fns[call % len(shapes)]
        # K distinct experts per token from a fresh log-normal popularity (Gumbel top-k).
        scores = rng.normal(0.0, 3.0 * rng.random(), size=E) + rng.gumbel(size=(R * S, E))
        topk = np.argsort(-scores, axis=1)[:, :K].astype(np.int32)
        topk[rng.random(topk.shape) < 0.05] = -1
        bad = rng.random(topk.shape) < invalid
        topk[bad] = rng.choice(np.array([E, 1000, -2], np.int32), size=int(bad.sum()))
        x = jax.device_put(topk, sharding)
        for j, f in enumerate(fs):
            outs[j].append(f(x))   # enqueue back to back; read after the loop
    for j in range(2):
        for plan in outs[j]:
            for leaf in jax.tree.leaves(plan):
                digests[j].update(np.asarray(leaf).tobytes())
    cuda, xla = (d.hexdigest() for d in digests)
    print("digests", cuda, xla)
    sys.exit(0 if cuda == xla else 3)
""")


# [S, K, experts per rank, fraction of invalid ids] per call, cycled. One chunk per grid; or
# grids of 40 (3 blocks of chunks, the last one partial), 8 and 32 CTAs in turn, with invalid ids
# in every third call: each call's tickets, block sums and invalid count must start from zero.
ONE_CHUNK = [[64, 4, 8, 0.0]]
MANY_CHUNKS = [[2500, 8, 16, 0.0], [600, 6, 12, 0.01], [4096, 4, 8, 0.0]]


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [ONE_CHUNK, MANY_CHUNKS], ids=["one_chunk", "many_chunks"])
@pytest.mark.parametrize("command_buffers", [True, False], ids=["command_buffers", "no_command_buffers"])
def test_plan_back_to_back_calls_hash_equal_to_xla(command_buffers, shapes, seed):
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_gpu_enable_command_buffer")]
    if not command_buffers:
        flags.append("--xla_gpu_enable_command_buffer=")
    env = dict(os.environ, XLA_FLAGS=" ".join(flags))
    proc = subprocess.run([sys.executable, "-c", _BACK_TO_BACK, str(seed), json.dumps(shapes)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("R", _rank_counts())
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_plan_with_invalid_ids_bitwise_equal_to_xla(R, geometry, seed):
    """Ids outside [-1, E) (E, 1000, INT32_MAX, -2, INT32_MIN) in a skewed routing with -1 entries:
    the CUDA planner drops and counts them exactly as the xla one (no trap), every field bitwise."""
    S, K, E, B, tp = geometry
    if E % R:
        pytest.skip(f"E={E} is not divisible by R={R}")
    mesh = _mesh(R)
    transport.bootstrap(mesh, "ep")
    topk = _routing(seed, R, S, K, E, 10.0).copy()  # writable
    rng = np.random.default_rng(seed)
    invalid = rng.random(topk.shape) < 0.1
    invalid[0, 0, 0] = True
    choices = np.array([E, E + 1, 1000, 2**31 - 1, -2, -(2**31)], np.int64)
    topk[invalid] = rng.choice(choices, size=int(invalid.sum())).astype(np.int32)
    cuda, xla = _plan_both(mesh, topk, _config(R, S, K, E, B, tp, "cuda"),
                           _config(R, S, K, E, B, tp, "xla"))
    _assert_plans_equal(cuda, xla)
    assert cuda.num_invalid_ids[:, 0].tolist() == invalid.reshape(R, -1).sum(axis=1).tolist()
    assert (cuda.dst == moonep_jax.DROPPED).sum() == (topk == -1).sum() + invalid.sum()
    # The group keeps working after a call with invalid ids.
    cuda, xla = _plan_both(mesh, np.where(invalid, -1, topk), _config(R, S, K, E, B, tp, "cuda"),
                           _config(R, S, K, E, B, tp, "xla"))
    _assert_plans_equal(cuda, xla)
    assert not cuda.num_invalid_ids.any()


# ---- CPU: how the transport sees meshes ---------------------------------------------------------


def test_ep_groups_are_rows_of_the_other_axes_in_rank_order(mesh_factory):
    mesh = mesh_factory((2, 4), ("data", "ep"))
    groups = transport.ep_groups(mesh, "ep")
    assert [[d.id for d in g] for g in groups] == [[d.id for d in row] for row in mesh.devices]
    transposed = mesh_factory((4, 2), ("ep", "data"))
    groups = transport.ep_groups(transposed, "ep")
    assert [[d.id for d in g] for g in groups] == [[d.id for d in col]
                                                   for col in transposed.devices.T]


def test_bootstrap_rejects_missing_axis_and_cpu_devices(mesh_factory):
    mesh = mesh_factory((2, 4), ("data", "ep"))
    with pytest.raises(ValueError, match="has no axis `experts`"):
        transport.ep_groups(mesh, "experts")
    with pytest.raises(TypeError, match="concrete jax.sharding.Mesh"):
        transport.ep_groups(jax.sharding.get_abstract_mesh(), "ep")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="needs GPU devices"):
            transport.device_table(mesh, "ep")


def test_mesh_devices_without_bootstrap_names_bootstrap(mesh_factory):
    axis = "ep_never_bootstrapped"  # no other test registers a mesh with this axis
    mesh = mesh_factory(4, (axis,))
    cfg = _config(4, 8, 2, 8, None, 1, "xla", axis_name=axis)

    def per_rank(x):
        transport.mesh_devices(cfg)
        return x

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=P(axis), out_specs=P(axis))
    x = jax.device_put(jnp.zeros((4, 2)), NamedSharding(mesh, P(axis)))
    with pytest.raises(ValueError, match=rf"moonep_jax\.bootstrap\(mesh, axis_name='{axis}'\)"):
        jax.jit(f)(x)


def test_mesh_devices_outside_shard_map_names_the_axis():
    with pytest.raises(ValueError, match="inside `jax.shard_map` over a mesh with the EP axis `ep`"):
        transport.mesh_devices(_config(1, 8, 2, 8, None, 1, "xla"))
