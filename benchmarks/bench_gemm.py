"""Grouped GEMM throughput at the groupings real plans produce, against dense `jnp.dot` and JAX's
Hopper grouped GEMM `ragged_dot_mgpu`, one GPU.

Shape of record: H = 7168, F = 2048, bf16; gate+up (K = H, N = 2F) and down (K = F, N = H), for
forward, dX and dW.

Main groupings (`real_plan`): `cu_seqlens` from the planner (benchmarks/plan_groupings.py:
`moonep_jax.plan`, implementation "xla", in a CPU subprocess with R host devices) on
`lognormal_for_maxvio` routings (key 1234) at maxvio 0.2, 1, 10, 20 for R = 2 and R = 8 at
S = 8192, K = 8, E = 384. One rank's groups are its E/R local experts (~S*K*R/E rows each) and its
used replica slots (G = E + B groups, B = epn, the other ranks' groups empty); the timed rank is
the one with the most M tiles (the one the others wait for). Every rank's statistics are in the
record.

Diagnostic groupings, M = 65536:
  `R1 E192 maxvio X`    bench_layer --one-gpu's plans (R=1, E=192, EP=2's per-rank work): the
                        GEMM groupings of the layer step that bench_layer times (192 local
                        experts, no replicas; G = 384);
and in EP=2's layout (576 groups):
  `synthetic maxvio X`  today's earlier main groupings: all 192 local experts and all 192 slots
                        non-empty (~170 rows each), sizes from a log-normal per maxvio (real EP=2
                        plans use 1-2 slots, so these have twice the groups of a real plan);
  `one_group`           all rows in one group: one weight matrix, whole tiles (the kernel against
                        cuBLAS on the same work);
  `tile_aligned`        whole M tiles over up to 2*epn groups: weight traffic without partial
                        tiles.

Baselines in the same process: dense `jnp.dot` of the same M rows (forward x @ W, dX dy @ W^T,
dW x^T dy with bf16 and with fp32 output; % of dense compares dW with the dense dW of the dtype
the kernel writes for the local experts; each timed in blocks of its own before and after the
projection's grouped GEMMs, % of dense taken at the median over both, `dense_tflops`, and timed
again in turn with every grouped call, `pct_of_dense_interleaved`, so that both run at the same
clock of a GPU at its power limit), and
`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` (forward; dX with transpose_rhs=True;
it has no dW) over the non-empty groups only (its grid has one M slot per group, so empty groups
would cost it whole wasted tiles), best of a small tile-config sweep at R=2 maxvio 1 (MGPU_CONFIGS
for the forward, the 3 best of those for dX; only configs its own sweep allows: N divisible by
block_n * grid_block_n), then that best config at every main grouping, within a time budget
(--mgpu-budget; each group count is a compile).
Every failure is recorded per config / grouping, never fatal.

dW is timed as the layer calls it (`grouped_matmul_dw` through `dw_call` below); the record keeps
the output dtypes and shapes the kernel produced.

Writes benchmarks/results/bench_gemm_<gpu>x<count>.json (and into --out), rewritten after every
step (and on SIGTERM), and prints a table. `--quick`: S = 512 (M = 4096 rows per rank), H = 512,
F = 256, 3 repetitions, two mgpu configs. `--groupings FILE` reuses a plan_groupings.py JSON of the
same S instead of planning (about 15-40 s of CPU). `--groupings-only` prints the groupings and exits
(no GPU needed).

    python benchmarks/bench_gemm.py [--quick] [--out DIR] [--reps 20] [--groupings FILE]
"""

from __future__ import annotations

import argparse
import functools
import os
import json
import pathlib
import signal
import sys
import time

# The R=2 layout holds 22.5 GB of weights and dW writes up to 50 GB per call: let XLA take more
# than its default 75 % (keeps a user's explicit setting).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import plan_groupings  # noqa: E402

from moonep_jax import _ffi  # noqa: E402

E = plan_groupings.E
FULL = {"S": 8192, "H": 7168, "F": 2048}
QUICK = {"S": 512, "H": 512, "F": 256}
CPU_SMOKE = {"S": 64, "H": 128, "F": 64}
MAXVIO = _common.MAXVIOS
SYNTHETIC_R = 2  # the diagnostic groupings use EP=2's layout

# ragged_dot_mgpu tile configs: (block_m, block_n, block_k, max_concurrent_steps, grid_block_n).
# Picked from its own sweep's space (block_m/n in 64/128/192, block_k 64, 2-6 stages, grid_block_n
# 1-16): tile shapes whose fp32 accumulator fits one warp group's registers and whose pipeline
# fits the shared memory, with stage count and N-blocking varied around the usual best.
# (block_n 192 divides neither 4096 nor 7168, so no 192-wide N tile.) All lower for sm_90a at the
# record shape with 194 groups (checked on CPU: jit(...).trace(...).lower(lowering_platforms=
# ("cuda",)), which also checks the shared memory). dX tries the 3 best forward configs.
MGPU_CONFIGS = [(128, 128, 64, 4, 1), (128, 128, 64, 6, 1), (128, 128, 64, 4, 4),
                (64, 128, 64, 4, 1), (192, 128, 64, 4, 1), (64, 256, 64, 4, 1),
                (128, 256, 64, 3, 1)]
