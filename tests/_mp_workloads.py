"""Workloads that the multi-process tests run in every process of a `moonep_jax.launch` job.

Each function builds a 1-D ("ep",) mesh over the job's devices of one backend, makes the same
global inputs in every process from a seed, runs the ops under `jax.jit(jax.shard_map(...))` and
returns this process's shards of every result (`{name: [(start index, array), ...]}`) with
`local_shards`: nothing is gathered with a collective (XLA's GPU collectives refuse two ranks on
one GPU, and the same workloads run with the ranks sharing one). The test process puts the global arrays back together with `assemble`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import moonep_jax
from moonep_jax import _checks, launch, routing
from moonep_jax._cuda import transport


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Per-rank shapes: S tokens, top-K, E experts (global), H hidden, F ffn, B slots, tp; and
    how the CUDA combine sums (`CudaOptions.combine_on_owner`)."""

    S: int = 8
    K: int = 3
    E: int = 16
    H: int = 8
    F: int = 8
    B: int | None = None
    tp: int = 1
    combine_on_owner: bool | None = None


def cuda_options(sizes: Sizes, timeout_s: float) -> moonep_jax.CudaOptions:
    return moonep_jax.CudaOptions(timeout_s=timeout_s, combine_on_owner=sizes.combine_on_owner)


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


@functools.cache
def _compiled(impl: str, backend: str, sizes: Sizes, grads: bool, timeout_s: float = 10.0):
    """(mesh, cfg, jitted per-rank ops) for one configuration: compiled once, fed many inputs."""
    mesh = mesh_of(backend)
    R = mesh.devices.size
    cfg = config(R, sizes, impl, cuda=cuda_options(sizes, timeout_s))
    if impl == "cuda":
        moonep_jax.bootstrap(mesh, "ep")

    def ops(topk_idx, x, topk_w, w_gate_up, w_down, d_out):
        p = moonep_jax.plan(topk_idx, cfg)
        recv_x, recv_w = moonep_jax.dispatch(x, topk_w, p, cfg)
        y = (recv_x.astype(jnp.float32) * recv_w[:, None]).astype(x.dtype)
        out = moonep_jax.combine(y, p, cfg)
        slots = moonep_jax.prefetch(w_gate_up, p, cfg)
        matmul = moonep_jax.grouped_matmul(recv_x, w_gate_up, slots, p, cfg)
        # Both projections in one backend call, as moe_ffn's forward runs them (unused slots
        # zeroed here, so that every slot is compared).
        both_gate_up, both_down = _checks.implementation(cfg).prefetch((w_gate_up, w_down), p, cfg)
        res = dict(dst=p.dst, cu_seqlens=p.cu_seqlens, zero_fill=p.zero_fill,
                   experts_to_copy=p.experts_to_copy, recv_src=p.recv_src,
                   recv_primary=p.recv_primary, recv_x=recv_x, recv_w=recv_w, combine=out,
                   slots=slots, slots_of_both_gate_up=both_gate_up, slots_of_both_down=both_down,
                   grouped_matmul=matmul)
        if cfg.trainable:
            g_slots = slots.astype(jnp.float32) * 0.5 + 1.0
            res["reduce_grad"] = moonep_jax.reduce_grad(w_gate_up.astype(jnp.float32), g_slots,
                                                        p, cfg)
        params = {"w_gate_up": w_gate_up, "w_down": w_down}
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
    return mesh, cfg, fn


INPUT_ORDER = ("topk_idx", "x", "topk_w", "w_gate_up", "w_down", "d_out")


def ep_ops(seed: int, maxvio: float, impl: str, backend: str, sizes: Sizes = Sizes(),
           dtype: str = "float32", grads: bool = True) -> dict:
    """plan, dispatch, combine, prefetch, grouped_matmul, reduce_grad (training) and moe_ffn
    (forward, and with `grads` the gradients w.r.t. x, topk_w and both weights) on one global
    input; this process's shards."""
    mesh, cfg, fn = _compiled(impl, backend, sizes, grads)
    g = global_inputs(seed, cfg.num_ranks, sizes, maxvio, jnp.dtype(dtype))
    return local_shards(fn(*(put(mesh, g[k]) for k in INPUT_ORDER)))


