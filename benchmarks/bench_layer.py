"""One MoE layer, forward + backward, against the routing skew (maxvio), with XLA baselines.

Shape of record (DESIGN §10): S=8192, H=7168, K=8, E=384, F=2048, bf16, EP = every local device,
maxvio 0.2, 1, 10, 20 (routing from `moonep_jax.routing.lognormal_for_maxvio`). One step is
`jax.grad` of `sum(out * d_out)` (a fixed random cotangent) w.r.t. x, topk_w, w_gate_up and w_down
of a SwiGLU MoE layer; the same inputs and weights for every method.

Methods:
  moonep_cuda      `moonep_jax.moe_ffn`, implementation="cuda", B = epn (training).
  a2a_pad_gmm      `lax.all_to_all` with worst-case capacity (a `[R, S*K, H]` send buffer per rank:
                   every entry could go to one home rank), a local sort by expert, and our CuTe
                   grouped GEMM with one group per local expert (weights local, no replication).
  ragged_a2a_dot   MaxText's path: `lax.ragged_all_to_all` into a worst-case `[R*S*K, H]` buffer,
                   a local sort by expert, `lax.ragged_dot`; reverse on the way back.
  moonep_xla       the xla reference `moe_ffn`, --quick only (its masked-segment GEMM costs
                   (2*epn) x NvS rows of GEMM, far too slow at the record shape).
Each method compiles once (shapes do not depend on maxvio). A method that fails records
"failed: <reason>"; a method whose compile + runs exceed its time budget skips its remaining
points; ragged_all_to_all, whose NCCL fallback can hang, runs last under a watchdog.

Reported per point: wall time per step (median of --reps after a warm-up, `block_until_ready`);
memory per device from the compiled executable's `memory_analysis()` (argument + output + temp
bytes; `peak_bytes_in_use` cannot be reset between methods in one process); and the prefetch
bandwidth of the moonep plan (bytes of the slowest rank's planned replica weights, gate_up and
down, over the time of a jitted shard_map of the two prefetches alone), both as moe_ffn prefetches
(unused slots left unwritten) and as the public `prefetch` (unused slots zeroed).

Writes `<out>/bench_layer_<gpu>x<count>.json` and `.png` (`benchmarks/results` by default).
`--quick` runs a tiny shape (CPU smoke test: there the CUDA GEMM of a2a_pad_gmm is replaced by
`lax.ragged_dot`, and the record says so).

    python benchmarks/bench_layer.py [--quick] [--out DIR] [--reps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import sys
import time

# The weights, their replicas and fp32 gradients of the record shape at EP=2 need most of an
# H200: let XLA take more than its default 75% (keeps a user's explicit setting).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

import moonep_jax  # noqa: E402
from moonep_jax import _checks, _ffi, routing  # noqa: E402
from moonep_jax.experts import prefetch  # noqa: E402
from moonep_jax.layer import moe_ffn  # noqa: E402
from moonep_jax.plan import plan  # noqa: E402

MAXVIOS = _common.MAXVIOS
METHOD_BUDGET_S = {"moonep_cuda": 100.0, "a2a_pad_gmm": 60.0, "ragged_a2a_dot": 45.0,
                   "moonep_xla": 120.0}
RAGGED_HANG_S = 90.0
# Why a method may be left out of a run (--skip), written into its record.
SKIP_REASONS = {
    "ragged_a2a_dot": "at the record shape on 2xH200 (jax 0.11.2) its compile fails with "
                      "RESOURCE_EXHAUSTED: XLA lowers ragged_dot over the local experts through a "
                      "dense [rows, epn, K] mask (336 GiB), so the run would only record that "
                      "failure again after ~80 s of autotuning",
}
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Shape:
    S: int
    H: int
    K: int
    E: int
    F: int


RECORD = Shape(S=8192, H=7168, K=8, E=384, F=2048)


def quick_shape(R: int) -> Shape:
    return Shape(S=128, H=256, K=4, E=8 * R, F=128)


# ---- inputs -------------------------------------------------------------------------------------


def weights_and_tokens(mesh, shape: Shape):
    """`(x, topk_w, w_gate_up, w_down, d_out)`, drawn on the devices, split over "ep"."""
    R, S, H, K, E, F = (mesh.shape["ep"], shape.S, shape.H, shape.K, shape.E, shape.F)
    split = NamedSharding(mesh, P("ep"))

    @functools.partial(jax.jit, out_shardings=(split,) * 5)
    def draw(key):
        k = jax.random.split(key, 5)
        # Drawn in bf16 directly: an fp32 draw of the record shape's weights would need 45 GB.
        normal = lambda i, shp, scale: (  # noqa: E731
            jax.random.normal(k[i], shp, jnp.bfloat16) * jnp.bfloat16(scale))
        return (normal(0, (R * S, H), 1.0), jax.random.uniform(k[1], (R * S, K), _F32),
                normal(2, (E, H, 2 * F), H ** -0.5), normal(3, (E, F, H), F ** -0.5),
                normal(4, (R * S, H), 1.0))

    return draw(jax.random.key(7777))


# ---- the methods: per-rank layers ---------------------------------------------------------------


def swiglu(h):
    gate, up = jnp.split(h.astype(_F32), 2, axis=1)
    return (jax.nn.silu(gate) * up).astype(h.dtype)


def moonep_layer(cfg):
    def layer(x, topk_idx, topk_w, w_gate_up, w_down):
        return moe_ffn(x, topk_idx, topk_w, {"w_gate_up": w_gate_up, "w_down": w_down}, cfg)

    return layer


def cuda_grouped_gemm():
    """`gemm(rows [M, D0], w [epn, D0, D1], sizes [epn]) -> [M, D1]`, differentiable: our CuTe
    kernels with one group per local expert (ep_rank 0, so groups [0, epn) are `w`), rows past
    `sum(sizes)` zero. The slot operand is `w` itself with empty slot groups: no copy, no
    overflow (B == epn)."""
    from moonep_jax._cuda import gemm

    rank0 = jnp.zeros(1, jnp.int32)

    def ends(sizes, num_slot_groups):
        cu = jnp.cumsum(sizes).astype(jnp.int32)
        return jnp.concatenate([cu, jnp.broadcast_to(cu[-1:], (num_slot_groups,))])

    @jax.custom_vjp
    def gmm(rows, w, sizes):
        return gemm.grouped_matmul(rows, w, w, ends(sizes, w.shape[0]), rank0)

    def fwd(rows, w, sizes):
        return gmm(rows, w, sizes), (rows, w, sizes)

    def bwd(res, d_out):
        rows, w, sizes = res
        d_rows = gemm.grouped_matmul_dx(d_out, w, w, ends(sizes, w.shape[0]), rank0)
        d_w, _ = gemm.grouped_matmul_dw(rows, d_out, ends(sizes, 1), rank0, w.shape[0], 1)
        return d_rows, d_w.astype(w.dtype), None

    gmm.defvjp(fwd, bwd)
    return gmm


def ragged_dot_gemm(rows, w, sizes):
    return lax.ragged_dot(rows, w, sizes.astype(jnp.int32))


def expert_ffn(rows, sizes, w_gate_up, w_down, gemm):
    """SwiGLU experts on rows sorted by local expert (`sizes [epn]` rows each)."""
    return gemm(swiglu(gemm(rows, w_gate_up, sizes)), w_down, sizes)


def sort_by_expert(flat, num_experts):
    """Entries sorted by expert (dropped, -1, last): `(order, sorted ids with E for dropped)`."""
    key = jnp.where(flat >= 0, flat, num_experts)
    order = jnp.argsort(key, stable=True)
    return order, key[order]


def weighted_sum(rows_per_entry, topk_w, S, K, dtype):
    """`out[t] = sum_k topk_w[t, k] * rows[t*K + k]` in fp32, rounded to `dtype`."""
    rows = rows_per_entry.astype(_F32).reshape(S, K, -1)
    return jnp.sum(rows * topk_w[:, :, None], axis=1).astype(dtype)


def a2a_pad_layer(cfg, gemm):
    """`lax.all_to_all` of a worst-case `[R, S*K, H]` buffer, experts computed at home."""
    R, S, K, E, epn = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k, cfg.num_experts, cfg.epn
    N = S * K

    def layer(x, topk_idx, topk_w, w_gate_up, w_down):
        flat = topk_idx.reshape(-1)
        order, sorted_ids = sort_by_expert(flat, E)
        sorted_dest = sorted_ids // epn                         # R for dropped entries
        counts = jnp.zeros(R + 1, jnp.int32).at[sorted_dest].add(1)
        position = jnp.arange(N) - (jnp.cumsum(counts) - counts)[sorted_dest]
        # Send buffers: rows and local expert ids (epn marks an empty row), chunk d for rank d.
        send = jnp.zeros((R, N, x.shape[1]), x.dtype).at[sorted_dest, position].set(
            x[order // K], mode="drop")
        send_ids = jnp.full((R, N), epn, jnp.int32).at[sorted_dest, position].set(
            sorted_ids % epn, mode="drop")
        recv = lax.all_to_all(send, "ep", 0, 0, tiled=True).reshape(R * N, -1)
        recv_ids = lax.all_to_all(send_ids, "ep", 0, 0, tiled=True).reshape(R * N)
        perm = jnp.argsort(recv_ids, stable=True)
        sizes = jnp.zeros(epn + 1, jnp.int32).at[recv_ids].add(1)[:epn]
        y = expert_ffn(recv[perm], sizes, w_gate_up, w_down, gemm)
        y_recv = jnp.zeros_like(y).at[perm].set(y).reshape(R, N, -1)
        back = lax.all_to_all(y_recv, "ep", 0, 0, tiled=True)
        y_sorted = back.at[sorted_dest, position].get(mode="fill", fill_value=0)
        y_entry = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
        return weighted_sum(y_entry, topk_w, S, K, x.dtype)

    return layer


def ragged_a2a_layer(cfg):
    """MaxText's dropless path: ragged_all_to_all there and back, ragged_dot in between."""
    R, S, K, E, epn = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k, cfg.num_experts, cfg.epn
    N = S * K

    def layer(x, topk_idx, topk_w, w_gate_up, w_down):
        flat = topk_idx.reshape(-1)
        order, sorted_ids = sort_by_expert(flat, E)
        per_expert = jnp.zeros(E + 1, jnp.int32).at[sorted_ids].add(1)[:E]
        send_sizes = per_expert.reshape(R, epn).sum(axis=1)
        input_offsets = jnp.cumsum(send_sizes) - send_sizes
        me = lax.axis_index("ep")
        every_expert = lax.all_gather(per_expert, "ep")              # [source, E]
        sizes_to = every_expert.reshape(R, R, epn).sum(axis=2)       # [source, dest]
        landing = jnp.cumsum(sizes_to, axis=0) - sizes_to             # dest's offset per source
        recv_sizes = sizes_to[:, me]
        recv_offsets = landing[:, me]
        received = lax.ragged_all_to_all(
            x[order // K], jnp.zeros((R * N, x.shape[1]), x.dtype), input_offsets, send_sizes,
            landing[me], recv_sizes, axis_name="ep")
        # Received rows: per source rank, sorted by expert; the counts say which expert is where.
        mine = lax.dynamic_slice_in_dim(every_expert, me * epn, epn, axis=1)  # [source, epn]
        segment_ends = jnp.cumsum(mine.reshape(-1))
        segment = jnp.searchsorted(segment_ends, jnp.arange(R * N), side="right")
        row_ids = jnp.where(segment < R * epn, segment % epn, epn)
        perm = jnp.argsort(row_ids, stable=True)
        y = expert_ffn(received[perm], mine.sum(axis=0), w_gate_up, w_down, ragged_dot_gemm)
        y_recv = jnp.zeros_like(y).at[perm].set(y)
        # Back: the chunk from source s returns to where s sent it from.
        every_offset = lax.all_gather(input_offsets, "ep")           # [source, dest]
        y_sorted = lax.ragged_all_to_all(
            y_recv, jnp.zeros((N, x.shape[1]), x.dtype), recv_offsets, recv_sizes,
            every_offset[:, me], send_sizes, axis_name="ep")
        y_entry = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
        return weighted_sum(y_entry, topk_w, S, K, x.dtype)

    return layer


def training_step(layer, mesh):
    """jit: grads of `sum(out * d_out)` w.r.t. x, topk_w, w_gate_up, w_down."""
    per_rank = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))

    def step(x, topk_idx, topk_w, w_gate_up, w_down, d_out):
        def loss(x, topk_w, w_gate_up, w_down):
            out = per_rank(x, topk_idx, topk_w, w_gate_up, w_down)
            return jnp.sum(out.astype(_F32) * d_out.astype(_F32))

        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, topk_w, w_gate_up, w_down)

    return jax.jit(step)