MGPU_DX_FROM_BEST_FWD = 3
QUICK_MGPU_CONFIGS = MGPU_CONFIGS[:2]
MGPU_NAMES = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
RAGGED_DOT_NOTE = ("with ~E+epn groups XLA lowers it through a dense [M, G, K] mask (336 GiB at "
                   "M=65536, G=384, K=7168) and its compile fails with RESOURCE_EXHAUSTED on an "
                   "H200 (jax 0.11.2)")


# ---- groupings ----------------------------------------------------------------------------------


def synthetic_sizes(maxvio: float, rng, m: int) -> np.ndarray:
    """EP=2, rank 0: G = E + epn sizes summing to m, its epn experts then all epn slots non-empty."""
    epn = E // SYNTHETIC_R
    sigma = 0.05
    for _ in range(60):  # widen the log-normal until the hottest group reaches the target
        pop = rng.lognormal(0.0, sigma, 2 * epn)
        if pop.max() / pop.mean() - 1 >= maxvio:
            break
        sigma *= 1.15
    counts = np.floor(pop / pop.sum() * m).astype(np.int64)
    counts[np.argmax(counts)] += m - counts.sum()
    sizes = np.zeros(E + epn, np.int64)
    sizes[:epn] = counts[:epn]
    sizes[E:] = counts[epn:]
    return sizes


