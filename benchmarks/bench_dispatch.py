"""Plan, dispatch, combine and prefetch time against the routing skew (maxvio), with XLA baselines.

Shape of record (DESIGN §10): S=8192, H=7168, K=8, E=384, bf16, EP = every local device. For each
maxvio in 0.2, 1, 10, 20 (routing from `moonep_jax.routing.lognormal_for_maxvio`), in one process
and on the same routing:

  moonep_cuda      the zero-copy FFI kernels (plan timed with the CUDA planner when it runs)
  moonep_xla       the pure-JAX reference backends
  all_to_all_pad   `lax.all_to_all` of a [R, S*K, H] send buffer (worst-case capacity: every entry
                   of a rank could go to one home rank), plus the layout scatter / combine gather
  ragged_a2a       `lax.ragged_all_to_all` (MaxText's path) into a worst-case [R*S*K, H] buffer,
                   dispatch direction only; guarded by a watchdog (its NCCL fallback can hang)

prefetch (moonep_cuda only, R > 1: with one rank no slot can be used) is moe_ffn's: both
projections' replica slots (w_gate_up [epn, H, 2F] and w_down [epn, F, H], F=2048, bf16) in ONE
call (one rendezvous, one bulk-copy kernel), unused slots left unwritten. Its bytes (`hbm_bytes`):
each used slot's expert of both projections read (from its home rank) and written once, plus the
slot table; `replicas` gives the used slots per rank.

Each time is `--iters` calls (unrolled: no while loop) inside one jitted shard_map, divided by the
count, median of `--reps` runs after a warm-up. Each call's output feeds a one-row update of the
next call's input, so the calls cannot be merged; work that depends only on the loop-invariant
routing (the padded baseline's layout) XLA computes once per loop. 50 calls spread the ~120 us of
launching and waiting for one jitted call to ~2.4 us per call (at 10, the earlier default, the
planner's 30 us read 51-57). Bandwidth is reported three ways per rank (the slowest rank):
S*K*H*2/t, remote bytes/t (entries whose destination is another rank) and deduplicated remote
bytes/t (one row per (token, remote destination rank), what dispatch and combine send).
Each run first measures its GPU's copy rate (`copy_ceiling`, recorded), and each moonep op's
result gives the time of its bytes at that rate (`hbm_floor_ms`) and its own time in multiples of
it (`x_hbm_floor`): the byte floor of the communication targets, in the same run.

Writes `<out>/bench_dispatch_<gpu>x<count>.json` (and a PNG plot when matplotlib is importable).
`--quick` runs a tiny shape (CPU smoke test; on CPU only the xla path and all_to_all run).

`--processes N` runs one EP rank per process (benchmarks/_processes.py): N local processes, one
GPU each on a host with N or more GPUs, else all sharing GPU 0 under MPS, at maxvio 1 and 20 and
the same shape. Only the CUDA ops (prefetch included) are timed (the baselines are recorded as
skipped: XLA's NCCL collectives refuse two ranks on one GPU, and over one GPU per rank they run in
the single-process mode; on CPU the xla ops stand in, a harness check); each rank times its own
calls, process 0 writes `bench_dispatch_<gpu>x<gpus>_<N>proc[_mps].json` with every rank's times,
the max over ranks, and per op the bytes each rank's kernels read and write (`hbm_bytes`) with
the implied GB/s, and the part of them read from other ranks (`link_bytes`; both modes record
both). Sharing one GPU these are NOT NVLink figures: all ranks share its SMs and HBM, and the link
is HBM (prefetch's `hbm_gbps_all_ranks` is then the GPU's HBM read + write rate of the replica
copies).

    python benchmarks/bench_dispatch.py [--quick] [--out DIR] [--iters N] [--reps N]
    python benchmarks/bench_dispatch.py --processes N [--quick] [--out DIR] [--iters N] [--reps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import moonep_jax
from moonep_jax import _checks, _ffi, routing
from moonep_jax.combine import combine
from moonep_jax.dispatch import decode_dst, dispatch
from moonep_jax._cuda import transport
from moonep_jax.plan import plan

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import _processes  # noqa: E402

MAXVIOS = _common.MAXVIOS
# --processes: two ends of the sweep, to keep the run on one shared GPU short.
PROCESS_MAXVIOS = (1.0, 20.0)
RAGGED_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Shape:
    S: int
    H: int
    K: int
    E: int
    F: int  # ffn hidden of the prefetched weights


RECORD = Shape(S=8192, H=7168, K=8, E=384, F=2048)


def quick_shape(R: int) -> Shape:
    return Shape(S=256, H=512, K=4, E=16 * R, F=64)


def config(shape: Shape, R: int, implementation: str, **options) -> moonep_jax.EPConfig:
    return moonep_jax.EPConfig(num_experts=shape.E, top_k=shape.K, tokens_per_rank=shape.S,
                               hidden=shape.H, ffn_hidden=shape.F, num_ranks=R,
                               implementation=implementation, **options)


# ---- timing -------------------------------------------------------------------------------------


def per_rank(fn, mesh):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def looped(step, mesh, iters: int):
    """jit(shard_map): `iters` calls of `step(carry, *consts) -> carry`, unrolled. A rolled loop
    is an XLA while loop, whose GPU lowering checks its condition on the host every iteration:
    that cost ~4 us per call of the planner (30.1 us unrolled, 33.9 us rolled, 100 calls, one
    H200), which no model pays around one call of an op."""

    def body(carry, *consts):
        return lax.fori_loop(0, iters, lambda _, c: step(c, *consts), carry, unroll=True)

    return per_rank(body, mesh)


def feed_back(x, out):
    """x with its first row replaced by out's first row: a cheap true dependency between calls."""
    return lax.dynamic_update_slice(x, out[:1].astype(x.dtype), (0,) * x.ndim)