# ---- GPU: the CUDA ops in N processes (on one GPU or one each), against xla on the CPU backend

def gpu_vs_cpu(seed: int, maxvios: tuple, cases: tuple, impl: str = "cuda",
               backend: str = "gpu") -> dict:
    """For every (name, sizes, grads) case and maxvio: `{f"{name}/{maxvio}": (cuda, xla)}`, the
    CUDA ops on the job's GPUs and the xla reference on its CPU devices, same inputs. Then reads
    the transport's error records (raises if a kernel recorded one). (`impl`, `backend`: what
    runs in place of the CUDA ops; the CPU tests check this harness with ("xla", "cpu").)"""
    out = {}
    for name, sizes, grads in cases:
        for i, maxvio in enumerate(maxvios):
            s = seed + 1000 * i
            out[f"{name}/{maxvio}"] = (ep_ops(s, maxvio, impl, backend, sizes, "bfloat16", grads),
                                       ep_ops(s, maxvio, "xla", "cpu", sizes, "bfloat16", grads))
    moonep_jax.check_transport_errors()
    return out


def _bits_checksum(a: jax.Array) -> jax.Array:
    """`[len(a)] uint32`: the bit patterns of each `a[i]` summed modulo 2^32, exact and
    independent of the summation order (a float sum of the same values differs between the GPU
    and CPU backends in its last bits, since their reductions add in different orders)."""
    bits = jax.lax.bitcast_convert_type(a, {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize])
    return jnp.sum(bits.astype(jnp.uint32), axis=tuple(range(1, a.ndim)), dtype=jnp.uint32)