def diagnostic_sizes(m: int, tile_m: int) -> dict:
    epn = E // SYNTHETIC_R
    one = np.zeros(E + epn, np.int64)
    one[0] = m
    # Whole tiles over up to 2*epn groups (as many weight matrices as the synthetic groupings, when
    # there are at least as many tiles; with 256-row tiles and M = 65536, 256 groups get one tile).
    tiles = np.full(2 * epn, (m // tile_m) // (2 * epn), np.int64)
    tiles[:(m // tile_m) % (2 * epn)] += 1
    aligned = np.zeros(E + epn, np.int64)
    aligned[:epn] = tiles[:epn] * tile_m
    aligned[E:] = tiles[epn:] * tile_m
    return {
        "one_group": (one, "all rows in one group: one weight matrix, no partial tiles (the "
                           "kernel against cuBLAS on the same work)"),
        "tile_aligned": (aligned, "whole M tiles over up to 2*epn groups, one group per tile "
                                  "when there are fewer tiles: weight traffic without partial "
                                  "tiles"),
    }


def all_groupings(plans: dict, m_synthetic: int, tile_m: int) -> list[dict]:
    """Main groupings (one rank of each real plan at E=384), bench_layer --one-gpu's plans (R=1,
    E=192), then the synthetic diagnostics, as dicts with `sizes [G]` and `experts_to_copy [R, B]`
    (the plan's; for the synthetic layouts rank 0's slots hold rank 1's experts, so no local
    expert of rank 0 has a replica)."""
    out = []
    for p in plans["points"]:
        rank = plan_groupings.critical_rank(p)
        cu = np.asarray(p["cu_seqlens"][rank["rank"]], np.int64)
        e = p.get("E", E)
        main = e == E
        out.append({"label": f"R{p['R']} maxvio {p['maxvio_target']:g}" if main else
                    f"R{p['R']} E{e} maxvio {p['maxvio_target']:g}",
                    "kind": "real_plan" if main else "layer_one_gpu", "E": e, "epn": e // p["R"],
                    **({} if main else {"diagnostic": "bench_layer --one-gpu's plan (R=1, E=192: "
                                                      "EP=2's per-rank work), the layer step's "
                                                      "GEMM groupings"}),
                    "R": p["R"], "rank": rank["rank"], "maxvio_target": p["maxvio_target"],
                    "maxvio_measured": p["maxvio_measured"], "sizes": np.diff(cu, prepend=0),
                    "experts_to_copy": np.asarray(p["experts_to_copy"], np.int32),
                    "nvs": p["nvs"], "stats": rank,
                    "all_ranks_m_tiles": [r["m_tiles"] for r in p["ranks"]]})
    epn = E // SYNTHETIC_R
    slots = np.full((SYNTHETIC_R, epn), -1, np.int32)
    slots[0] = np.arange(epn, 2 * epn)
    rng = np.random.default_rng(0)
    synthetic = [(f"synthetic maxvio {mv:g}", synthetic_sizes(mv, rng, m_synthetic),
                  {"maxvio_target": mv}) for mv in MAXVIO]
    synthetic += [(name, sizes, {"diagnostic": why})
                  for name, (sizes, why) in diagnostic_sizes(m_synthetic, tile_m).items()]
    for label, sizes, extra in synthetic:
        out.append({"label": label, "kind": "diagnostic", "R": SYNTHETIC_R, "rank": 0, "E": E,
                    "epn": epn,
                    "sizes": sizes, "experts_to_copy": slots, "nvs": m_synthetic,
                    "stats": plan_groupings.rank_summary(np.cumsum(sizes), 0, SYNTHETIC_R,
                                                         tile_m), **extra})
    return out


# ---- the timed calls ----------------------------------------------------------------------------


def projection_shapes(h: int, f: int) -> dict[str, tuple[int, int]]:
    """`{projection: (D0, D1)}`, each an [M, D0] x [D0, D1] product: gate+up (K = H, N = 2F) and
    down (K = F, N = H)."""
    return {"gate_up": (h, 2 * f), "down": (f, h)}


def dw_call(gemm, R: int, epn: int, num_slots: int):
    """`(jitted fn(x, dy, cu_seqlens, ep_rank, experts_to_copy), how)`: `grouped_matmul_dw` as
    moe_ffn's backward calls it: (bf16 local, fp32 partials, fp32 slots) with
    `(num_partials, num_slots) = (epn, B)` when R > 1, `(0, 0)` at R = 1, unused slots left
    unwritten (moonep_jax.experts.weight_grad_counts)."""
    fn = gemm.grouped_matmul_dw_of_groups
    partials, slots = (epn, num_slots) if R > 1 else (0, 0)

    def call(x, dy, cu, rank, experts_to_copy):
        return fn(x, dy, cu, rank, experts_to_copy, epn, partials, slots,
                  zero_unused_slots=False)

    how = (f"grouped_matmul_dw(x, dy, cu, rank, experts_to_copy, {epn}, {partials}, {slots}, "
           "zero_unused_slots=False)")
    return jax.jit(call), how


class MoonepCalls:
    """The grouped GEMM's three timed calls on one weight layout (`draw`'s operands with `epn`
    local experts and B = epn slots): `at(g, ...)` is `{kind: (jitted fn, args)}` for "fwd", "dx"
    and "dw" (as moe_ffn's backward calls it: `dw_call`) at grouping `g` of the layout. The
    layout's groupings share the jitted functions (dW's per R)."""

    def __init__(self, gemm, epn: int):
        self.gemm, self.epn = gemm, epn
        self.fwd = jax.jit(gemm.grouped_matmul_of_groups)
        self.dx = jax.jit(gemm.grouped_matmul_dx_of_groups)
        self._dw: dict = {}

    def dw(self, R: int):
        """`dw_call`'s `(jitted fn, how)` for a grouping of R ranks."""
        if R not in self._dw:
            self._dw[R] = dw_call(self.gemm, R, self.epn, self.epn)
        return self._dw[R]

    def at(self, g: dict, x, dy, w_local, w_slots) -> dict:
        """`{kind: (jitted fn, args)}` at grouping `g`, on the layout's operands."""
        cu = jnp.asarray(np.cumsum(g["sizes"]), jnp.int32)
        rank = jnp.array([g["rank"]], jnp.int32)
        slots = jnp.asarray(g["experts_to_copy"], jnp.int32)
        return {"fwd": (self.fwd, (x, w_local, w_slots, cu, rank)),
                "dx": (self.dx, (dy, w_local, w_slots, cu, rank)),
                "dw": (self.dw(g["R"])[0], (x, dy, cu, rank, slots))}


def out_avals(fn, *args) -> list[dict]:
    shapes = jax.tree.leaves(jax.eval_shape(fn, *args))
    return [{"shape": list(s.shape), "dtype": str(s.dtype)} for s in shapes]


def mgpu_module():
    """`ragged_dot_mgpu` (or the reason it cannot be imported)."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        return ragged_dot_mgpu, None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def mgpu_call(module, config: tuple, transpose_rhs: bool):
    kwargs = dict(zip(MGPU_NAMES, config))

    def call(lhs, rhs, group_sizes):
        return module.ragged_dot(lhs, rhs, group_sizes=group_sizes, transpose_rhs=transpose_rhs,
                                 **kwargs)

    return jax.jit(call)


def mgpu_config_ok(config: tuple, k: int, n: int) -> str | None:
    """Why its kernel (and its own sweep) rules the config out for K x N, or None."""
    bm, bn, bk, _, gbn = config
    if k % bk:
        return f"k={k} not a multiple of block_k={bk}"
    if n % (bn * gbn):
        return f"n={n} not a multiple of block_n*grid_block_n={bn * gbn} (ruled out by its sweep)"
    return None


# ---- CPU smoke test: the bookkeeping without the CUDA kernels ----------------------------------


class XlaStandIns:
    """`--cpu-smoke` only: lax.ragged_dot stand-ins with the extension's signatures, so that the
    whole benchmark runs on a CPU at a tiny shape (the times mean nothing)."""

    @staticmethod
    def tile_m():
        return 256

    @staticmethod
    def _sizes(cu, rank, E_, epn):
        sizes = jnp.diff(cu, prepend=0)
        return jnp.concatenate([jax.lax.dynamic_slice_in_dim(sizes, rank[0] * epn, epn),
                                sizes[E_:]]).astype(jnp.int32)

    @classmethod
    def grouped_matmul_of_groups(cls, x, w_local, w_slots, cu, rank):
        epn = w_local.shape[0]
        return jax.lax.ragged_dot(x, jnp.concatenate([w_local, w_slots]),
                                  cls._sizes(cu, rank, cu.shape[0] - w_slots.shape[0], epn))

    @classmethod
    def grouped_matmul_dx_of_groups(cls, dy, w_local, w_slots, cu, rank):
        w = jnp.concatenate([w_local, w_slots]).transpose(0, 2, 1)
        return jax.lax.ragged_dot(dy, w, cls._sizes(cu, rank, cu.shape[0] - w_slots.shape[0],
                                                    w_local.shape[0]))

    @classmethod
    def grouped_matmul_dw_of_groups(cls, x, dy, cu, rank, experts_to_copy, num_local,
                                    num_partials, num_slots, *, zero_unused_slots=True):
        del zero_unused_slots
        all_slots = experts_to_copy.shape[1]
        sizes = cls._sizes(cu, rank, cu.shape[0] - all_slots, num_local)
        group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(x.shape[0]), side="right")
        onehot = jax.nn.one_hot(group, num_local + all_slots, dtype=jnp.float32)
        dw = jnp.einsum("mg,md,mn->gdn", onehot, x.astype(jnp.float32), dy.astype(jnp.float32))
        return (dw[:num_local].astype(x.dtype), dw[:num_partials],
                dw[num_local:num_local + num_slots])


class MgpuStandIn:
    @staticmethod
    def ragged_dot(lhs, rhs, *, group_sizes, transpose_rhs=False, **_):
        return jax.lax.ragged_dot(lhs, rhs.transpose(0, 2, 1) if transpose_rhs else rhs,
                                  group_sizes)


# ---- measuring ----------------------------------------------------------------------------------


def measure(name, fn, args, reps, flops, interleaved_with=None, **extra) -> dict:
    """Time `fn(*args)`; a method that cannot run is recorded with its error. Prints as it goes.

    With `interleaved_with = (dense fn, its args)`, the two are timed in turn, call i of each
    before call i + 1 of either (`_common.time_round_robin`), and the result also holds the dense
    call's times (`dense_interleaved_times_ms`, its median `dense_interleaved_ms`) and
    `pct_of_dense_interleaved`, the ratio of the two medians: both then run in the same power
    state of the GPU, which holds its power limit by its clock (the dense references timed in
    blocks of their own ran at up to 1980 MHz while the grouped GEMMs' blocks ran at 1320-1935)."""
    t0 = time.perf_counter()
    try:
        with _common.gpu_clocks() as clocks:
            if interleaved_with is None:
                times, dense_times = _common.time_calls(fn, args, reps), None
            else:
                timed = _common.time_round_robin(lambda f, a: f(*a),
                                                 [(fn, args), interleaved_with], reps)
                failed = [t["status"] for t in timed if t["status"] != "ok"]
                if failed:
                    raise RuntimeError(failed[0])
                times, dense_times = (t["times_ms"] for t in timed)
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e)}"
        print(f"{name:24s} {extra.get('grouping', ''):>20} failed: {msg.splitlines()[0][:160]}",
              flush=True)
        return {"name": name, "error": msg[:600], "seconds": time.perf_counter() - t0, **extra}
    median = float(np.median(times))
    result = {"name": name, "times_ms": times, "median_ms": median,
              "tflops": flops / (median * 1e-3) / 1e12, "seconds": time.perf_counter() - t0,
              "gpu_clocks": clocks, **extra}
    line = f"{median:8.3f} ms {result['tflops']:7.1f} TFLOP/s"
    if dense_times is not None:
        dense_median = float(np.median(dense_times))
        result.update(dense_interleaved_times_ms=dense_times, dense_interleaved_ms=dense_median,
                      pct_of_dense_interleaved=100 * dense_median / median)
        line += f" ({result['pct_of_dense_interleaved']:.0f} % of dense in turn)"
    print(f"{name:24s} {extra.get('grouping', ''):>20} {line}", flush=True)
    return result


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def draw(key, m: int, d0: int, d1: int, num: int):
    """`(x [m, d0], dy [m, d1], w_local [num, d0, d1], w_slots [num, d0, d1])` bf16, on device
    (a NumPy draw of [192, 7168, 4096] takes minutes and 45 GB)."""
    k = jax.random.split(key, 4)
    normal = lambda i, shape, scale: (  # noqa: E731
        jax.random.normal(k[i], shape, jnp.bfloat16) * jnp.bfloat16(scale))
    return (normal(0, (m, d0), 1.0), normal(1, (m, d1), 1.0),
            normal(2, (num, d0, d1), d0 ** -0.5), normal(3, (num, d0, d1), d0 ** -0.5))


def grouping_record(g: dict) -> dict:
    """What a result carries about its grouping."""
    keep = ("label", "kind", "R", "E", "rank", "maxvio_target", "maxvio_measured", "diagnostic")
    return {"grouping": g["label"], **{k: g[k] for k in keep[1:] if k in g},
            **{k: g["stats"][k] for k in ("num_groups", "nonempty_groups", "used_slots", "rows",
                                          "m_tiles", "min_m_tiles", "useful_row_fraction",
                                          "useful_mma_fraction", "max_group")}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=None, help="timed calls (20; --quick 3)")
    parser.add_argument("--quick", action="store_true", help="small shapes (GPU smoke run)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shape on the CPU with XLA stand-ins for every kernel (tests "
                             "the benchmark's bookkeeping only; writes to --out alone)")
    parser.add_argument("--groupings", type=pathlib.Path, default=None,
                        help="reuse this plan_groupings.py JSON instead of planning")
    parser.add_argument("--groupings-only", action="store_true",
                        help="plan, print the groupings (and write them to --out), exit")
    parser.add_argument("--no-mgpu", action="store_true", help="leave out ragged_dot_mgpu")
    parser.add_argument("--mgpu-budget", type=float, default=75.0,
                        help="seconds of ragged_dot_mgpu (sweep + groupings, compiles included) "
                             "per projection: R=2 (with the sweep) may take 60%%, R=8 the rest "
                             "(default 75)")
    parser.add_argument("--ragged-dot", action="store_true",
                        help=f"also time jax.lax.ragged_dot once (at the full shape: "
                             f"{RAGGED_DOT_NOTE})")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="also write the JSON here (benchmarks/results always, except "
                             "--cpu-smoke)")
    args = parser.parse_args()
    shape = CPU_SMOKE if args.cpu_smoke else QUICK if args.quick else FULL
    args.reps = args.reps or (3 if args.quick or args.cpu_smoke else 20)
    S, h, f = shape["S"], shape["H"], shape["F"]
    m = S * plan_groupings.K  # rows per rank of every grouping (NvS with token_padding 1)

    if args.groupings_only:
        plans = plan_groupings.compute(plan_groupings.LAYOUTS, MAXVIO, S)
        plan_groupings.print_table(plans)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"plan_groupings_S{S}.json").write_text(plan_groupings.dumps(plans))
        return
    on_gpu = jax.default_backend() == "gpu" and _ffi.available()
    if not on_gpu and not args.cpu_smoke:
        print("bench_gemm: skipped, it measures the CUDA grouped GEMM and needs a GPU and the "
              f"extension (backend {jax.default_backend()!r}; "
              f"{_ffi.unavailable_reason() or 'extension built'}); --cpu-smoke tests the script")
        return
    if args.cpu_smoke:
        gemm, (mgpu, mgpu_missing) = XlaStandIns, (MgpuStandIn, None)
    else:
        from moonep_jax._cuda import grouped_matmul as gemm

        mgpu, mgpu_missing = mgpu_module()
    if args.no_mgpu:
        mgpu, mgpu_missing = None, "left out (--no-mgpu)"
    tile_m = gemm.tile_m()

    t_plan = time.perf_counter()
    if args.groupings:
        plans = json.loads(args.groupings.read_text())
        if plans["shape"]["S"] != S:
            raise SystemExit(f"{args.groupings} is for S={plans['shape']['S']}, not {S}")
        plans_source = f"read from {args.groupings}"
    else:
        plans = plan_groupings.compute(plan_groupings.LAYOUTS, MAXVIO, S)
        plans_source = "planned by this run (benchmarks/plan_groupings.py)"
    plan_seconds = time.perf_counter() - t_plan
    plan_groupings.print_table(plans)
    groupings = all_groupings(plans, m, tile_m)

    results = []
    record = {"schema": "moonep_jax.bench_gemm/2", **_common.provenance(),
              "process": "one process, one GPU (jax.devices()[0]); planning in CPU subprocesses "
                         "before any timing",
              "S": S, "K": plan_groupings.K, "E": E, "H": h, "F": f, "M_per_rank": m,
              "dtype": "bfloat16", "quick": args.quick, "cpu_smoke": args.cpu_smoke,
              "reps": args.reps, "tile_m": tile_m, "gpu_clocks": _common.CLOCKS_METHOD,
              "timing": "median wall ms of --reps calls "
              "after one warm-up, each until ready (benchmarks/_common.py time_calls); each "
              "moonep call is timed in turn with its dense reference (time_round_robin: "
              "pct_of_dense_interleaved), and pct_of_dense is against the dense references "
              "timed apart, before and after the projection's grouped GEMMs",
              "groupings_source": plans_source, "planning_seconds": plan_seconds,
              "timed_rank": "the rank with the most M tiles (then rows, then lowest rank)",
              "ragged_dot": "timed" if args.ragged_dot else f"not run: {RAGGED_DOT_NOTE}",
              "mgpu": {"module": "jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot",
                       "status": mgpu_missing or "run", "budget_s": args.mgpu_budget,
                       "configs_tried": [dict(zip(MGPU_NAMES, c)) for c in
                                         (QUICK_MGPU_CONFIGS if args.quick or args.cpu_smoke
                                          else MGPU_CONFIGS)],
                       "groups": "non-empty groups only, in plan order; lhs = the rows "
                                 "(sum of sizes), rhs = those groups' weights (a gathered copy)",
                       "best": {}},
              "dw": {}, "plans": plans, "records": results}
    stem = f"bench_gemm_{_common.device_tag()}" + ("_quick" if args.quick else "") + (
        "_cpusmoke" if args.cpu_smoke else "")
    outs = ([] if args.cpu_smoke else [pathlib.Path(__file__).parent / "results"]) + (
        [args.out] if args.out else [])

    projections = projection_shapes(h, f)

    def write():
        for proj, (d0, d1) in projections.items():
            set_pct_of_dense(proj, gemm_flops(m, d0, d1), results, record)
        for out in outs:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{stem}.json").write_text(plan_groupings.dumps(record))

    def on_term(signum, frame):  # `timeout` in tools/gpu.sh: keep what was measured
        record["interrupted"] = f"signal {signum} after {time.perf_counter() - t_plan:.0f} s"
        write()
        print(f"bench_gemm: {record['interrupted']}; record written", flush=True)
        sys.exit(124)

    signal.signal(signal.SIGTERM, on_term)
    write()
    configs = QUICK_MGPU_CONFIGS if args.quick or args.cpu_smoke else MGPU_CONFIGS
    for pi, (proj, (d0, d1)) in enumerate(projections.items()):
        # Dense references on rank-sized M (every grouping has M = S*K rows here), timed before
        # and after the projection's grouped GEMMs; % of dense uses both (dense_tflops).
        x = dy = dense_operands = None
        for li, epn in enumerate(sorted({g["epn"] for g in groupings}, reverse=True)):
            # Weight layouts by epn (B = epn): 192 for R=2 at E=384, the synthetic groupings and
            # R=1 at E=192; 48 for R=8.
            layout = [g for g in groupings if g["epn"] == epn]
            x, dy, w_local, w_slots = draw(jax.random.key(10 * pi + li), m, d0, d1, epn)
            if dense_operands is None:
                dense_operands = dense_calls(x, dy, w_local[0])
                time_dense(proj, dense_operands, m, gemm_flops(m, d0, d1), args.reps, results,
                           "before")
            moonep = MoonepCalls(gemm, epn)
            for g in layout:
                flops = gemm_flops(g["stats"]["rows"], d0, d1)
                info = grouping_record(g)
                time_moonep(proj, g, moonep, (x, dy, w_local, w_slots), dense_operands, flops,
                            info, args.reps, results, record)
                if args.ragged_dot and g["kind"] == "real_plan" and g.get("maxvio_target") == 1:
                    lhs, rhs, gs = mgpu_operands(g, x, w_local, w_slots)
                    results.append(measure(f"{proj}/ragged_dot_fwd",
                                           jax.jit(lambda a, b, c: jax.lax.ragged_dot(a, b, c)),
                                           (lhs, rhs, gs), max(3, args.reps // 5), flops, **info))
                    del lhs, rhs, gs
                write()
            if mgpu is not None:
                spent = sum(v for k, v in record["mgpu"].get("seconds", {}).items()
                            if k.startswith(f"{proj}/"))
                budget = 0.6 * args.mgpu_budget if li == 0 else args.mgpu_budget - spent
                run_mgpu(mgpu, configs, proj, d0, d1, layout, x, dy, w_local, w_slots,
                         budget, args.reps, results, record, write)
            del w_local, w_slots
            write()
        time_dense(proj, dense_operands, m, gemm_flops(m, d0, d1), args.reps, results,
                   "after")
        write()
        del x, dy, dense_operands

    write()
    print_table(results)
    print(f"wrote {', '.join(str(o / stem) + '.json' for o in outs) or 'nothing (cpu smoke)'}")


def time_moonep(proj: str, g: dict, moonep: MoonepCalls, operands: tuple, dense: dict,
                flops: float, info: dict, reps: int, results: list, record: dict) -> None:
    """Times moonep's fwd, dX and dW at grouping `g` on `operands` (x, dy, w_local, w_slots),
    each in turn with its dense reference of `dense` (`dense_calls`; dW's is the dense dW of the
    dtype the kernel writes for the local experts), and records how dW was called and what it
    wrote. (A function, so that the calls' references to the weights end with it: main's
    `del w_local, w_slots` then frees them before the next layout's draw.)"""
    calls = moonep.at(g, *operands)
    dw, dw_args = calls["dw"]
    dw_out = out_avals(dw, *dw_args)
    record["dw"][f"{proj}/R{g['R']}_E{g['E']}"] = {"call": moonep.dw(g["R"])[1],
                                                    "outputs": dw_out}
    refs = {"fwd": "fwd", "dx": "dx",
            "dw": "dw_bf16" if dw_out[0]["dtype"] == "bfloat16" else "dw_fp32"}
    for kind, (fn, a) in calls.items():
        r = measure(f"{proj}/moonep_{kind}", fn, a, reps, flops, **info,
                    dense_reference=f"{proj}/dense_{refs[kind]}",
                    interleaved_with=dense[refs[kind]])
        if kind == "dw":
            r["dw_outputs"] = dw_out
        results.append(r)


DENSE_KINDS = {
    "fwd": lambda x, dy, w: (jnp.dot, (x, w)),
    "dx": lambda x, dy, w: (lambda a, b: a @ b.T, (dy, w)),
    "dw_bf16": lambda x, dy, w: (lambda a, b: a.T @ b, (x, dy)),
    "dw_fp32": lambda x, dy, w: (
        lambda a, b: jnp.dot(a.T, b, preferred_element_type=jnp.float32), (x, dy)),
}


def dense_calls(x, dy, w) -> dict:
    """`{kind: (jitted fn, args)}` of the dense references on `x [M, D0]`, `dy [M, D1]` and one
    weight `w [D0, D1]`."""
    calls = {}
    for kind, operands in DENSE_KINDS.items():
        fn, a = operands(x, dy, w)
        calls[kind] = (jax.jit(fn), a)
    return calls


def time_dense(proj: str, dense: dict, m: int, flops: float, reps: int, results: list,
               phase: str) -> None:
    """Times every dense reference of `proj` (`dense_calls` on `m` rows, `flops` each; `phase`
    "before" or "after" its grouped GEMMs) and appends the results."""
    for kind, (fn, a) in dense.items():
        results.append(measure(f"{proj}/dense_{kind}", fn, a, reps, flops, M=m, kind="dense",
                               phase=phase))


def gemm_flops(m: int, d0: int, d1: int) -> float:
    """FLOPs of an [m, d0] x [d0, d1] product (or of grouped ones over m rows in all)."""
    return 2.0 * m * d0 * d1


def set_pct_of_dense(proj: str, flops: float, results: list, record: dict) -> None:
    """`record["dense_tflops"][proj/kind]`: each dense reference's rate at the median of all its
    timings so far (before the projection's grouped GEMMs, then also after them: a GPU's clock
    drifts over a minutes-long run, and a run's dense forward at its start took 5.24 ms, the
    previous record's 5.62, while the grouped GEMMs timed between them moved by under 5 %), and
    every `proj` result's `pct_of_dense` against it. Runs on every write, so a record cut short
    holds the percentages of what was timed."""
    combined = record.setdefault("dense_tflops", {})
    for kind in DENSE_KINDS:
        times = [t for r in results if r["name"] == f"{proj}/dense_{kind}"
                 for t in r.get("times_ms", [])]
        if times:
            combined[f"{proj}/{kind}"] = flops / (float(np.median(times)) * 1e-3) / 1e12
    for r in results:
        ref = r.get("dense_reference", "")
        if ref.startswith(f"{proj}/dense_") and r.get("tflops"):
            key = f"{proj}/{ref.split('/dense_', 1)[1]}"
            if key in combined:
                r["pct_of_dense"] = 100 * r["tflops"] / combined[key]


def mgpu_operands(g: dict, x, w_local, w_slots):
    """`(lhs [rows, D0], rhs [G', D0, D1], group_sizes [G'])` over the non-empty groups."""
    sizes = g["sizes"]
    active = np.nonzero(sizes)[0]
    epn = w_local.shape[0]
    local = active[active < g["E"]] - g["rank"] * epn
    slots = active[active >= g["E"]] - g["E"]
    if np.any((local < 0) | (local >= epn)):
        raise ValueError(f"{g['label']}: rows in another rank's expert group")
    rows = int(sizes.sum())
    rhs = jnp.concatenate([w_local[jnp.asarray(local)], w_slots[jnp.asarray(slots)]])
    lhs = x if rows == x.shape[0] else x[:rows]
    return lhs, rhs, jnp.asarray(sizes[active], jnp.int32)


def run_mgpu(mgpu, configs, proj, d0, d1, layout, x, dy, w_local, w_slots, budget: float,
             reps: int, results, record, write):
    """The config sweep (forward and dX, at the R=2 maxvio 1 grouping), then each direction's best
    config at every main grouping of this layout, most telling first, within `budget` seconds."""
    t0 = time.perf_counter()
    main = [g for g in layout if g["kind"] == "real_plan"]
    order = {1.0: 0, 10.0: 1, 0.2: 2, 20.0: 3}
    main.sort(key=lambda g: order.get(g["maxvio_target"], 9))
    if not main:
        return
    shapes = {"fwd": (d0, d1, False, x), "dx": (d1, d0, True, dy)}  # (K, N, transpose, lhs)
    best = record["mgpu"]["best"]
    for kind, (k, n, transpose, lhs_full) in shapes.items():
        key = f"{proj}/{kind}"
        if key not in best:  # sweep at the first layout that has the R=2 maxvio 1 grouping
            sweep_at = main[0]
            lhs, rhs, gs = mgpu_operands(sweep_at, lhs_full, w_local, w_slots)
            info = grouping_record(sweep_at)
            flops = gemm_flops(sweep_at["stats"]["rows"], d0, d1)
            tried = []
            candidates = configs
            if kind == "dx" and best.get(f"{proj}/fwd", {}).get("ranking"):
                candidates = [tuple(c) for c in
                              best[f"{proj}/fwd"]["ranking"][:MGPU_DX_FROM_BEST_FWD]]
            for config in candidates:
                cfg = dict(zip(MGPU_NAMES, config))
                why = mgpu_config_ok(config, k, n)
                if why is None and time.perf_counter() - t0 > budget:
                    why = f"skipped: mgpu budget ({budget:.0f} s here) spent"
                if why:
                    r = {"name": f"{proj}/mgpu_{kind}_sweep", "status": why, "config": cfg, **info}
                    results.append(r)
                    continue
                r = measure(f"{proj}/mgpu_{kind}_sweep", mgpu_call(mgpu, config, transpose),
                            (lhs, rhs, gs), max(3, reps // 4), flops, config=cfg, **info)
                results.append(r)
                if "median_ms" in r:
                    tried.append((r["median_ms"], config))
                write()
            del lhs, rhs, gs
            tried.sort()
            best[key] = ({"config": dict(zip(MGPU_NAMES, tried[0][1])),
                          "sweep_grouping": sweep_at["label"],
                          "ranking": [list(c) for _, c in tried],
                          "ranking_ms": [t for t, _ in tried]} if tried else
                         {"config": None, "why": "no config ran"})
        config = best[key]["config"]
        for g in main:
            info = grouping_record(g)
            if config is None:
                continue
            if time.perf_counter() - t0 > budget:
                results.append({"name": f"{proj}/mgpu_{kind}", **info, "config": config,
                                "status": f"skipped: mgpu budget ({budget:.0f} s here) spent"})
                continue
            lhs, rhs, gs = mgpu_operands(g, lhs_full, w_local, w_slots)
            flops = gemm_flops(g["stats"]["rows"], d0, d1)
            r = measure(f"{proj}/mgpu_{kind}",
                        mgpu_call(mgpu, tuple(config[n_] for n_ in MGPU_NAMES), transpose),
                        (lhs, rhs, gs), reps, flops, config=config, **info,
                        dense_reference=f"{proj}/dense_{kind}")
            results.append(r)
            del lhs, rhs, gs
            write()
    record["mgpu"].setdefault("seconds", {})[f"{proj}/R{main[0]['R']}"] = time.perf_counter() - t0


def print_table(results: list[dict]) -> None:
    """One line per projection and grouping: M tiles, TFLOP/s (% of dense) per direction."""
    cells: dict = {}
    for r in results:
        if "grouping" not in r or "_sweep" in r["name"]:
            continue
        proj, method = r["name"].split("/")
        row = cells.setdefault((proj, r["grouping"]), {"m_tiles": r.get("m_tiles"),
                                                       "groups": r.get("nonempty_groups")})
        if "tflops" in r:
            pcts = [f"{r[k]:.0f}%" for k in ("pct_of_dense", "pct_of_dense_interleaved") if k in r]
            row[method] = f"{r['tflops']:.0f}" + (f" ({' / '.join(pcts)})" if pcts else "")
        else:
            row[method] = "failed" if "error" in r else "skipped"
    cols = ("moonep_fwd", "moonep_dx", "moonep_dw", "mgpu_fwd", "mgpu_dx")
    print("TFLOP/s (% of dense timed apart / % of dense timed in turn), as a README table:")
    print("| projection | grouping | non-empty groups | M tiles | " + " | ".join(cols) + " |")
    print("|---" * (4 + len(cols)) + "|")
    for (proj, label), row in cells.items():
        print(f"| {proj} | {label} | {row['groups'] or 0} | {row['m_tiles'] or 0} | " +
              " | ".join(row.get(c, "") for c in cols) + " |")
    dense = [r for r in results if r.get("kind") == "dense" and "tflops" in r]
    print("dense TFLOP/s: " + ", ".join(f"{r['name']} {r['tflops']:.0f}" for r in dense))


if __name__ == "__main__":
    main()
