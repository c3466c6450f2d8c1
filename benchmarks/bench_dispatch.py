"""Plan, dispatch and combine time against the routing skew (maxvio), with XLA baselines.

Shape of record (DESIGN §10): S=8192, H=7168, K=8, E=384, bf16, EP = every local device. For each
maxvio in 0.2, 1, 10, 20 (routing from `moonep_jax.routing.lognormal_for_maxvio`), in one process
and on the same routing:

  moonep_cuda      the zero-copy FFI kernels (plan timed with the CUDA planner when it runs)
  moonep_xla       the pure-JAX reference backends
  all_to_all_pad   `lax.all_to_all` of a [R, S*K, H] send buffer (worst-case capacity: every entry
                   of a rank could go to one home rank), plus the layout scatter / combine gather
  ragged_a2a       `lax.ragged_all_to_all` (MaxText's path) into a worst-case [R*S*K, H] buffer,
                   dispatch direction only; guarded by a watchdog (its NCCL fallback can hang)

Each time is a loop of `--iters` calls inside one jitted shard_map, divided by the count (each
call's output feeds a one-row update of the next call's input, so nothing is hoisted), median of
`--reps` runs after a warm-up. Bandwidth is reported three ways per rank (the slowest rank):
S*K*H*2/t, remote bytes/t (entries whose destination is another rank) and deduplicated remote
bytes/t (one row per (token, remote destination rank), what dispatch sends).

Writes `<out>/bench_dispatch_<gpu>x<count>.json` (and a PNG plot when matplotlib is importable).
`--quick` runs a tiny shape (CPU smoke test; on CPU only the xla path and all_to_all run).

    python benchmarks/bench_dispatch.py [--quick] [--out DIR] [--iters N] [--reps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import moonep_jax
from moonep_jax import _ffi, routing
from moonep_jax.combine import combine
from moonep_jax.dispatch import decode_dst, dispatch
from moonep_jax.plan import plan

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

MAXVIOS = _common.MAXVIOS
RAGGED_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Shape:
    S: int
    H: int
    K: int
    E: int


RECORD = Shape(S=8192, H=7168, K=8, E=384)


def quick_shape(R: int) -> Shape:
    return Shape(S=256, H=512, K=4, E=16 * R)


# ---- timing -------------------------------------------------------------------------------------


def per_rank(fn, mesh):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def looped(step, mesh, iters: int):
    """jit(shard_map): `iters` calls of `step(carry, *consts) -> carry` in one fori_loop."""

    def body(carry, *consts):
        return lax.fori_loop(0, iters, lambda _, c: step(c, *consts), carry)

    return per_rank(body, mesh)


def feed_back(x, out):
    """x with its first row replaced by out's first row: a cheap true dependency between calls."""
    return lax.dynamic_update_slice(x, out[:1].astype(x.dtype), (0,) * x.ndim)


