"""Grouped GEMM throughput against dense `jnp.dot` and `jax.lax.ragged_dot`, one GPU.

M = S*K = 65536 rows, H = 7168, F = 2048: gate+up (K = H, N = 2F) and down (K = F, N = H), for
forward, dX and dW. G = E + B groups (E = 384, EP = 2, B = epn) hold this rank's experts and its
slots; their sizes follow a log-normal popularity whose skew is tuned to each maxvio target
(the planner caps every rank at S*K rows, so per-group sizes are what varies). Two diagnostic
groupings of the same M separate the causes of the gap to dense: `one_group` (one weight matrix,
whole tiles: the kernel itself against cuBLAS) and `tile_aligned` (as many weight matrices as a
plan, whole tiles: the weight traffic without partial tiles). Writes
benchmarks/results/bench_gemm_<gpu>x<count>.json (and into --out) and prints a table. `--quick` runs
M = 4096, H = 512, F = 256 with 3 repetitions.

    python benchmarks/bench_gemm.py [--quick] [--out DIR] [--reps 20]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

from moonep_jax import _ffi  # noqa: E402

M, H, F = 65536, 7168, 2048
QUICK_M, QUICK_H, QUICK_F = 4096, 512, 256
E, R = 384, 2
EPN = E // R
RANK = 0
MAXVIO = (0.2, 1.0, 10.0, 20.0)


def group_sizes(maxvio: float, rng, m: int) -> np.ndarray:
    """G = E + EPN sizes summing to m: this rank's EPN experts then EPN slots, others empty."""
    sigma = 0.05
    for _ in range(60):  # widen the log-normal until the hottest expert reaches the target
        pop = rng.lognormal(0.0, sigma, 2 * EPN)
        if pop.max() / pop.mean() - 1 >= maxvio:
            break
        sigma *= 1.15
    counts = np.floor(pop / pop.sum() * m).astype(np.int64)
    counts[np.argmax(counts)] += m - counts.sum()
    sizes = np.zeros(E + EPN, np.int64)
    sizes[RANK * EPN:(RANK + 1) * EPN] = counts[:EPN]
    sizes[E:] = counts[EPN:]
    return sizes