@functools.cache
def _comm_loop_fn(impl: str, backend: str, sizes: Sizes, timeout_s: float):
    mesh = mesh_of(backend)
    cfg = config(mesh.devices.size, sizes, impl, cuda=cuda_options(sizes, timeout_s))
    if impl == "cuda":
        moonep_jax.bootstrap(mesh, "ep")

    def ops(topk_idx, x, topk_w, w_gate_up):
        p = moonep_jax.plan(topk_idx, cfg)
        recv_x, recv_w = moonep_jax.dispatch(x, topk_w, p, cfg)
        slots = moonep_jax.prefetch(w_gate_up, p, cfg)
        # Per receive row, padding included: recv_x and recv_w stay temporaries, whose buffers
        # XLA reuses from call to call holding an earlier routing's rows.
        recv_checksum = _bits_checksum(recv_x) + _bits_checksum(recv_w[:, None])
        return _stack(dict(dst=p.dst, combine=moonep_jax.combine(recv_x, p, cfg),
                           recv_checksum=recv_checksum, slot_checksum=_bits_checksum(slots)))

    return mesh, jax.jit(jax.shard_map(ops, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def _loop_inputs(seed: int, mesh, sizes: Sizes, n: int) -> list[tuple]:
    maxvios = (0.0, 1.0, 5.0, 10.0, 20.0)
    out = []
    for i in range(n):
        g = global_inputs(seed + i, mesh.devices.size, sizes, maxvios[i % len(maxvios)],
                          jnp.bfloat16)
        out.append(tuple(put(mesh, g[k]) for k in ("topk_idx", "x", "topk_w", "w_gate_up")))
    return out


def back_to_back(seed: int, calls: int, sizes: Sizes, distinct: int = 10, impl: str = "cuda",
                 backend: str = "gpu") -> dict:
    """`calls` CUDA calls back to back (no sync between them), cycling through `distinct`
    routings; returns every call's shards of the routing-indexed results and the xla
    references: `{"cuda": [per call], "xla": [per routing]}`."""
    gpu_mesh, cuda = _comm_loop_fn(impl, backend, sizes, 10.0)
    cpu_mesh, xla = _comm_loop_fn("xla", "cpu", sizes, 10.0)
    gpu_in = _loop_inputs(seed, gpu_mesh, sizes, distinct)
    results = [cuda(*gpu_in[i % distinct]) for i in range(calls)]
    jax.block_until_ready(results)
    moonep_jax.check_transport_errors()
    return {"cuda": [local_shards(r) for r in results],
            "xla": [local_shards(xla(*a)) for a in _loop_inputs(seed, cpu_mesh, sizes, distinct)]}


def die_mid_run(seed: int, victim: int, calls: int, sizes: Sizes, timeout_s: float) -> None:
    """Every process runs CUDA calls back to back; process `victim` kills itself (SIGKILL) after
    half of them. The others must end through their bounded waits: exit code 3 with the error."""
    mesh, cuda = _comm_loop_fn("cuda", "gpu", sizes, timeout_s)
    inputs = _loop_inputs(seed, mesh, sizes, 2)
    try:
        for i in range(calls):
            jax.block_until_ready(cuda(*inputs[i % 2]))
            if i == calls // 2 and jax.process_index() == victim:
                print(f"process {victim}: killing myself after call {i}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    except Exception as e:  # noqa: BLE001 - the bounded wait fired: report and exit at once
        from moonep_jax._cuda import transport

        print(f"process {jax.process_index()}: the calls failed: {e}", flush=True)
        for record in transport.transport_errors(clear=False):  # host-mapped: survives the trap
            print(f"process {jax.process_index()}: {transport.describe_error(record)}", flush=True)
        launch.exit_now(3)
    print(f"process {jax.process_index()}: all {calls} calls returned", flush=True)


def gpu_suite(seed: int, maxvios: tuple, cases: tuple, calls: int, impl: str = "cuda",
              backend: str = "gpu") -> dict:
    """`gpu_vs_cpu`, then `back_to_back` (with the owners summing combine's first stage, the
    path of EP groups over several GPUs), in the same processes (one start-up for both); and
    where the CUDA combine runs its first stage by default (None for the xla harness)."""
    ops = gpu_vs_cpu(seed, maxvios, cases, impl, backend)
    loop_sizes = dataclasses.replace(cases[0][1], combine_on_owner=True)
    loop = back_to_back(seed + 1, calls, loop_sizes, impl=impl, backend=backend)
    mesh = mesh_of(backend)
    default = (transport.combine_on_owner(config(mesh.devices.size, cases[0][1], impl),
                                          transport.device_table(mesh, "ep"))
               if impl == "cuda" else None)
    return {"ops": ops, "loop": loop, "combine_on_owner": default}


# ---- GPU: combine's row loops at every vector width, both places of its first stage ----------

@functools.cache
def _combine_fn(impl: str, backend: str, sizes: Sizes):
    mesh = mesh_of(backend)
    cfg = config(mesh.devices.size, sizes, impl, cuda=cuda_options(sizes, 10.0))
    if impl == "cuda":
        moonep_jax.bootstrap(mesh, "ep")

    def ops(topk_idx, y):
        return _stack(dict(combine=moonep_jax.combine(y, moonep_jax.plan(topk_idx, cfg), cfg)))

    return mesh, cfg, jax.jit(jax.shard_map(ops, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def combine_shapes(seed: int, cases: tuple, impl: str = "cuda", backend: str = "gpu") -> dict:
    """For every (sizes, dtype) case: `{name: (cuda, xla)}`, combine of random expert outputs
    on the job's GPUs and with the xla reference on its CPU devices, same routing and rows."""
    out = {}
    for i, (sizes, dtype) in enumerate(cases):
        g = global_inputs(seed + i, mesh_of("cpu").devices.size, sizes, 10.0, jnp.dtype(dtype))
        results = []
        for fn_impl, fn_backend in ((impl, backend), ("xla", "cpu")):
            mesh, cfg, fn = _combine_fn(fn_impl, fn_backend, sizes)
            y = np.random.default_rng(seed + i).standard_normal(
                (cfg.num_ranks * cfg.nvs, sizes.H)).astype(dtype)
            results.append(local_shards(fn(put(mesh, g["topk_idx"]), put(mesh, y))))
        out[f"{sizes}/{dtype}"] = tuple(results)
    moonep_jax.check_transport_errors()
    return out


def check_combine_shapes(values: list[dict], where: str) -> None:
    """Asserts what `combine_shapes` returned in every process: bitwise equal results."""
    for key in values[0]:
        cuda = assemble([v[key][0] for v in values])["combine"]
        xla = assemble([v[key][1] for v in values])["combine"]
        np.testing.assert_array_equal(cuda, xla, err_msg=f"{where} {key}")


# ---- GPU: the planner back to back, with many CTAs per kernel grid and changing shapes --------

@functools.cache
def _plan_fn(impl: str, backend: str, sizes: Sizes):
    mesh = mesh_of(backend)
    cfg = config(mesh.devices.size, sizes, impl)
    if impl == "cuda":
        moonep_jax.bootstrap(mesh, "ep")

    def per_rank(topk_idx):
        p = moonep_jax.plan(topk_idx, cfg)
        return _stack({f.name: getattr(p, f.name) for f in dataclasses.fields(p)})

    return mesh, jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def _plan_routing(seed: int, R: int, sizes: Sizes, maxvio: float, invalid: bool) -> np.ndarray:
    """`global_inputs`' routing; with `invalid`, 2% of the entries get ids outside [-1, E)."""
    idx = global_inputs(seed, R, sizes, maxvio, np.float32)["topk_idx"].copy()
    if invalid:
        rng = np.random.default_rng(seed)
        bad = rng.random(idx.shape) < 0.02
        idx[bad] = rng.choice(np.array([sizes.E, 1000, -2], np.int32), size=int(bad.sum()))
    return idx


def _digests(shards: dict) -> dict:
    """`{(name, shard start): sha256 of the shard}` of this process's `local_shards`."""
    return {(name, start): hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
            for name, leaf in shards.items() for start, a in leaf}


def plan_back_to_back(seed: int, calls: int, shapes: tuple, distinct: int = 4,
                      impl: str = "cuda", backend: str = "gpu") -> dict:
    """`calls` plans back to back (no sync between them), call i of shape `shapes[i % n]` and of
    routing `(i // n) % distinct` of that shape (maxvio 0 to 20, invalid ids in the odd ones).
    Returns digests of this process's shards, not arrays (the shapes are large):
    `{"cuda": [(key, digests) per call], "xla": {key: digests}}`, key = (shape, routing)."""
    maxvios = (0.0, 1.0, 10.0, 20.0)
    routings = {}
    for j, sizes in enumerate(shapes):
        R = _plan_fn(impl, backend, sizes)[0].devices.size
        for r in range(distinct):
            routings[j, r] = _plan_routing(seed + 100 * j + r, R, sizes, maxvios[r % len(maxvios)],
                                           r % 2 == 1)
    placed = {key: put(_plan_fn(impl, backend, shapes[key[0]])[0], idx)
              for key, idx in routings.items()}
    schedule = [(i % len(shapes), i // len(shapes) % distinct) for i in range(calls)]
    results = [_plan_fn(impl, backend, shapes[key[0]])[1](placed[key]) for key in schedule]
    jax.block_until_ready(results)
    moonep_jax.check_transport_errors()
    references = {}
    for key, idx in routings.items():
        mesh, xla = _plan_fn("xla", "cpu", shapes[key[0]])
        references[key] = _digests(local_shards(xla(put(mesh, idx))))
    return {"cuda": [(key, _digests(local_shards(r))) for key, r in zip(schedule, results)],
            "xla": references}


def check_plan_loop(values: list[dict], where: str, calls: int, num_ranks: int) -> None:
    """Asserts what `plan_back_to_back` returned in every process: every call's plan, all fields
    of all ranks, bitwise equal to its reference."""
    def merged(dicts):
        out = {}
        for d in dicts:
            out.update(d)
        return out

    references = {key: merged(v["xla"][key] for v in values) for key in values[0]["xla"]}
    num_fields = len(dataclasses.fields(moonep_jax.Plan))
    for want in references.values():
        assert len(want) == num_fields * num_ranks, sorted(want)
    assert len(values[0]["cuda"]) == calls
    for call in range(calls):
        key = values[0]["cuda"][call][0]
        got, want = merged(v["cuda"][call][1] for v in values), references[key]
        differ = sorted({name for name, start in want if got.get((name, start)) != want[name, start]})
        assert not differ, f"{where} call {call} (shape, routing) {key}: {differ} differ"


# Results of the grouped GEMM and of what depends on it; all others are bitwise.
GEMM_RESULTS = {"grouped_matmul", "moe_ffn", "d_x", "d_topk_w", "d_w_gate_up", "d_w_down"}
GEMM_BOUND = 1e-2


def _relative_error(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_suite(values: list[dict], where: str, calls: int) -> None:
    """Asserts what `gpu_suite` returned in every process: each case's CUDA results bitwise
    equal to the xla reference (the GEMM's within GEMM_BOUND), and every back-to-back call's
    results bitwise equal to its routing's reference."""
    ops = [v["ops"] for v in values]
    for key in ops[0]:
        cuda = assemble([o[key][0] for o in ops])
        xla = assemble([o[key][1] for o in ops])
        assert cuda.keys() == xla.keys(), key
        for name in cuda:
            if name in GEMM_RESULTS:
                error = _relative_error(cuda[name], xla[name])
                assert error < GEMM_BOUND, f"{where} {key}: {name} relative error {error:.2e}"
            else:
                np.testing.assert_array_equal(cuda[name], xla[name],
                                              err_msg=f"{where} {key}: {name}")
        if key.startswith("train"):
            assert (cuda["dst"] == np.iinfo(np.int32).min).any(), "the routing must drop entries"
    loops = [v["loop"] for v in values]
    references = [assemble([lp["xla"][i] for lp in loops]) for i in range(len(loops[0]["xla"]))]
    assert len(loops[0]["cuda"]) == calls
    for call in range(calls):
        got = assemble([lp["cuda"][call] for lp in loops])
        for name, ref in references[call % len(references)].items():
            np.testing.assert_array_equal(got[name], ref, err_msg=f"{where} call {call}: {name}")


# ---- CPU: the multi-process bootstrap's exchange, with a stand-in for the extension's CUDA steps

class FakeTransportLib:
    """The extension's bootstrap steps without CUDA: a "pool" is a file holding its owner's pid,
    exported as a real descriptor, so that `pidfd_getfd` and the key-value exchange run for real."""

    MAX_RANKS = 8

    def __init__(self, workdir: str):
        self.workdir, self.registered, self.taken = workdir, [], []

    def create_shared_area(self, ordinal):
        return 0xA0000 + os.getpid(), bytes(64)

    def pci_bus_id(self, ordinal):
        return f"0000:{ordinal:02x}:00.0"

    def export_pool(self, ordinal, ptr):
        path = f"{self.workdir}/pool_{os.getpid()}"
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        return os.open(path, os.O_RDONLY), 0, 1 << 62  # every pointer "in the pool"

    def map_pool(self, fd, size, ordinals):
        self.taken.append(int(os.pread(fd, 32, 0)))  # the exporter's pid, read through our fd
        return 0xB0000 + self.taken[-1]

    def open_shared_area(self, ordinals, handle, pci):
        return 0xC0000

    def register_group(self, ranks):
        self.registered.append(ranks)


def fake_bootstrap_across_processes(workdir: str, fake_hosts: bool) -> dict:
    """Runs the multi-process bootstrap of a 1-D mesh over every CPU device with the stand-in."""
    from moonep_jax._cuda import transport

    if fake_hosts:
        transport.host_id = lambda: f"host{jax.process_index()}"
    lib = FakeTransportLib(workdir)
    group = sorted(jax.devices(), key=lambda d: d.id)
    try:
        transport._bootstrap_across_processes(lib, group, timeout_s=60)
    except ValueError as e:
        return {"error": str(e)}
    return {"pid": os.getpid(), "registered": lib.registered, "taken": lib.taken,
            "process": jax.process_index()}