def time_loop(fn, args, iters: int, reps: int) -> list[float]:
    """Per-call times in ms of `reps` runs of the looped `fn`, after one warm-up run."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3 / iters)
    return times


# ---- the moonep ops -----------------------------------------------------------------------------


def moonep_steps(cfg: moonep_jax.EPConfig):
    def plan_step(topk_idx):
        p = plan(topk_idx, cfg)
        # Depend on the plan without changing the routing in any way that matters for timing.
        first = jnp.where(p.dst[0] == -7, 0, topk_idx[0, 0])
        return topk_idx.at[0, 0].set(first)

    def dispatch_step(x, topk_w, p):
        recv_x, _ = dispatch(x, topk_w, p, cfg)
        return feed_back(x, recv_x)

    def combine_step(y, p):
        return feed_back(y, combine(y, p, cfg))

    return plan_step, dispatch_step, combine_step


# ---- baselines ----------------------------------------------------------------------------------


def home_rank_layout(topk_idx, cfg):
    """Without balancing: entry -> (home rank of its expert, position in that rank's chunk)."""
    R, epn = cfg.num_ranks, cfg.epn
    flat = topk_idx.reshape(-1)
    dest = jnp.where(flat >= 0, flat // epn, R)  # R: dropped, out of bounds
    one_hot = dest[:, None] == jnp.arange(R)[None, :]
    position = jnp.sum(jnp.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1
    return dest, position


def all_to_all_steps(cfg: moonep_jax.EPConfig):
    R, S, K, cap = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k, cfg.num_entries

    def dispatch_step(x, topk_idx):
        dest, position = home_rank_layout(topk_idx, cfg)
        send = jnp.zeros((R, cap, x.shape[1]), x.dtype)
        send = send.at[dest, position].set(x[jnp.arange(S * K) // K], mode="drop")
        received = lax.all_to_all(send, "ep", 0, 0, tiled=True)
        return feed_back(x, received[0])

    def combine_step(y, topk_idx):  # y [R, cap, H]: the expert outputs of what was received
        dest, position = home_rank_layout(topk_idx, cfg)
        returned = lax.all_to_all(y, "ep", 0, 0, tiled=True)
        rows = returned.at[dest, position].get(mode="fill", fill_value=0).astype(jnp.float32)
        out = rows.reshape(S, K, -1).sum(axis=1).astype(y.dtype)
        return feed_back(y, out[None])

    return dispatch_step, combine_step


def ragged_dispatch_step(cfg: moonep_jax.EPConfig):
    R, K, N = cfg.num_ranks, cfg.top_k, cfg.num_entries

    def step(x, topk_idx):
        dest, _ = home_rank_layout(topk_idx, cfg)
        order = jnp.argsort(dest, stable=True)
        operand = x[order // K]
        send_sizes = jnp.sum(dest[:, None] == jnp.arange(R)[None, :], axis=0).astype(jnp.int32)
        input_offsets = jnp.cumsum(send_sizes) - send_sizes
        sizes = lax.all_gather(send_sizes, "ep")  # [source, dest]
        me = lax.axis_index("ep")
        output_offsets = (jnp.cumsum(sizes, axis=0) - sizes)[me]  # where my chunk lands per dest
        recv_sizes = sizes[:, me]
        output = jnp.zeros((R * N, x.shape[1]), x.dtype)
        received = lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                         output_offsets, recv_sizes, axis_name="ep")
        return feed_back(x, received)

    return step


# ---- traffic ------------------------------------------------------------------------------------


def traffic(dst: np.ndarray, cfg: moonep_jax.EPConfig) -> dict:
    """Rows each rank moves to or from other ranks, from the stacked plans' `dst [R, N]`."""
    R, S, K = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k
    dest, _, valid = (np.asarray(a) for a in decode_dst(jnp.asarray(dst), cfg.nvs))
    valid = valid.reshape(R, S, K)
    dest = np.where(valid, dest.reshape(R, S, K), -1 - np.arange(K))  # dropped: matches nothing
    remote = valid & (dest != np.arange(R)[:, None, None])
    first = np.ones_like(remote)  # first occurrence of each (token, dest rank)
    for k in range(1, K):
        first[:, :, k] = ~np.any(dest[:, :, :k] == dest[:, :, k:k + 1], axis=2)
    return {"remote_rows": remote.sum(axis=(1, 2)).tolist(),
            "dedup_remote_rows": (remote & first).sum(axis=(1, 2)).tolist()}


def bandwidths(t_ms: float, row_bytes: int, cfg, rows: dict) -> dict:
    seconds = t_ms * 1e-3
    return {
        "gbps_algorithmic": cfg.num_entries * row_bytes / seconds / 1e9,
        "gbps_remote": max(rows["remote_rows"]) * row_bytes / seconds / 1e9,
        "gbps_dedup_remote": max(rows["dedup_remote_rows"]) * row_bytes / seconds / 1e9,
    }


# ---- one sweep point ----------------------------------------------------------------------------


def timed(name: str, fn, args, iters: int, reps: int) -> dict:
    try:
        times = time_loop(fn, args, iters, reps)
    except Exception as e:  # noqa: BLE001  (a baseline that cannot run is recorded, not fatal)
        return {"method": name, "status": f"failed: {type(e).__name__}: {str(e)[:300]}"}
    return {"method": name, "status": "ok", "times_ms": times, "median_ms": float(np.median(times))}


def run_point(mesh, cfgs: dict, maxvio: float, args, methods: list[str], on_point) -> dict:
    cfg = cfgs["xla"]
    R, S, K, E, H = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k, cfg.num_experts, cfg.hidden
    topk_idx, sigma, realised = routing.lognormal_for_maxvio(jax.random.key(1234), R, S, K, E,
                                                              maxvio)
    rng = np.random.default_rng(7777)
    sharding = jax.NamedSharding(mesh, P("ep"))
    topk_idx = jax.device_put(np.asarray(topk_idx).reshape(R * S, K), sharding)
    x = jax.device_put(rng.standard_normal((R * S, H), np.float32).astype(jnp.bfloat16), sharding)
    topk_w = jax.device_put(rng.random((R * S, K), np.float32), sharding)
    y = jax.device_put(rng.standard_normal((R * cfg.nvs, H), np.float32).astype(jnp.bfloat16),
                       sharding)
    p = per_rank(lambda idx: plan(idx, cfg), mesh)(topk_idx)  # every leaf stacked over ranks
    rows = traffic(np.asarray(p.dst).reshape(R, -1), cfg)
    point = {"maxvio_target": maxvio, "maxvio_measured": realised, "sigma": sigma, **rows,
             "results": []}
    row_bytes = H * 2
    it, reps = args.iters, args.reps

    def add(op: str, result: dict):
        result["op"] = op
        if result["status"] == "ok" and op != "plan":
            result.update(bandwidths(result["median_ms"], row_bytes, cfg, rows))
        point["results"].append(result)
        on_point(point)
        outcome = (f"{result['median_ms']:9.3f} ms" if result["status"] == "ok"
                   else result["status"])
        print(f"maxvio {maxvio:5.1f} {op:8s} {result['method']:15s} {outcome}", flush=True)

    for impl in ("cuda", "xla"):
        name = f"moonep_{impl}"
        if name not in methods:
            continue
        plan_step, dispatch_step, combine_step = moonep_steps(cfgs[impl])
        add("plan", timed(name, looped(plan_step, mesh, it), (topk_idx,), it, reps))
        add("dispatch", timed(name, looped(dispatch_step, mesh, it), (x, topk_w, p), it, reps))
        add("combine", timed(name, looped(combine_step, mesh, it), (y, p), it, reps))
    if "all_to_all_pad" in methods:
        a2a_dispatch, a2a_combine = all_to_all_steps(cfg)
        y_pad = jax.device_put(np.zeros((R * R, cfg.num_entries, H), jnp.bfloat16), sharding)
        add("dispatch", timed("all_to_all_pad", looped(a2a_dispatch, mesh, it), (x, topk_idx),
                              it, reps))
        add("combine", timed("all_to_all_pad", looped(a2a_combine, mesh, it), (y_pad, topk_idx),
                             it, reps))
        del y_pad
    if "ragged_a2a" in methods:
        add("dispatch", run_with_watchdog(
            "ragged_a2a", lambda: timed("ragged_a2a", looped(ragged_dispatch_step(cfg), mesh, 1),
                                        (x, topk_idx), 1, min(reps, 3)), on_point, point))
    return point


def run_with_watchdog(name: str, fn, on_point, point) -> dict:
    """Runs fn; if it has not returned after RAGGED_TIMEOUT_S, records the hang and exits."""

    def expire():
        point["results"].append({"method": name, "op": "dispatch",
                                 "status": f"failed: no result after {RAGGED_TIMEOUT_S:.0f} s"})
        on_point(point)
        print(f"{name}: no result after {RAGGED_TIMEOUT_S:.0f} s; record written, exiting",
              flush=True)
        os._exit(0)  # a hung collective cannot be cancelled

    timer = _common.watchdog(RAGGED_TIMEOUT_S, expire)
    try:
        return fn()
    finally:
        timer.cancel()


# ---- record and plot ----------------------------------------------------------------------------


def plot(record: dict, path: pathlib.Path) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, op in zip(axes, ("plan", "dispatch", "combine")):
        _common.plot_vs_maxvio(ax, record["points"], lambda r, op=op: r["op"] == op,
                               "ms per call", op)
    fig.suptitle(f"{record['device_kind']} x{record['num_devices']}, {record['shape']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape (CPU smoke test)")
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).parent / "results")
    parser.add_argument("--iters", type=int, default=None, help="calls per timed loop")
    parser.add_argument("--reps", type=int, default=None, help="timed loops per point")
    args = parser.parse_args()
    args.iters = args.iters or (2 if args.quick else 10)
    args.reps = args.reps or (3 if args.quick else 7)

    devices = jax.devices()
    R = len(devices)
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    on_gpu = jax.default_backend() == "gpu"
    shape = quick_shape(R) if args.quick else RECORD
    methods, skipped = ["moonep_xla", "all_to_all_pad"], {}
    if on_gpu and _ffi.available():
        from moonep_jax._cuda import transport

        transport.bootstrap(mesh, "ep")
        methods.insert(0, "moonep_cuda")
    else:
        skipped["moonep_cuda"] = "needs the CUDA extension and a GPU"
    if on_gpu:
        methods.append("ragged_a2a")
    else:
        skipped["ragged_a2a"] = "XLA:CPU does not implement ragged-all-to-all"
    cfgs = {impl: moonep_jax.EPConfig(num_experts=shape.E, top_k=shape.K, tokens_per_rank=shape.S,
                                      hidden=shape.H, ffn_hidden=2048, num_ranks=R,
                                      implementation=impl)
            for impl in ("cuda", "xla")}

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_dispatch_{_common.device_tag()}" + ("_quick" if args.quick else "")
    record = {
        "schema": "moonep_jax.bench_dispatch/1", **_common.provenance(),
        "shape": dataclasses.asdict(shape), "dtype": "bfloat16", "nvs": cfgs["xla"].nvs,
        "num_sms": cfgs["cuda"].cuda.num_sms, "iters": args.iters, "reps": args.reps,
        "methods": methods,
        "skipped_methods": skipped,
        "points": [],
    }
    path = args.out / f"{stem}.json"

    def write(point=None):
        if point is not None and (not record["points"] or record["points"][-1] is not point):
            record["points"].append(point)
        path.write_text(json.dumps(record, indent=1))

    for maxvio in MAXVIOS:
        run_point(mesh, cfgs, maxvio, args, methods, write)
    write()
    plot(record, args.out / f"{stem}.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
