"""A/B of two builds of the grouped GEMM: bench_gemm's calls (forward, dX, dW as moe_ffn calls
it) at chosen groupings, timed in this process with whichever extension PYTHONPATH gives it, and
the comparison of such runs.

`run` times every (projection, kind, grouping) and writes `ab_gemm_<tag>_<index>.json`;
`compare` averages each tag's runs per call and prints them side by side, in % of the first tag.
`tools/gpu.sh ab` runs the two builds (`.gpu` as "new", `.gpu_base` as "base") in both process
orders, new-base-base-new, since the second process of a pair runs a few % slower, then compares.

    python benchmarks/ab_gemm.py run --tag new --index 0 --kinds fwd,dx,dw \
        --groupings "R2 maxvio 0.2,R1 E192 maxvio 20" --out DIR
    python benchmarks/ab_gemm.py compare DIR/ab_gemm_*.json

`run --ncu` runs itself (the same arguments without --ncu) under Nsight Compute, with only the
GEMM kernels profiled, and puts each call's kernel times (gpu__time_duration.sum, the warm-up
launch dropped) in place of the wall times: ncu's per-kernel times are what an A/B of a few %
needs, since wall times carry the launch overhead and the host's noise.

`run --orders` times each grouping also with its local groups reordered (`ORDERS`): the tile
table follows group order, so this measures without a kernel change what the order in which the
CTAs meet small groups (a whole expert's weights streamed for a few rows) and large ones (bound by
their MMAs) is worth. Each group's weights are drawn alike, so only the order changes.

Groupings are bench_gemm's labels, planned as bench_gemm plans them: taken from the `plans` of a
bench_gemm record (`--plans`, default this GPU's record in benchmarks/results), or planned here
for `--cpu-smoke` (a tiny shape on CPU, XLA stand-ins for the kernels: it tests the script).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import bench_gemm  # noqa: E402
import plan_groupings  # noqa: E402

KINDS = ("fwd", "dx", "dw")
# The one kernel each kind's call launches that `--ncu` profiles (the rest, the schedule's table
# kernel, is not the GEMM under test): the names of the CuTe DSL kernels' methods.
GEMM_KERNELS = {"fwd": "rows_kernel", "dx": "rows_kernel", "dw": "weight_grad_kernel"}


def groupings(args, shape: dict, tile_m: int, chunk_m: int) -> list[dict]:
    """bench_gemm's groupings of the requested labels, in bench_gemm's order, each in every one
    of `--orders`."""
    if args.cpu_smoke:
        plans = plan_groupings.compute(((2, bench_gemm.E),), (0.2, 20.0), shape["S"])
    else:
        path = args.plans or (_common.REPO / "benchmarks" / "results" /
                              f"bench_gemm_{_common.device_tag(1)}.json")
        plans = json.loads(pathlib.Path(path).read_text())["plans"]
    m = shape["S"] * plan_groupings.K
    found = [g for g in bench_gemm.all_groupings(plans, m, tile_m) if g["label"] in args.groupings]
    missing = set(args.groupings) - {g["label"] for g in found}
    if missing:
        raise SystemExit(f"ab_gemm: --groupings {sorted(missing)} are not bench_gemm groupings "
                         f"of these plans")
    return [reordered(g, order, tile_m, chunk_m) for g in found for order in args.orders]


# `--orders`: the local groups' orders (module docstring).
ORDERS = ("plan", "interleave", "small_first", "small_last")


def reordered(g: dict, order: str, tile_m: int, chunk_m: int) -> dict:
    """Grouping `g` with its local groups' sizes in `order`: `plan` as planned; `interleave` the
    groups of at most `chunk_m` rows (one A chunk: wide items only) spread evenly between the
    others by their tiles; `small_first` / `small_last` those groups before / after all others."""
    if order == "plan":
        return g
    sizes = np.array(g["sizes"])
    first = g["rank"] * g["epn"]
    local = sizes[first:first + g["epn"]]
    small = [int(v) for v in local if 0 < v <= chunk_m]
    large = [int(v) for v in local if v > chunk_m]
    empty = [0] * int(np.sum(local == 0))
    if order == "small_first":
        ordered = small + large
    elif order == "small_last":
        ordered = large + small
    else:
        # small group k goes before the large group whose tiles hold (k + 1/2) / len(small) of
        # all the large groups' tiles
        ends = np.cumsum([-(-v // tile_m) for v in large])
        share = (np.arange(len(small)) + 0.5) / max(len(small), 1) * (ends[-1] if large else 0)
        before = np.searchsorted(ends, share, side="right")
        ordered = [v for i, big in enumerate(large)
                   for v in [s for s, b in zip(small, before) if b == i] + [big]] or small
    sizes[first:first + g["epn"]] = ordered + empty
    return {**g, "label": f"{g['label']} [{order}]", "sizes": sizes}


def run(args) -> None:
    shape = bench_gemm.CPU_SMOKE if args.cpu_smoke else bench_gemm.FULL
    if args.cpu_smoke:
        gemm = bench_gemm.XlaStandIns
        chunk_m = gemm.tile_m() // 2  # the stand-ins have no A chunks: any bound tests --orders
    else:
        from moonep_jax import _ffi
        from moonep_jax._cuda import grouped_matmul as gemm
        chunk_m = _ffi.lib().GROUPED_MATMUL_CHUNK_M
    h, f = shape["H"], shape["F"]
    m = shape["S"] * plan_groupings.K
    selected = groupings(args, shape, gemm.tile_m(), chunk_m)
    results = []
    for pi, (proj, (d0, d1)) in enumerate(bench_gemm.projection_shapes(h, f).items()):
        for epn in sorted({g["epn"] for g in selected}, reverse=True):
            x, dy, w_local, w_slots = bench_gemm.draw(jax.random.key(pi), m, d0, d1, epn)
            moonep = bench_gemm.MoonepCalls(gemm, epn)
            for g in (g for g in selected if g["epn"] == epn):
                calls = moonep.at(g, x, dy, w_local, w_slots)
                for kind in args.kinds:
                    fn, fn_args = calls[kind]
                    with _common.gpu_clocks() as clocks:
                        times = _common.time_calls(fn, fn_args, args.reps)
                    median = float(np.median(times))
                    flops = bench_gemm.gemm_flops(g["stats"]["rows"], d0, d1)
                    print(f"{args.tag:6s} {proj:8s} {kind:3s} {g['label']:22s} {median:8.3f} ms "
                          f"{flops / median / 1e9:7.1f} TFLOP/s", flush=True)
                    results.append({"proj": proj, "kind": kind, "grouping": g["label"],
                                    "median_ms": median, "times_ms": times,
                                    "gpu_clocks": clocks})
            del w_local, w_slots
    record = {"schema": "moonep_jax.ab_gemm/1", **_common.provenance(), "tag": args.tag,
              "index": args.index, "reps": args.reps, "cpu_smoke": args.cpu_smoke,
              "timing": "wall clock of each call until ready, after one warm-up call",
              "gpu_clocks_method": _common.CLOCKS_METHOD, "results": results}
    _common.write_json(args.out / f"ab_gemm_{args.tag}_{args.index}.json", record)


def run_profiled(args, argv: list[str]) -> None:
    """`run` (argv without --ncu) under ncu; its record's times become the kernels' times."""
    # `tools/gpu.sh`'s timeout sends SIGTERM: exit through `run_under_ncu`'s cleanup, which ends
    # the profiled process group instead of leaving it on the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"ab_gemm_{args.tag}_{args.index}"
    csv_path = args.out / f"{stem}_ncu.csv"
    kernels = "|".join(sorted({GEMM_KERNELS[k] for k in args.kinds}))
    child = [str(pathlib.Path(__file__).resolve()), *(a for a in argv if a != "--ncu")]
    try:
        command = _common.ncu_command(["--kernel-name", f"regex:{kernels}"], child)
    except FileNotFoundError as e:
        raise SystemExit(f"ab_gemm --ncu: {e}") from None
    returncode, stderr = _common.run_under_ncu(command, csv_path, args.ncu_timeout)
    # The child's own output went into the CSV with ncu's rows: show it here.
    print("".join(line for line in open(csv_path) if not line.startswith('"')), end="")
    if returncode is None:
        raise SystemExit(f"ab_gemm --ncu: the profiled run took over --ncu-timeout "
                         f"{args.ncu_timeout:.0f} s")
    if returncode != 0:
        raise SystemExit(f"ab_gemm --ncu: ncu exited {returncode}; its stderr ends:\n"
                         f"{stderr[-1500:]}")
    path = args.out / f"{stem}.json"
    record = with_kernel_times(json.loads(path.read_text()), _common.ncu_kernel_times(csv_path))
    _common.write_json(path, record)


def with_kernel_times(record: dict, launches: list[tuple[str, float]]) -> dict:
    """`record` (a `run` under ncu) with each call's `median_ms` and `times_ms` the kernel's
    times: the calls launched their kernels in the record's order, one warm-up and `reps` timed
    launches each, so call i owns launches [i·(reps + 1), (i + 1)·(reps + 1))."""
    per_call = record["reps"] + 1
    if len(launches) != per_call * len(record["results"]):
        raise SystemExit(f"ab_gemm --ncu: {len(launches)} GEMM kernel launches profiled, expected "
                         f"{len(record['results'])} calls x (1 warm-up + {record['reps']} reps)")
    results = []
    for i, res in enumerate(record["results"]):
        own = launches[i * per_call:(i + 1) * per_call]
        wrong = {name for name, _ in own if GEMM_KERNELS[res["kind"]] not in name}
        if wrong:
            raise SystemExit(f"ab_gemm --ncu: call {i} ({res['kind']}) launched {sorted(wrong)}, "
                             f"not its {GEMM_KERNELS[res['kind']]}")
        times = [ms for _, ms in own[1:]]
        results.append({**res, "median_ms": float(np.median(times)), "times_ms": times,
                        "wall_times_ms_under_ncu": res["times_ms"]})
    return {**record, "results": results,
            "timing": "ncu gpu__time_duration.sum of the GEMM kernel (--clock-control none), "
                      "the warm-up launch dropped"}


def compare(paths: list[pathlib.Path]) -> str:
    """Per (projection, kind, grouping): each tag's mean median over its runs, in the order the
    tags first appear, and the other tags in % of the first; then the sum over the calls."""
    runs = [json.loads(p.read_text()) for p in sorted(paths)]
    runs.sort(key=lambda r: r["index"])
    tags = list(dict.fromkeys(r["tag"] for r in runs))
    medians: dict[tuple, dict[str, list[float]]] = {}
    for r in runs:
        for res in r["results"]:
            key = (res["proj"], res["kind"], res["grouping"])
            medians.setdefault(key, {}).setdefault(r["tag"], []).append(res["median_ms"])
    head = f"{'projection':10s} {'kind':4s} {'grouping':22s}" + "".join(
        f" {t + ' ms':>10s}" for t in tags) + "".join(f" {t + ' %':>9s}" for t in tags[1:])
    lines, totals = [head], {t: 0.0 for t in tags}
    for key, by_tag in medians.items():
        if set(by_tag) != set(tags):
            continue  # a call some run did not time (failed or cut short)
        mean = {t: float(np.mean(by_tag[t])) for t in tags}
        for t in tags:
            totals[t] += mean[t]
        lines.append(f"{key[0]:10s} {key[1]:4s} {key[2]:22s}" +
                     "".join(f" {mean[t]:10.3f}" for t in tags) +
                     "".join(f" {100 * (mean[t] / mean[tags[0]] - 1):+8.1f}%" for t in tags[1:]))
    lines.append(f"{'sum':38s}" + "".join(f" {totals[t]:10.3f}" for t in tags) +
                 "".join(f" {100 * (totals[t] / totals[tags[0]] - 1):+8.1f}%" for t in tags[1:]))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="time the calls with this process's extension")
    r.add_argument("--tag", required=True, help="the build's name in the comparison")
    r.add_argument("--index", type=int, default=0, help="this run's place in the call order")
    r.add_argument("--kinds", type=lambda s: s.split(","), default=list(KINDS),
                   help=f"comma-separated, of {','.join(KINDS)}")
    r.add_argument("--groupings", type=lambda s: s.split(","), required=True,
                   help="comma-separated bench_gemm labels, e.g. 'R2 maxvio 0.2,R8 maxvio 1'")
    r.add_argument("--orders", type=lambda s: s.split(","), default=["plan"],
                   help=f"comma-separated, of {','.join(ORDERS)}: each grouping's local groups "
                        "in these orders (diagnostic)")
    r.add_argument("--reps", type=int, default=10)
    r.add_argument("--plans", type=pathlib.Path, default=None,
                   help="a bench_gemm record whose plans to use")
    r.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU, XLA stand-ins")
    r.add_argument("--out", type=pathlib.Path, required=True)
    r.add_argument("--ncu", action="store_true",
                   help="time the GEMM kernels under Nsight Compute instead of wall clock")
    r.add_argument("--ncu-timeout", type=float, default=280.0,
                   help="seconds the profiled run may take")
    c = sub.add_parser("compare", help="compare the runs' JSON files")
    c.add_argument("paths", nargs="+", type=pathlib.Path)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command == "run":
        unknown = set(args.kinds) - set(KINDS)
        if unknown:
            parser.error(f"--kinds: {sorted(unknown)} not among {KINDS}")
        unknown = set(args.orders) - set(ORDERS)
        if unknown:
            parser.error(f"--orders: {sorted(unknown)} not among {ORDERS}")
        if args.ncu and args.cpu_smoke:
            parser.error("--ncu profiles the CUDA kernels: not with --cpu-smoke")
        if args.ncu:
            run_profiled(args, argv)
        else:
            run(args)
    else:
        print(compare(args.paths))


if __name__ == "__main__":
    main()
