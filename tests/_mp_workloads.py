"""Workloads that the multi-process tests run in every process of a `moonep_jax.launch` job.

Each function builds a 1-D ("ep",) mesh over the job's devices of one backend, makes the same
global inputs in every process from a seed, runs the ops under `jax.jit(jax.shard_map(...))` and
returns this process's shards of every result (`{name: [(start index, array), ...]}`) with
`local_shards`: nothing is gathered with a collective (XLA's GPU collectives refuse two ranks on
one GPU). The test process puts the global arrays back together with `assemble`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import moonep_jax
from moonep_jax import routing


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Per-rank shapes: S tokens, top-K, E experts (global), H hidden, F ffn, B slots, tp."""

    S: int = 8
    K: int = 3
    E: int = 16
    H: int = 8
    F: int = 8
    B: int | None = None
    tp: int = 1


def config(R: int, sizes: Sizes, impl: str, **overrides) -> moonep_jax.EPConfig:
    kwargs = dict(num_experts=sizes.E, top_k=sizes.K, tokens_per_rank=sizes.S, hidden=sizes.H,
                  ffn_hidden=sizes.F, num_ranks=R, prefetch_slots=sizes.B,
                  token_padding=sizes.tp, implementation=impl)
    kwargs.update(overrides)
    return moonep_jax.EPConfig(**kwargs)


def global_inputs(seed: int, R: int, sizes: Sizes, maxvio: float, dtype) -> dict[str, np.ndarray]:
    """Skewed lognormal routing with repeated ids and -1 entries, activations and weights."""
    key = jax.random.key(seed)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        idx, _, _ = routing.lognormal_for_maxvio(key, R, sizes.S, sizes.K, sizes.E, maxvio)
        idx = routing.with_duplicates(jax.random.fold_in(key, 1), idx, 0.2)
        idx = routing.with_dropped(jax.random.fold_in(key, 2), idx, 0.1)
        idx = np.asarray(idx).reshape(R * sizes.S, sizes.K).astype(np.int32)
    rng = np.random.default_rng(seed)
    n, E, H, F = R * sizes.S, sizes.E, sizes.H, sizes.F
    return dict(
        topk_idx=idx,
        x=rng.standard_normal((n, H)).astype(dtype),
        topk_w=(rng.random((n, sizes.K)) + 0.5).astype(np.float32),
        w_gate_up=(rng.standard_normal((E, H, 2 * F)) / np.sqrt(H)).astype(dtype),
        w_down=(rng.standard_normal((E, F, H)) / np.sqrt(F)).astype(dtype),
        d_out=rng.standard_normal((n, H)).astype(dtype),
    )


def mesh_of(backend: str) -> jax.sharding.Mesh:
    """("ep",) mesh over every device of `backend` in the job, in device-id order."""
    return jax.sharding.Mesh(np.array(sorted(jax.devices(backend), key=lambda d: d.id)), ("ep",))


def put(mesh, value: np.ndarray) -> jax.Array:
    """The global array `value`, split over "ep" on its leading axis."""
    sharding = NamedSharding(mesh, P("ep"))
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def local_shards(tree) -> dict:
    """This process's shards of every leaf of a dict of global arrays, as host arrays."""
    out = {}
    for name, leaf in tree.items():
        out[name] = [(tuple(s.start or 0 for s in shard.index), np.asarray(shard.data))
                     for shard in leaf.addressable_shards]
    return out


def assemble(per_process: list[dict]) -> dict[str, np.ndarray]:
    """Global arrays back from every process's `local_shards`."""
    names = per_process[0].keys()
    out = {}
    for name in names:
        shards = [s for proc in per_process for s in proc[name]]
        first = shards[0][1]
        shape = list(first.shape)
        for axis in range(len(shape)):
            shape[axis] = max(start[axis] + a.shape[axis] for start, a in shards)
        full = np.zeros(shape, first.dtype)
        for start, a in shards:
            full[tuple(slice(b, b + n) for b, n in zip(start, a.shape))] = a
        out[name] = full
    return out


def _stack(tree):
    return jax.tree.map(lambda leaf: leaf[None], tree)


def ep_ops(seed: int, maxvio: float, impl: str, backend: str, sizes: Sizes = Sizes(),
           dtype=np.float32, grads: bool = True) -> dict:
    """plan, dispatch, combine, prefetch, grouped_matmul, reduce_grad and moe_ffn (forward and
    gradients w.r.t. x, topk_w and both weights) on one global input; this process's shards."""
    mesh = mesh_of(backend)
    R = mesh.devices.size
    cfg = config(R, sizes, impl)
    if impl == "cuda":
        moonep_jax.bootstrap(mesh, "ep")
    g = global_inputs(seed, R, sizes, maxvio, dtype)
    args = {k: put(mesh, v) for k, v in g.items()}
    params_keys = ("w_gate_up", "w_down")

    def ops(topk_idx, x, topk_w, w_gate_up, w_down, d_out):
        p = moonep_jax.plan(topk_idx, cfg)
        recv_x, recv_w, p = moonep_jax.dispatch(x, topk_w, p, cfg)
        y = (recv_x.astype(jnp.float32) * recv_w[:, None]).astype(x.dtype)
        out = moonep_jax.combine(y, p, cfg)
        slots = moonep_jax.prefetch(w_gate_up, p, cfg)
        gmm = moonep_jax.grouped_matmul(recv_x, w_gate_up, slots, p, cfg)
        res = dict(dst=p.dst, cu_seqlens=p.cu_seqlens, zero_fill=p.zero_fill,
                   experts_to_copy=p.experts_to_copy, recv_src=p.recv_src,
                   recv_primary=p.recv_primary, recv_x=recv_x, recv_w=recv_w, combine=out,
                   slots=slots, gmm=gmm)
        if cfg.trainable:
            g_slots = slots.astype(jnp.float32) * 0.5 + 1.0
            res["reduce_grad"] = moonep_jax.reduce_grad(w_gate_up.astype(jnp.float32), g_slots,
                                                        p, cfg)

        params = dict(zip(params_keys, (w_gate_up, w_down)))
        res["moe_ffn"] = moonep_jax.moe_ffn(x, topk_idx, topk_w, params, cfg)
        if grads and cfg.trainable:
            def loss(x, topk_w, w_gate_up, w_down):
                o = moonep_jax.moe_ffn(x, topk_idx, topk_w,
                                       {"w_gate_up": w_gate_up, "w_down": w_down}, cfg)
                return jnp.sum(o.astype(jnp.float32) * d_out.astype(jnp.float32))

            dx, dw, dgu, dd = jax.grad(loss, argnums=(0, 1, 2, 3))(x, topk_w, w_gate_up, w_down)
            res.update(d_x=dx, d_topk_w=dw, d_w_gate_up=dgu, d_w_down=dd)
        return _stack(res)

    fn = jax.jit(jax.shard_map(ops, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    out = fn(*(args[k] for k in ("topk_idx", "x", "topk_w", "w_gate_up", "w_down", "d_out")))
    return local_shards(out)