def time_loop(fn, args, iters: int, reps: int, before_each=None) -> list[float]:
    """Per-call times in ms of `reps` runs of the looped `fn`, after one warm-up run."""
    return [t / iters for t in _common.time_calls(fn, args, reps, before_each)]


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


def prefetch_step(cfg: moonep_jax.EPConfig):
    """moe_ffn's forward prefetch: both projections in one call, used slots only. The carry is a
    one-element token from the previous call's slots, on which this call's slot table depends
    without changing: so the call is not hoisted out of the loop, and the weights stay loop
    constants (carrying them would copy tens of GB per loop)."""
    impl = _checks.implementation(cfg)

    def step(token, weights, p):
        table = jnp.where(token[0] == -7.0, -1, p.experts_to_copy)
        slots = impl.prefetch(weights, dataclasses.replace(p, experts_to_copy=table), cfg,
                              zero_unused_slots=False)
        return sum(s[:1, 0, 0].astype(jnp.float32) for s in slots)

    return step


def draw_weights(key, cfg: moonep_jax.EPConfig, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """`(w_gate_up [n, H, 2F], w_down [n, F, H])` bf16, drawn on the device (the record shape's
    weights are tens of GB: a host draw would take minutes)."""
    k1, k2 = jax.random.split(key)
    H, F = cfg.hidden, cfg.ffn_hidden
    return (jax.random.normal(k1, (num_experts, H, 2 * F), jnp.bfloat16),
            jax.random.normal(k2, (num_experts, F, H), jnp.bfloat16))


def expert_bytes(cfg: moonep_jax.EPConfig) -> int:
    """Bytes of one expert of both projections (bf16): what prefetch copies per used slot."""
    return 2 * (cfg.hidden * 2 * cfg.ffn_hidden + cfg.ffn_hidden * cfg.hidden)


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


def traffic(dst: np.ndarray, cfg: moonep_jax.EPConfig, ranks=None) -> dict:
    """Rows each rank sends, from its plan: `dst [len(ranks), N]` of `ranks` (default: the
    stacked plans of all R ranks). Per rank: its valid entries, the tokens with one, the entries
    and the primary rows (`dst >= 0`: one per (token, destination rank), what dispatch moves;
    the receiver writes the duplicate rows from the same read) bound for other ranks, and per
    destination rank the entries and primaries sent there, and the (token, rank) pairs of two or
    more entries (whose rows combine sums on that rank first). Lists in rank order."""
    R, S, K = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k
    ranks = np.arange(R) if ranks is None else np.asarray(ranks)
    n = len(ranks)
    dest, _, valid = (np.asarray(a).reshape(n, S, K)
                      for a in decode_dst(jnp.asarray(dst), cfg.nvs))
    primary = valid & (np.asarray(dst).reshape(n, S, K) >= 0)
    remote = valid & (dest != ranks[:, None, None])
    count = lambda mask, axes=(1, 2): mask.sum(axis=axes).astype(int).tolist()  # noqa: E731
    to_rank = lambda mask: [[int((m & (d == r)).sum()) for r in range(R)]  # noqa: E731
                            for m, d in zip(mask, dest)]
    per_token_rank = np.stack([(valid & (dest == r)).sum(axis=2) for r in range(R)], axis=-1)
    return {"ranks": ranks.astype(int).tolist(), "entries": count(valid),
            "tokens_sent": count(valid.any(axis=2), 1), "remote_rows": count(remote),
            "dedup_remote_rows": count(remote & primary), "primary_rows": count(primary),
            "entries_to": to_rank(valid), "primaries_to": to_rank(primary),
            "shared_groups_to": (per_token_rank >= 2).sum(axis=1).astype(int).tolist()}


def replicas(experts_to_copy: np.ndarray, ranks) -> list[int]:
    """Used replica slots of each of `ranks`, from their copies of the full `[R, B]` slot table
    (`experts_to_copy [len(ranks), R, B]`)."""
    return [int((table[r] >= 0).sum()) for table, r in zip(experts_to_copy, ranks)]


def combine_groups(rows: dict) -> tuple[np.ndarray, np.ndarray]:
    """Combine's (token, rank) groups of a home's tokens on another rank, `[home, rank]` counts
    from `traffic`: of one entry (lone: the home reads the row in place) and of two or more (the
    rank sums them and pushes one partial)."""
    primaries_to = np.array(rows["primaries_to"])
    shared = np.array(rows["shared_groups_to"])
    others = 1 - np.eye(len(primaries_to), dtype=int)
    return (primaries_to - shared) * others, shared * others


def hbm_bytes(rows: dict, cfg: moonep_jax.EPConfig, row_bytes: int, plan_bytes: int,
              on_owner: bool | None) -> dict:
    """Per op and rank, the bytes its kernels read and write, from `traffic` of all R ranks:
    row data, route weights and the plan arrays the data kernels read (not the barriers'
    flags). A rank's loads from a peer's buffers count as that rank's reads.

    dispatch (the receiver pulls): each (token, receiving rank) pair's row is read once from the
    sender, and every one of the NvS receive rows written once (owned rows from that read,
    padding zeroed) with its weight. Besides: the receiver's recv_src and recv_primary, its own
    dst (checked), per pulled token the K dst entries and weights of its source, per owned row
    its owner's dst entry, per duplicate row its primary's recv_src, recv_primary and dst entry
    and, when its primary is pulled, its own recv_src and recv_primary again. The link carries
    one row per (token, remote rank): `dedup_remote_rows`. combine, `on_owner`
    (`CudaOptions.combine_on_owner` as the CUDA op resolved it; None where it did not run): each
    rank reads the dst of every
    rank, and for each (token of another home, this rank) of two or more entries it reads their
    rows and stores one partial into that home's staging; the home reads its own tokens' rows,
    one staged partial or lone row (from its owner) per (token, other destination rank), and
    writes [S, H]; otherwise (as the xla reference gathers, too) every valid entry's row is read
    from the rank that holds it, and [S, H] written. plan: topk_idx in and the Plan out only (its histogram exchange is not
    counted). prefetch (when `rows` has `replicas`): each used slot's expert of both projections
    read from its home and written once, and the rank's row of the slot table read."""
    N, nvs, S, K = cfg.num_entries, cfg.nvs, cfg.tokens_per_rank, cfg.top_k
    entries = np.array(rows["entries"])
    received = np.sum(rows["entries_to"], axis=0)           # receive rows owned, per rank
    pulled = np.sum(rows["primaries_to"], axis=0)           # (token, this rank) pairs read
    duplicates = received - pulled
    entries_to = np.array(rows["entries_to"])               # [home, rank]
    lone, shared = combine_groups(rows)
    stage1_rows = entries_to.sum(axis=0) - np.diag(entries_to) - lone.sum(axis=0)  # per owner
    staged = shared.sum(axis=0)                             # partials each owner pushes
    R = len(entries)
    per_rank = lambda v: (np.broadcast_to(v, (R,)).astype(int)).tolist()  # noqa: E731
    moved = {
        "plan": {"read": per_rank(N * 4), "written": per_rank(plan_bytes)},
        "dispatch": {"read": per_rank(pulled * (row_bytes + K * 8) + received * 4
                                      + duplicates * 20 + nvs * 8 + N * 4),
                     "written": per_rank(nvs * (row_bytes + 4))},
        "combine": {"read": per_rank((stage1_rows + np.diag(entries_to)
                                      + np.array(rows["dedup_remote_rows"])) * row_bytes
                                     + R * N * 4),
                    "written": per_rank((staged + S) * row_bytes)} if on_owner else
                   {"read": per_rank(entries * row_bytes + N * 4),
                    "written": per_rank(S * row_bytes)},
    }
    if "replicas" in rows:
        copied = np.array(rows["replicas"]) * expert_bytes(cfg)
        moved["prefetch"] = {"read": per_rank(copied + cfg.num_slots * 4),
                             "written": per_rank(copied)}
    return moved


def link_bytes(rows: dict, cfg: moonep_jax.EPConfig, row_bytes: int,
               on_owner: bool | None) -> dict:
    """Per op and rank, the bytes its kernels read from other ranks' memory (over NVLink between
    GPUs; the same HBM when the ranks share one), and for combine also the bytes it stores
    there, from `traffic` of all R ranks. dispatch: each row pulled from another sender, with
    that token's K dst entries and weights; combine, `on_owner`: every other rank's dst, one
    partial pushed per (token of another home, this rank) of two or more entries, and, as the
    home, each lone row (one entry on its rank) read from its owner: one row per (token, other
    rank) crosses; otherwise the row of every valid entry of this rank's tokens that another rank
    holds; prefetch: every used slot's expert of both projections (a slot always replicates another
    rank's expert). The plan's histogram exchange is not counted."""
    K, N = cfg.top_k, cfg.num_entries
    primaries_to = np.array(rows["primaries_to"])                    # [sender, receiver]
    pulled_remote = primaries_to.sum(axis=0) - np.diag(primaries_to)  # per receiver
    lone, shared = combine_groups(rows)
    combined = ((lone.sum(axis=1) + shared.sum(axis=0)) * row_bytes + (len(lone) - 1) * N * 4
                if on_owner else np.array(rows["remote_rows"]) * row_bytes)
    moved = {"dispatch": (pulled_remote * (row_bytes + K * 8)).astype(int).tolist(),
             "combine": combined.astype(int).tolist()}
    if "replicas" in rows:
        moved["prefetch"] = (np.array(rows["replicas"]) * expert_bytes(cfg)).astype(int).tolist()
    return moved


def byte_count_methods() -> dict:
    """How a record's `hbm_bytes` and `link_bytes` are counted (their functions' docstrings)."""
    return {f"{fn.__name__}_method": " ".join(fn.__doc__.split()) for fn in (hbm_bytes, link_bytes)}


def bytes_per_rank(moved: dict) -> np.ndarray:
    """Each rank's HBM bytes of one op (`hbm_bytes`' entry for it): read + written."""
    return np.add(moved["read"], moved["written"])


def hbm_rates(moved: dict, times_ms: list[float]) -> dict:
    """GB/s of one op: each rank's bytes (read + written) over its own time, and all ranks'
    bytes over the slowest rank's time (what one GPU's HBM carried when the ranks share it; over
    one GPU per rank, the sum over the GPUs, a peer's reads counted as the reader's)."""
    total = bytes_per_rank(moved)
    return {"hbm_gbps_per_rank": [float(b / (t * 1e-3) / 1e9) for b, t in zip(total, times_ms)],
            "hbm_gbps_all_ranks": float(total.sum() / (max(times_ms) * 1e-3) / 1e9)}


def copy_passes(iters: int):
    """jit: `iters` passes over a uint32 buffer, each reading it and writing it plus one, kept
    apart by optimization barriers (one kernel each), unrolled."""

    def passes(buffer):
        step = lambda _, b: lax.optimization_barrier(b + jnp.uint32(1))  # noqa: E731
        return lax.fori_loop(0, iters, step, buffer, unroll=True)

    return jax.jit(passes)


def copy_ceiling(device, nbytes: int, iters: int, reps: int) -> dict:
    """What `device`'s memory moves, measured in this run: the ceiling of the HBM figures (a large
    device-to-device copy, bytes read plus bytes written; the datasheet's rate is a lead, not a
    ceiling). `iters` passes over one uint32 buffer of `nbytes`, each reading it and writing it
    back plus one, an optimization barrier between passes (so that XLA neither fuses nor folds
    them), unrolled in one program; median of `reps` runs after a warm-up."""
    words = nbytes // 4
    fill = jax.jit(lambda: jnp.arange(words, dtype=jnp.uint32),
                   out_shardings=jax.sharding.SingleDeviceSharding(device))
    times = time_loop(copy_passes(iters), (fill(),), iters, reps)
    moved = 2 * words * 4
    median = float(np.median(times))
    return {"method": " ".join(copy_ceiling.__doc__.split()), "bytes_per_pass": moved,
            "times_ms": times, "median_ms": median, "gbps": moved / (median * 1e-3) / 1e9}


def ceiling_bytes(cfg: moonep_jax.EPConfig) -> int:
    """The copy ceiling's buffer: a rank's receive rows (what dispatch writes), so that it is
    several times the L2 at the record shape."""
    return cfg.nvs * cfg.hidden * 2


def hbm_floor(moved: dict, t_ms: float, ceiling_gbps: float, ranks_per_gpu: int) -> dict:
    """An op's time `t_ms` against the time of its bytes at the measured copy rate
    (`copy_ceiling`): `hbm_floor_ms` is the busiest GPU's bytes (every rank's read + written,
    summed over the `ranks_per_gpu` consecutive ranks that share a GPU) over the ceiling, and
    `x_hbm_floor` the op's time in multiples of it."""
    total = bytes_per_rank(moved).reshape(-1, ranks_per_gpu).sum(axis=1)
    floor_ms = float(total.max() / (ceiling_gbps * 1e9) * 1e3)
    return {"hbm_floor_ms": floor_ms, "x_hbm_floor": t_ms / floor_ms}


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
        with _common.gpu_clocks() as clocks:
            times = time_loop(fn, args, iters, reps)
    except Exception as e:  # noqa: BLE001  (a baseline that cannot run is recorded, not fatal)
        return {"method": name, "status": f"failed: {type(e).__name__}: {str(e)[:300]}"}
    return {"method": name, "status": "ok", "times_ms": times, "median_ms": float(np.median(times)),
            "gpu_clocks": clocks}


def global_routing(cfg: moonep_jax.EPConfig, maxvio: float) -> tuple[np.ndarray, float, float]:
    """`(topk_idx [R*S, K], sigma, realised maxvio)`, the same in every process (fixed seed)."""
    R, S, K, E = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k, cfg.num_experts
    topk_idx, sigma, realised = routing.lognormal_for_maxvio(jax.random.key(1234), R, S, K, E,
                                                              maxvio)
    return np.asarray(topk_idx).reshape(R * S, K), sigma, realised


def global_payloads(cfg: moonep_jax.EPConfig) -> dict[str, np.ndarray]:
    """`{x, topk_w, y}`: the rows and weights moved, the same in every process (fixed seed)."""
    R, S, K, H = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k, cfg.hidden
    rng = np.random.default_rng(7777)
    return {"x": rng.standard_normal((R * S, H), np.float32).astype(jnp.bfloat16),
            "topk_w": rng.random((R * S, K), np.float32),
            "y": rng.standard_normal((R * cfg.nvs, H), np.float32).astype(jnp.bfloat16)}


def rank_payloads(key, cfg: moonep_jax.EPConfig) -> tuple[jax.Array, ...]:
    """`global_payloads`' x, topk_w and y of one rank, drawn with jax.random (`--processes`)."""
    kx, kw, ky = jax.random.split(key, 3)
    S, K, H = cfg.tokens_per_rank, cfg.top_k, cfg.hidden
    return (jax.random.normal(kx, (S, H), jnp.bfloat16), jax.random.uniform(kw, (S, K)),
            jax.random.normal(ky, (cfg.nvs, H), jnp.bfloat16))


def combine_on_owner(cfg: moonep_jax.EPConfig, mesh) -> bool | None:
    """Where the CUDA combine runs its first stage on `mesh` (bootstrapped), as it decides when
    traced: on the owners (True) or at home (False); None for the xla implementation."""
    if cfg.implementation != "cuda":
        return None
    return transport.combine_on_owner(cfg, transport.device_table(mesh, cfg.axis_name))


def plan_bytes_per_rank(p, R: int) -> int:
    """Bytes of one rank's Plan (every leaf is the R ranks' plans concatenated)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(p)) // R


def run_point(mesh, cfgs: dict, maxvio: float, args, methods: list[str], ceiling_gbps: float,
              on_point) -> dict:
    cfg = cfgs["xla"]
    R, H = cfg.num_ranks, cfg.hidden
    topk_idx, sigma, realised = global_routing(cfg, maxvio)
    sharding = jax.NamedSharding(mesh, P("ep"))
    x, topk_w, y = (jax.device_put(a, sharding) for a in global_payloads(cfg).values())
    topk_idx = jax.device_put(topk_idx, sharding)
    p = per_rank(lambda idx: plan(idx, cfg), mesh)(topk_idx)  # every leaf stacked over ranks
    rows = traffic(np.asarray(p.dst).reshape(R, -1), cfg)
    timing_prefetch = "moonep_cuda" in methods and cfg.replicas_possible
    if timing_prefetch:
        rows["replicas"] = replicas(np.asarray(p.experts_to_copy).reshape(R, R, -1), range(R))
    row_bytes = H * 2
    on_owner = combine_on_owner(cfgs["cuda"], mesh) if "moonep_cuda" in methods else None
    moved = hbm_bytes(rows, cfg, row_bytes, plan_bytes_per_rank(p, R), on_owner)
    point = {"maxvio_target": maxvio, "maxvio_measured": realised, "sigma": sigma, **rows,
             "combine_on_owner": on_owner, "hbm_bytes": moved,
             "link_bytes": link_bytes(rows, cfg, row_bytes, on_owner), "results": []}
    it, reps = args.iters, args.reps

    def add(op: str, result: dict):
        result["op"] = op
        if result["status"] == "ok" and op in ("dispatch", "combine"):
            result.update(bandwidths(result["median_ms"], row_bytes, cfg, rows))
        if result["status"] == "ok" and result["method"].startswith("moonep"):
            result.update(hbm_rates(moved[op], [result["median_ms"]] * R))
            result.update(hbm_floor(moved[op], result["median_ms"], ceiling_gbps, 1))
        point["results"].append(result)
        on_point(point)
        outcome = (f"{result['median_ms']:9.3f} ms" if result["status"] == "ok"
                   else result["status"])
        if "x_hbm_floor" in result:
            outcome += f" ({result['x_hbm_floor']:.2f}x its bytes' HBM time)"
        print(f"maxvio {maxvio:5.1f} {op:8s} {result['method']:15s} {outcome}", flush=True)

    for impl in ("cuda", "xla"):
        name = f"moonep_{impl}"
        if name not in methods:
            continue
        plan_step, dispatch_step, combine_step = moonep_steps(cfgs[impl])
        add("plan", timed(name, looped(plan_step, mesh, it), (topk_idx,), it, reps))
        add("dispatch", timed(name, looped(dispatch_step, mesh, it), (x, topk_w, p), it, reps))
        add("combine", timed(name, looped(combine_step, mesh, it), (y, p), it, reps))
    if timing_prefetch:
        weights = global_weights(mesh, cfgs["cuda"])
        token = jax.device_put(np.zeros(R, np.float32), sharding)
        add("prefetch", timed("moonep_cuda", looped(prefetch_step(cfgs["cuda"]), mesh, it),
                              (token, weights, p), it, reps))
        del weights
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


def global_weights(mesh, cfg: moonep_jax.EPConfig) -> tuple[jax.Array, jax.Array]:
    """Both projections' weights of all E experts, split over "ep", drawn on the devices."""
    split = jax.NamedSharding(mesh, P("ep"))
    draw = jax.jit(lambda key: draw_weights(key, cfg, cfg.num_experts),
                   out_shardings=(split, split))
    return draw(jax.random.key(4321))


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
    timed_ops = [op for op in OPS if any(r["op"] == op and r["status"] == "ok"
                                         for point in record["points"] for r in point["results"])]
    fig, axes = plt.subplots(1, len(timed_ops), figsize=(5 * len(timed_ops), 4.5), squeeze=False)
    for ax, op in zip(axes[0], timed_ops):
        _common.plot_vs_maxvio(ax, record["points"], lambda r, op=op: r["op"] == op,
                               "ms per call", op)
    fig.suptitle(f"{record['device_kind']} x{record['num_devices']}, {record['shape']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- --processes N: one EP rank per process ----------------------------------------------------

OPS = ("plan", "dispatch", "combine", "prefetch")


def run_ranks(args) -> None:
    """One EP rank of `--processes N` (every process of the launched job runs this): plan,
    dispatch, combine and prefetch of the CUDA ops (xla on CPU) timed on this rank at each maxvio;
    process 0 gathers every rank's times and traffic and writes the record after each point."""
    mesh = _processes.ep_mesh()
    R, rank, first = mesh.size, _processes.my_rank(mesh), jax.process_index() == 0
    impl = _processes.implementation()
    shape = quick_shape(R) if args.quick else RECORD
    cfg = config(shape, R, impl, cuda=_processes.cuda_options())
    method, skipped = f"moonep_{impl}", _processes.skipped_methods(
        ("all_to_all_pad", "ragged_a2a"), _processes.BASELINES_ELSEWHERE)
    steps = dict(zip(OPS, (*moonep_steps(cfg), prefetch_step(cfg))))
    loops = {op: looped(step, mesh, args.iters) for op, step in steps.items()}
    planner, compiled = per_rank(lambda idx: plan(idx, cfg), mesh), {}  # compiled once
    barrier = _processes.barrier("bench_dispatch")
    row_bytes = shape.H * 2
    stem = _processes.stem("bench_dispatch", R, args.quick)
    path = args.out / f"{stem}.json"
    record = {"schema": "moonep_jax.bench_dispatch_processes/1", **_processes.provenance(R),
              "shape": dataclasses.asdict(shape), "dtype": "bfloat16", "nvs": cfg.nvs,
              "num_sms": _common.comm_ctas(cfg), "iters": args.iters, "reps": args.reps,
              "gpu_clocks": _common.CLOCKS_METHOD,
              "implementation": impl, "methods": [method], "skipped_methods": skipped,
              **byte_count_methods(), "points": []}
    if first:
        print(f"bench_dispatch --processes {R}: {record['process_layout']}, shape {shape}, "
              f"{impl}\n  NOTE: {record['timing_note']}", flush=True)
    # Process 0 measures its GPU's copy rate while the others wait: on one shared GPU no rank may
    # run beside it, and over one GPU each, the GPUs are alike.
    barrier()
    if first:
        record["copy_ceiling"] = copy_ceiling(jax.local_devices()[0], ceiling_bytes(cfg),
                                              args.iters, args.reps)
        print(f"copy ceiling: {record['copy_ceiling']['gbps']:.0f} GB/s", flush=True)
    barrier()
    ranks_per_gpu = R if _processes.my_placement() == "one_gpu" else 1
    x, topk_w, y = _processes.draw_on_rank(mesh, rank, lambda key: rank_payloads(key, cfg))
    weights = _processes.draw_on_rank(mesh, rank, lambda key: draw_weights(key, cfg, cfg.epn))
    token = _processes.put(mesh, np.zeros(R, np.float32))
    for i, maxvio in enumerate(args.maxvios):
        topk_idx, sigma, realised = global_routing(cfg, maxvio)
        topk_idx = _processes.put(mesh, topk_idx)
        if not compiled:
            compiled["planner"] = _processes.compiled_together(planner, (topk_idx,), barrier)
        p = compiled["planner"](topk_idx)
        mine = {"rank": rank, "traffic": traffic(_processes.local(p.dst)[None], cfg, [rank])}
        mine["traffic"]["replicas"] = replicas(_processes.local(p.experts_to_copy)[None], [rank])
        op_args = {"plan": (topk_idx,), "dispatch": (x, topk_w, p), "combine": (y, p),
                   "prefetch": (token, weights, p)}
        for op in OPS:
            if op not in compiled:
                compiled[op] = _processes.compiled_together(loops[op], op_args[op], barrier)
        mine["times_ms"] = {op: time_loop(compiled[op], op_args[op], args.iters, args.reps,
                                          barrier) for op in OPS}
        everyone = _processes.gather(f"bench_dispatch/point{i}", mine)
        if not first:
            continue
        everyone.sort(key=lambda v: v["rank"])
        rows = {k: [v for one in everyone for v in one["traffic"][k]] for k in mine["traffic"]}
        on_owner = combine_on_owner(cfg, mesh)
        moved = hbm_bytes(rows, cfg, row_bytes, plan_bytes_per_rank(p, R), on_owner)
        point = {"maxvio_target": maxvio, "maxvio_measured": realised, "sigma": sigma, **rows,
                 "combine_on_owner": on_owner, "hbm_bytes": moved,
                 "link_bytes": link_bytes(rows, cfg, row_bytes, on_owner), "results": []}
        for op in OPS:
            per_rank_times = [{"rank": one["rank"], "times_ms": one["times_ms"][op],
                               "median_ms": float(np.median(one["times_ms"][op]))}
                              for one in everyone]
            result = {"method": method, "op": op, "status": "ok",
                      **_processes.across_ranks(per_rank_times)}
            if op in ("dispatch", "combine"):
                result.update(bandwidths(result["median_ms"], row_bytes, cfg, rows))
            result.update(hbm_rates(moved[op], result["median_ms_per_rank"]))
            result.update(hbm_floor(moved[op], result["median_ms"],
                                    record["copy_ceiling"]["gbps"], ranks_per_gpu))
            point["results"].append(result)
            print(f"maxvio {maxvio:5.1f} {op:8s} {method}: max over ranks "
                  f"{result['median_ms']:9.3f} ms (per rank "
                  f"{', '.join(f'{t:.3f}' for t in result['median_ms_per_rank'])}); HBM "
                  f"{result['hbm_gbps_all_ranks']:.0f} GB/s, all ranks together, "
                  f"{result['x_hbm_floor']:.2f}x their HBM time", flush=True)
        record["points"].append(point)
        _common.write_json(path, record)
    if first:
        print(f"  NOTE: {record['timing_note']}\nwrote {path}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape (CPU smoke test)")
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).parent / "results")
    parser.add_argument("--iters", type=int, default=None, help="calls per timed loop")
    parser.add_argument("--reps", type=int, default=None, help="timed loops per point")
    parser.add_argument("--processes", type=int, default=1,
                        help="one EP rank per process, N local processes (one GPU each where "
                             "the host has N, else all sharing GPU 0 under MPS: not NVLink "
                             "figures); times the moonep ops only")
    args = parser.parse_args()
    args.iters = args.iters or (2 if args.quick else 50)
    args.reps = args.reps or (3 if args.quick else 7)
    if args.processes > 1:
        args.maxvios = PROCESS_MAXVIOS
        args.out.mkdir(parents=True, exist_ok=True)
        _processes.spawn(__file__, "run_ranks", args.processes, args)
        return

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
    cfgs = {impl: config(shape, R, impl) for impl in ("cuda", "xla")}

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_dispatch_{_common.device_tag()}" + ("_quick" if args.quick else "")
    record = {
        "schema": "moonep_jax.bench_dispatch/1", **_common.provenance(),
        "shape": dataclasses.asdict(shape), "dtype": "bfloat16", "nvs": cfgs["xla"].nvs,
        "process_layout": f"one process driving all {R} EP ranks (one per device)",
        "num_sms": _common.comm_ctas(cfgs["cuda"]), "iters": args.iters, "reps": args.reps,
        "gpu_clocks": _common.CLOCKS_METHOD,
        "methods": methods,
        "skipped_methods": skipped,
        **byte_count_methods(),
        "points": [],
    }
    path = args.out / f"{stem}.json"

    def write(point=None):
        if point is not None and (not record["points"] or record["points"][-1] is not point):
            record["points"].append(point)
        path.write_text(json.dumps(record, indent=1))

    record["copy_ceiling"] = copy_ceiling(devices[0], ceiling_bytes(cfgs["xla"]), args.iters,
                                          args.reps)
    print(f"copy ceiling of {devices[0].device_kind}: {record['copy_ceiling']['gbps']:.0f} GB/s",
          flush=True)
    for maxvio in MAXVIOS:
        run_point(mesh, cfgs, maxvio, args, methods, record["copy_ceiling"]["gbps"], write)
    write()
    plot(record, args.out / f"{stem}.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