# ---- measuring ----------------------------------------------------------------------------------


def memory_of(compiled) -> dict:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes")
    memory = {f: int(getattr(analysis, f, 0)) for f in fields}
    memory["total_bytes"] = (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
                             + memory["temp_size_in_bytes"] - memory["alias_size_in_bytes"])
    return memory


class Method:
    """One method: compiles on first use, then times every point, within its time budget."""

    def __init__(self, name: str, step, budget_s: float, reps: int | None = None):
        self.name, self.step, self.budget_s, self.reps = name, step, budget_s, reps
        self.compiled, self.memory, self.spent_s, self.failure = None, None, 0.0, None

    def run(self, args, reps: int) -> dict:
        result = {"method": self.name}
        if self.failure is not None:
            return {**result, "status": self.failure}
        if self.spent_s > self.budget_s:
            return {**result, "status": f"skipped: time budget of {self.budget_s:.0f} s spent"}
        t0 = time.perf_counter()
        try:
            if self.compiled is None:
                self.compiled = self.step.lower(*args).compile()
                self.memory = memory_of(self.compiled)
            times = _common.time_calls(self.compiled, args, self.reps or reps)
        except Exception as e:  # noqa: BLE001  (a method that cannot run is recorded, not fatal)
            self.failure = f"failed: {type(e).__name__}: {str(e)[:400]}"
            return {**result, "status": self.failure}
        finally:
            self.spent_s += time.perf_counter() - t0
        return {**result, "status": "ok", "times_ms": times, "median_ms": float(np.median(times)),
                "memory": self.memory, "memory_source": "compiled.memory_analysis() per device"}


