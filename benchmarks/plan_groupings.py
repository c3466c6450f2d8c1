"""The grouped GEMM's groupings that real plans produce: `cu_seqlens` from the planner.

For each (R, E) and maxvio target: a `moonep_jax.routing.lognormal_for_maxvio` routing (key 1234,
as in bench_layer and bench_dispatch) of the record shape (S=8192, K=8, E=384 at R=2 and 8; E=192 at
R=1, bench_layer --one-gpu's problem), planned with
`moonep_jax.plan` (implementation "xla", the bit-exact reference of the CUDA planner) inside a
`jax.shard_map` over R CPU devices. Every rank's `cu_seqlens [G = E + B]` comes back with its
group statistics (groups, non-empty groups, rows, M tiles of the GEMM's `tile_m`).

The planner needs R devices; on a GPU machine jax has one CPU device by default and the GPU is
the default backend, so `compute()` runs this file in a subprocess with `JAX_PLATFORMS=cpu` and
`XLA_FLAGS=--xla_force_host_platform_device_count=R` (one subprocess per R), which works the same
on the CPU machine and on the GPU machine and keeps the GPU process's XLA flags untouched.

    python benchmarks/plan_groupings.py [--layouts 2x384 8x384 1x192] [--maxvio 0.2 1 10 20]
                                        [--S 8192] [--out FILE.json]

prints one line per (R, maxvio, rank) and writes the groupings (with every rank's cu_seqlens).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

S, K, E, H, F = 8192, 8, 384, 7168, 2048
SEED = 1234
# (R, E) planned by default: the record shape at EP=2 and EP=8, and bench_layer --one-gpu's
# problem (R=1, E=192: EP=2's per-rank work), whose groups are the layer step's GEMM groupings.
LAYOUTS = ((2, E), (8, E), (1, E // 2))
MAXVIOS = (0.2, 1.0, 10.0, 20.0)
DEFAULT_TILE_M = 384  # only when the extension cannot be loaded (tests/test_constants.py holds it
# equal to the kernel's TILE_M); the record says which was used


def tile_stats(sizes, tile_m: int) -> dict:
    """M tiles and MMA rows of the ragged-M kernels: every M tile holds rows of one group, and a
    tile issues MMAs only for its 64-row blocks that hold rows of the group."""
    import numpy as np

    sizes = np.asarray(sizes, np.int64)
    rows = int(sizes.sum())
    full, rest = sizes // tile_m, sizes % tile_m
    m_tiles = int(np.sum(full + (rest > 0)))
    issued = int(np.sum(full * tile_m + -(-rest // 64) * 64))
    return {"m_tiles": m_tiles, "min_m_tiles": -(-rows // tile_m),
            "useful_row_fraction": rows / max(1, m_tiles * tile_m),
            "issued_mma_rows": issued, "useful_mma_fraction": rows / max(1, issued)}


def rank_summary(cu_seqlens, rank: int, R: int, tile_m: int, E: int = E) -> dict:
    """Statistics of one rank's groups (G = E + B, B = epn: groups [rank*epn, (rank+1)*epn) are
    its own experts, groups [E, E + B) its replica slots; every other group is empty)."""
    import numpy as np

    cu = np.asarray(cu_seqlens, np.int64)
    sizes = np.diff(cu, prepend=0)
    epn = E // R
    local = sizes[rank * epn:(rank + 1) * epn]
    slots = sizes[E:]
    other = int(sizes[:E].sum() - local.sum())
    nonzero = sizes[sizes > 0]
    return {"rank": rank, "num_groups": int(len(sizes)), "nonempty_groups": int(len(nonzero)),
            "local_experts": epn, "nonempty_local": int((local > 0).sum()),
            "used_slots": int((slots > 0).sum()), "slot_rows": int(slots.sum()),
            "rows_in_other_ranks_groups": other, "rows": int(cu[-1]),
            "max_group": int(sizes.max()), "min_nonempty_group": int(nonzero.min()),
            "mean_nonempty_group": float(nonzero.mean()),
            **tile_stats(sizes, tile_m)}


def _tile_m() -> tuple[int, str]:
    try:
        from moonep_jax._cuda import grouped_matmul as cuda_gmm

        return (int(cuda_gmm.tile_m()),
                "moonep_jax._cuda.grouped_matmul.tile_m() (the built extension)")
    except Exception as e:  # noqa: BLE001  (pure-Python install: the kernel's documented value)
        return DEFAULT_TILE_M, f"default {DEFAULT_TILE_M}: extension not loadable ({e})"


def _plan_in_this_process(R: int, maxvios, tile_m: int, S: int = S, E: int = E) -> list[dict]:
    """Needs R jax devices of the default backend (the subprocess below sets them up)."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import moonep_jax
    from moonep_jax import routing
    from moonep_jax.plan import plan

    devices = jax.devices()
    if len(devices) < R:
        raise RuntimeError(f"planning R={R} needs {R} devices; have {devices}")
    mesh = jax.make_mesh((R,), ("ep",), devices=devices[:R],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    cfg = moonep_jax.EPConfig(num_experts=E, top_k=K, tokens_per_rank=S, hidden=H, ffn_hidden=F,
                              num_ranks=R, implementation="xla")
    def cu_and_slots(idx):
        p = plan(idx, cfg)
        return p.cu_seqlens, p.experts_to_copy[None]  # the [R, B] table is on every rank

    planner = jax.jit(jax.shard_map(cu_and_slots, mesh=mesh, in_specs=P("ep"),
                                    out_specs=P("ep")))
    points = []
    for maxvio in maxvios:
        t0 = time.perf_counter()
        topk_idx, sigma, realised = routing.lognormal_for_maxvio(jax.random.key(SEED), R, S, K, E,
                                                                 maxvio)
        t_routing = time.perf_counter() - t0
        split = jax.sharding.NamedSharding(mesh, P("ep"))
        cu, slots = planner(jax.device_put(np.asarray(topk_idx).reshape(R * S, K), split))
        cu = np.asarray(cu).reshape(R, cfg.num_groups)
        slots = np.asarray(slots)[0]
        ranks = [rank_summary(cu[r], r, R, tile_m, E) for r in range(R)]
        points.append({"R": R, "E": E, "maxvio_target": maxvio, "maxvio_measured": float(realised),
                       "sigma": float(sigma), "nvs": cfg.nvs, "epn": cfg.epn,
                       "num_slots": cfg.num_slots, "ranks": ranks,
                       "cu_seqlens": cu.tolist(), "experts_to_copy": slots.tolist(),
                       "seconds": {"routing": t_routing,
                                   "plan": time.perf_counter() - t0 - t_routing}})
        print(f"plan_groupings: R={R} E={E} maxvio {maxvio} done in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    return points


def start(layouts=LAYOUTS, maxvios=MAXVIOS, S: int = S) -> dict:
    """Starts one CPU subprocess per (R, E) (in parallel); `collect()` waits for them. Lets a caller
    plan while it does other host work; the planner is CPU work, so do not time GPU work
    meanwhile (a loaded host delays the timing loop)."""
    tile_m, tile_m_source = _tile_m()
    here = pathlib.Path(__file__).resolve()
    children = {}
    for R, E_ in layouts:
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                              f" --xla_force_host_platform_device_count={R}").strip())
        env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
        children[(R, E_)] = subprocess.Popen(
            [sys.executable, str(here), "--child", "--R", str(R), "--E", str(E_), "--S", str(S),
             "--tile-m", str(tile_m), "--maxvio", *map(str, maxvios)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return {"children": children, "t0": time.perf_counter(), "S": S, "tile_m": tile_m,
            "tile_m_source": tile_m_source}


def collect(started: dict, timeout_s: float = 600.0) -> dict:
    points, seconds = [], {}
    for (R, E_), child in started["children"].items():
        try:
            out, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            raise RuntimeError(f"planning R={R} E={E_} took over {timeout_s} s") from None
        seconds[f"R{R}_E{E_}"] = time.perf_counter() - started["t0"]
        if child.returncode != 0:
            raise RuntimeError(f"planning R={R} E={E_} failed (rc {child.returncode}):\n{err[-3000:]}")
        points += json.loads(out.strip().splitlines()[-1])
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import _common

    return {"schema": "moonep_jax.plan_groupings/1", "git_commit": _common.git_commit(),
            "shape": {"S": started["S"], "K": K, "E": E}, "seed": SEED,
            "layouts": [list(k) for k in started["children"]],
            "routing": "moonep_jax.routing.lognormal_for_maxvio(jax.random.key(seed), R, S, K, E, "
                       "maxvio)",
            "planner": "moonep_jax.plan, implementation='xla' (bit-identical to 'cuda' by "
                       "contract), jax.shard_map over R CPU devices in a subprocess",
            "tile_m": started["tile_m"], "tile_m_source": started["tile_m_source"],
            "seconds_wall": seconds, "points": points}


def compute(layouts=LAYOUTS, maxvios=MAXVIOS, S: int = S, timeout_s: float = 600.0) -> dict:
    """The groupings for every (R, E), each planned in a CPU subprocess with R host devices."""
    return collect(start(layouts, maxvios, S), timeout_s)


def dumps(obj) -> str:
    """JSON with indent 1, except that lists of plain numbers stay on one line (cu_seqlens)."""
    import re

    text = json.dumps(obj, indent=1, default=lambda v: v.item() if hasattr(v, "item") else str(v))
    return re.sub(r"\[\s*(-?[\d.e+-]+(?:,\s*-?[\d.e+-]+)*)\s*\]",
                  lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text)


def critical_rank(point: dict) -> dict:
    """The rank whose GEMM has the most M tiles (then the most rows; then the lowest rank): the one
    every other rank waits for in the layer."""
    return max(point["ranks"], key=lambda r: (r["m_tiles"], r["rows"], -r["rank"]))


def print_table(groupings: dict, file=sys.stdout) -> None:
    print(f"tile_m {groupings['tile_m']} ({groupings['tile_m_source']})", file=file)
    print(f"{'R':>2} {'E':>3} {'maxvio':>7} {'meas':>6} {'rank':>4} {'groups':>6} {'nonempty':>8} "
          f"{'slots':>5} {'rows':>6} {'M tiles':>7} {'min':>4} {'max grp':>7} {'mean grp':>8}",
          file=file)
    for p in groupings["points"]:
        worst = critical_rank(p)["rank"]
        for r in p["ranks"]:
            print(f"{p['R']:2d} {p.get('E', E):3d} {p['maxvio_target']:7.1f} {p['maxvio_measured']:6.2f} "
                  f"{r['rank']:4d}{'*' if r['rank'] == worst else ' '}{r['num_groups']:6d} "
                  f"{r['nonempty_groups']:8d} {r['used_slots']:5d} {r['rows']:6d} "
                  f"{r['m_tiles']:7d} {r['min_m_tiles']:4d} {r['max_group']:7d} "
                  f"{r['mean_nonempty_group']:8.1f}", file=file)
    print("* = the rank with the most M tiles (the one bench_gemm times)", file=file)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=[f"{r}x{e}" for r, e in LAYOUTS],
                        help="RxE pairs to plan (default 2x384 8x384 1x192)")
    parser.add_argument("--R", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--E", type=int, default=E, help=argparse.SUPPRESS)
    parser.add_argument("--maxvio", type=float, nargs="+", default=list(MAXVIOS))
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tile-m", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--S", type=int, default=S, help="tokens per rank (the record's 8192)")
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
        points = _plan_in_this_process(args.R, args.maxvio, args.tile_m or DEFAULT_TILE_M,
                                       args.S, args.E)
        print(json.dumps(points))
        return
    layouts = [tuple(int(v) for v in spec.split("x")) for spec in args.layouts]
    groupings = compute(layouts, args.maxvio, args.S)
    print_table(groupings)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(dumps(groupings))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