def diagnostic_groupings(m: int, tile_m: int) -> dict:
    """Groupings that separate the causes of the gap to dense (same M, same kernels)."""
    one = np.zeros(E + EPN, np.int64)
    one[RANK * EPN] = m
    # Whole tiles over up to 2*EPN groups (as many weight matrices as the plans use, when there
    # are at least as many tiles; with 256-row tiles and M = 65536, 256 groups get one tile).
    tiles = np.full(2 * EPN, (m // tile_m) // (2 * EPN), np.int64)
    tiles[:(m // tile_m) % (2 * EPN)] += 1
    aligned = np.zeros(E + EPN, np.int64)
    aligned[RANK * EPN:(RANK + 1) * EPN] = tiles[:EPN] * tile_m
    aligned[E:] = tiles[EPN:] * tile_m
    return {
        "one_group": (one, "all rows in one group: one weight matrix, no partial tiles (the "
                           "kernel against cuBLAS on the same work)"),
        "tile_aligned": (aligned, "whole M tiles over up to 2*epn groups, one group per tile "
                                  "when there are fewer tiles: weight traffic without partial "
                                  "tiles"),
    }


def tile_counts(sizes: np.ndarray, m: int, tile_m: int) -> dict:
    """M tiles and MMA rows of the ragged-M kernels: every M tile holds rows of one group, and
    a tile issues MMAs only for its 64-row blocks that hold rows of the group."""
    full, rest = sizes // tile_m, sizes % tile_m
    m_tiles = int(np.sum(full + (rest > 0)))
    issued = int(np.sum(full * tile_m + -(-rest // 64) * 64))
    return {"m_tiles": m_tiles, "useful_row_fraction": m / (m_tiles * tile_m),
            "issued_mma_rows": issued, "useful_mma_fraction": m / issued}


RAGGED_DOT_NOTE = ("with ~E+epn groups XLA lowers it through a dense [M, G, K] mask (336 GiB at "
                   "M=65536, G=384, K=7168) and its compile fails with RESOURCE_EXHAUSTED on an "
                   "H200 (jax 0.11.2)")


@jax.jit(static_argnums=(1, 2, 3))
def draw(key, m: int, d0: int, d1: int):
    """`(x [m, d0], dy [m, d1], w_local [epn, d0, d1], w_slots [epn, d0, d1])` bf16."""
    k = jax.random.split(key, 4)
    normal = lambda i, shape, scale: (  # noqa: E731
        jax.random.normal(k[i], shape, jnp.bfloat16) * jnp.bfloat16(scale))
    return (normal(0, (m, d0), 1.0), normal(1, (m, d1), 1.0),
            normal(2, (EPN, d0, d1), d0 ** -0.5), normal(3, (EPN, d0, d1), d0 ** -0.5))


def measure(name, fn, args, reps, flops, **extra) -> dict:
    """Time `fn(*args)`; a method that cannot run (ragged_dot's dense lowering runs out of memory
    at this shape) is recorded with its error instead of ending the run. Prints as it goes."""
    try:
        times = _common.time_calls(fn, args, reps)
    except Exception as e:  # noqa: BLE001
        print(f"{name:22s} {extra.get('grouping', ''):>12} failed: {str(e).splitlines()[0][:160]}")
        return {"name": name, "error": str(e).splitlines()[0][:400], **extra}
    median = float(np.median(times))
    result = {"name": name, "times_ms": times, "median_ms": median,
              "tflops": flops / (median * 1e-3) / 1e12, **extra}
    print(f"{name:22s} {extra.get('grouping', ''):>12} {median:8.3f} ms "
          f"{result['tflops']:7.1f} TFLOP/s", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=None, help="timed calls (20; --quick 3)")
    parser.add_argument("--quick", action="store_true", help="small shapes")
    parser.add_argument("--ragged-dot", action="store_true",
                        help=f"also time jax.lax.ragged_dot (at the full shape: {RAGGED_DOT_NOTE})")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="also write the JSON here (benchmarks/results always)")
    args = parser.parse_args()
    args.reps = args.reps or (3 if args.quick else 20)
    m, h, f = (QUICK_M, QUICK_H, QUICK_F) if args.quick else (M, H, F)
    if jax.default_backend() != "gpu" or not _ffi.available():
        print("bench_gemm: skipped, it measures the CUDA grouped GEMM and needs a GPU and the "
              f"extension (backend {jax.default_backend()!r}; {_ffi.unavailable_reason() or 'extension built'})")
        return
    from moonep_jax._cuda import gemm

    rng = np.random.default_rng(0)
    rank = jnp.array([RANK], jnp.int32)
    results = []
    for proj, (d0, d1) in {"gate_up": (h, 2 * f), "down": (f, h)}.items():
        flops = 2.0 * m * d0 * d1
        # Drawn on the device in bf16: a NumPy draw of [epn, 7168, 4096] takes minutes and 45 GB.
        x, dy, w_local, w_slots = draw(jax.random.key(len(results)), m, d0, d1)
        w_dense = w_local[0]
        results.append(measure(f"{proj}/dense_fwd", jax.jit(jnp.dot), (x, w_dense), args.reps,
                               flops))
        results.append(measure(f"{proj}/dense_dx", jax.jit(lambda a, b: a @ b.T), (dy, w_dense),
                               args.reps, flops))
        results.append(measure(
            f"{proj}/dense_dw", jax.jit(lambda a, b: jnp.dot(a.T, b, preferred_element_type=jnp.float32)),
            (x, dy), args.reps, flops))
        groupings = [(f"maxvio {maxvio}", group_sizes(maxvio, rng, m), {"maxvio_target": maxvio})
                     for maxvio in MAXVIO]
        groupings += [(name, sizes, {"diagnostic": why})
                      for name, (sizes, why) in diagnostic_groupings(m, gemm.tile_m()).items()]
        for label, sizes, extra in groupings:
            cu = jnp.asarray(np.cumsum(sizes), jnp.int32)
            nonzero = sizes[sizes > 0]
            extra = {"grouping": label, **extra, **tile_counts(sizes, m, gemm.tile_m()),
                     "num_groups": int(len(sizes)), "nonempty_groups": int(len(nonzero)),
                     "max_group": int(sizes.max()),
                     "group_skew_measured": float(nonzero.max() / nonzero.mean() - 1)}
            maxvio = extra.get("maxvio_target")
            fwd = jax.jit(gemm.grouped_matmul)
            dx = jax.jit(gemm.grouped_matmul_dx)
            dw = jax.jit(gemm.grouped_matmul_dw, static_argnums=(4, 5))
            results.append(measure(f"{proj}/moonep_fwd", fwd, (x, w_local, w_slots, cu, rank),
                                   args.reps, flops, **extra))
            results.append(measure(f"{proj}/moonep_dx", dx, (dy, w_local, w_slots, cu, rank),
                                   args.reps, flops, **extra))
            results.append(measure(f"{proj}/moonep_dw", dw, (x, dy, cu, rank, EPN, EPN),
                                   args.reps, flops, **extra))
            if maxvio == 1.0 and args.ragged_dot:  # over the non-empty groups' weights, once
                active = np.nonzero(sizes)[0]
                w_all = jnp.concatenate([w_local, w_slots])
                mats = np.where(active >= E, active - E + EPN, active - RANK * EPN)
                ragged = jax.jit(lambda a, w, s: jax.lax.ragged_dot(a, w, s))
                results.append(measure(f"{proj}/ragged_dot_fwd", ragged,
                                       (x, w_all[mats], jnp.asarray(sizes[active], jnp.int32)),
                                       max(3, args.reps // 5), flops, **extra))
                del w_all

    record = {"schema": "moonep_jax.bench_gemm/1", **_common.provenance(), "M": m, "H": h,
              "F": f, "E": E, "R": R, "quick": args.quick, "reps": args.reps,
              "ragged_dot": "timed" if args.ragged_dot else f"not run: {RAGGED_DOT_NOTE}",
              "records": results}
    stem = f"bench_gemm_{_common.device_tag()}" + ("_quick" if args.quick else "")
    outs = [pathlib.Path(__file__).parent / "results"] + ([args.out] if args.out else [])
    for out in outs:
        _common.write_json(out / f"{stem}.json", record)
    dense = {r["name"]: r["tflops"] for r in results if "/dense_" in r["name"] and "tflops" in r}
    print(f"{'name':22s} {'grouping':>12s} {'ms':>8s} {'TFLOP/s':>8s} {'% dense':>8s}")
    for r in results:
        if "error" in r:
            continue
        proj, kind = r["name"].split("/")
        base = dense.get(f"{proj}/dense_{kind.split('_')[-1]}")
        pct = f"{100 * r['tflops'] / base:7.1f}%" if base else ""
        print(f"{r['name']:22s} {r.get('grouping', ''):>12} {r['median_ms']:8.3f} "
              f"{r['tflops']:8.1f} {pct:>8s}")
    print(f"wrote {', '.join(str(o / stem) + '.json' for o in outs)}")


if __name__ == "__main__":
    main()