def prefetch_bandwidth(mesh, cfg, shape: Shape, topk_idx, w_gate_up, w_down, reps: int) -> dict:
    """Planned replica bytes of the slowest rank over the time of the two prefetches alone, as
    moe_ffn runs them (unused slots left unwritten) and as the public `prefetch` does (unused
    slots zeroed: B = epn slots of writes however few replicas the plan has)."""
    stacked = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    plans = jax.jit(stacked(lambda idx: plan(idx, cfg)))(topk_idx)
    slots = np.asarray(plans.experts_to_copy).reshape(cfg.num_ranks, cfg.num_ranks, -1)
    used = np.array([(slots[r, r] >= 0).sum() for r in range(cfg.num_ranks)])
    expert_bytes = 2 * (shape.H * 2 * shape.F + shape.F * shape.H)
    layer_prefetch = functools.partial(_checks.backend("prefetch", cfg), cfg=cfg,
                                       zero_unused_slots=False)  # what moe_ffn calls
    result = {"replicas_per_rank": used.tolist(),
              "bytes_slowest_rank": int(used.max() * expert_bytes)}
    for name, fn in (("layer", layer_prefetch),
                     ("zero_unused", lambda w, p: prefetch(w, p, cfg))):
        both = jax.jit(stacked(lambda wg, wd, p, fn=fn: (fn(wg, p), fn(wd, p))))
        times = _common.time_calls(both, (w_gate_up, w_down, plans), reps)
        median = float(np.median(times))
        result[name] = {"times_ms": times, "median_ms": median,
                        "gbps": float(used.max() * expert_bytes / (median * 1e-3) / 1e9)}
    return result


# ---- record and plot ----------------------------------------------------------------------------


def plot(record: dict, path: pathlib.Path) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _common.plot_vs_maxvio(ax, record["points"], lambda r: True, "ms per forward + backward",
                           f"MoE layer, {record['device_kind']} x{record['num_devices']}, "
                           f"{record['shape']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape (CPU smoke test)")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="also write the JSON and PNG here (benchmarks/results always)")
    parser.add_argument("--reps", type=int, default=3, help="timed steps per point")
    parser.add_argument("--skip", action="append", default=[], choices=sorted(METHOD_BUDGET_S),
                        help="methods not to run (recorded as skipped, with SKIP_REASONS' reason)")
    args = parser.parse_args()

    R = len(jax.devices())
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    on_gpu = jax.default_backend() == "gpu"
    cuda = on_gpu and _ffi.available()
    shape = quick_shape(R) if args.quick else RECORD
    config = functools.partial(moonep_jax.EPConfig, num_experts=shape.E, top_k=shape.K,
                               tokens_per_rank=shape.S, hidden=shape.H, ffn_hidden=shape.F,
                               num_ranks=R)
    cfg_cuda, cfg_xla = config(implementation="cuda"), config(implementation="xla")

    methods, skipped, notes = [], {}, {}
    if cuda:
        from moonep_jax._cuda import transport

        transport.bootstrap(mesh, "ep")
        methods.append(Method("moonep_cuda", training_step(moonep_layer(cfg_cuda), mesh),
                              METHOD_BUDGET_S["moonep_cuda"]))
        gemm = cuda_grouped_gemm()
    else:
        skipped["moonep_cuda"] = "needs the CUDA extension and a GPU"
        gemm = ragged_dot_gemm
        notes["a2a_pad_gmm"] = "grouped GEMM replaced by lax.ragged_dot (no CUDA extension/GPU)"
    methods.append(Method("a2a_pad_gmm", training_step(a2a_pad_layer(cfg_xla, gemm), mesh),
                          METHOD_BUDGET_S["a2a_pad_gmm"]))
    if args.quick:
        methods.append(Method("moonep_xla", training_step(moonep_layer(cfg_xla), mesh),
                              METHOD_BUDGET_S["moonep_xla"]))
    else:
        skipped["moonep_xla"] = "masked-segment reference GEMM, far too slow at this shape"
    # One timed step: at ~7 TFLOP/s (ragged_dot) a step of the record shape takes seconds.
    methods.append(Method("ragged_a2a_dot", training_step(ragged_a2a_layer(cfg_xla), mesh),
                          METHOD_BUDGET_S["ragged_a2a_dot"], reps=1))
    for name in args.skip:
        skipped[name] = f"skipped on request (--skip): {SKIP_REASONS.get(name, 'no reason given')}"
    methods = [m for m in methods if m.name not in args.skip]

    record = {"schema": "moonep_jax.bench_layer/1", **_common.provenance(),
              "shape": dataclasses.asdict(shape), "dtype": "bfloat16", "num_ranks": R,
              "nvs": cfg_xla.nvs, "prefetch_slots": cfg_xla.num_slots, "reps": args.reps,
              "xla_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
              "step": "jax.grad of sum(out * d_out) w.r.t. x, topk_w, w_gate_up, w_down",
              "methods": [m.name for m in methods], "skipped_methods": skipped, "notes": notes,
              "points": []}
    stem = f"bench_layer_{_common.device_tag()}" + ("_quick" if args.quick else "")
    outs = [pathlib.Path(__file__).parent / "results"] + ([args.out] if args.out else [])

    def write():
        for out in outs:
            _common.write_json(out / f"{stem}.json", record)

    x, topk_w, w_gate_up, w_down, d_out = weights_and_tokens(mesh, shape)
    split = NamedSharding(mesh, P("ep"))
    points = {}
    for maxvio in MAXVIOS:
        topk_idx, sigma, realised = routing.lognormal_for_maxvio(
            jax.random.key(1234), R, shape.S, shape.K, shape.E, maxvio)
        topk_idx = jax.device_put(np.asarray(topk_idx).reshape(R * shape.S, shape.K), split)
        point = {"maxvio_target": maxvio, "maxvio_measured": realised, "sigma": sigma,
                 "results": []}
        if cuda:
            try:
                point["prefetch"] = prefetch_bandwidth(mesh, cfg_cuda, shape, topk_idx,
                                                       w_gate_up, w_down, args.reps)
            except Exception as e:  # noqa: BLE001
                point["prefetch"] = {"status": f"failed: {type(e).__name__}: {str(e)[:300]}"}
        points[maxvio] = (topk_idx, point)
        record["points"].append(point)
    write()

    for method in methods:  # ragged_a2a_dot last: a hang there cannot cost the other methods
        for maxvio, (topk_idx, point) in points.items():
            def expire(method=method, point=point):
                point["results"].append({"method": method.name,
                                         "status": f"failed: no result after {RAGGED_HANG_S} s"})
                write()
                print(f"{method.name}: hung; record written, exiting", flush=True)
                os._exit(0)  # a hung collective cannot be cancelled

            timer = _common.watchdog(RAGGED_HANG_S + method.budget_s, expire)
            result = method.run((x, topk_idx, topk_w, w_gate_up, w_down, d_out), args.reps)
            timer.cancel()
            point["results"].append(result)
            write()
            outcome = (f"{result['median_ms']:9.3f} ms" if result["status"] == "ok"
                       else result["status"][:160])
            print(f"maxvio {maxvio:5.1f} {method.name:15s} {outcome}", flush=True)
        method.compiled = None  # free the executable before the next method compiles

    for point in record["points"]:
        for name in ("layer", "zero_unused"):
            measured = point.get("prefetch", {}).get(name)
            if measured:
                print(f"maxvio {point['maxvio_target']:5.1f} prefetch ({name}) "
                      f"{measured['median_ms']:.3f} ms {measured['gbps']:.0f} GB/s "
                      f"replicas {point['prefetch']['replicas_per_rank']}")
    for out in outs:
        plot(record, out / f"{stem}.png")
    print(f"wrote {', '.join(str(o / stem) + '.json' for o in outs)}")


if __name__ == "__main__":
    main()
