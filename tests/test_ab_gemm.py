"""benchmarks/ab_gemm.py: `run --cpu-smoke` times the chosen calls (XLA stand-ins on CPU) and
`compare` averages each tag's runs and puts the other tag in % of the first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
pytestmark = pytest.mark.slow  # plans two groupings in a CPU subprocess and compiles tiny GEMMs


def test_run_times_the_chosen_calls_and_compare_lines_up_the_tags(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for index, tag in enumerate(("new", "base")):
        proc = subprocess.run([sys.executable, str(BENCHMARKS / "ab_gemm.py"), "run", "--cpu-smoke",
                               "--tag", tag, "--index", str(index), "--kinds", "fwd,dw",
                               "--groupings", "R2 maxvio 20", "--reps", "2", "--out",
                               str(tmp_path)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("ab_gemm_*.json")}
    assert set(runs) == {"ab_gemm_new_0.json", "ab_gemm_base_1.json"}
    for run in runs.values():
        calls = {(r["proj"], r["kind"], r["grouping"]) for r in run["results"]}
        assert calls == {(p, k, "R2 maxvio 20") for p in ("gate_up", "down") for k in ("fwd", "dw")}
        assert all(len(r["times_ms"]) == 2 and r["median_ms"] > 0 for r in run["results"])

    import ab_gemm

    # A second "new" run: compare averages a tag's runs.
    extra = dict(runs["ab_gemm_new_0.json"], index=2)
    extra["results"] = [dict(r, median_ms=3 * r["median_ms"]) for r in extra["results"]]
    (tmp_path / "ab_gemm_new_2.json").write_text(json.dumps(extra))
    table = ab_gemm.compare(sorted(tmp_path.glob("ab_gemm_*.json"))).splitlines()
    assert table[0].split()[-3:] == ["ms", "base", "%"] and "new ms" in table[0]
    new = {(r["proj"], r["kind"]): 2 * r["median_ms"] for r in runs["ab_gemm_new_0.json"]["results"]}
    base = {(r["proj"], r["kind"]): r["median_ms"] for r in runs["ab_gemm_base_1.json"]["results"]}
    for line in table[1:-1]:
        proj, kind = line.split()[:2]
        fields = line.split()
        assert float(fields[-3]) == pytest.approx(new[proj, kind], abs=1e-3)
        assert float(fields[-2]) == pytest.approx(base[proj, kind], abs=1e-3)
        assert float(fields[-1].rstrip("%")) == pytest.approx(
            100 * (base[proj, kind] / new[proj, kind] - 1), abs=0.06)
    assert table[-1].startswith("sum") and len(table) == 6


def test_gpu_sh_ab_variants_times_new_and_each_variant_both_ways(tmp_path):
    """`tools/gpu.sh ab-variants ARGS` (here with ab_gemm's --cpu-smoke) runs .gpu as "new" and
    every .gpu_variants/NAME, in that order and then reversed, packs the runs into ab_runs.tgz
    and logs their comparison with each variant's build (its COMMIT) named."""
    root = tmp_path / "tree"
    shutil.copytree(BENCHMARKS, root / "benchmarks", ignore=shutil.ignore_patterns("results"))
    shutil.copytree(BENCHMARKS.parent / "tools", root / "tools")
    for build, commit in ((".gpu", "abc"), (".gpu_variants/lag2", "abc overrides DW_LAG_K_TILES=2")):
        (root / build).mkdir(parents=True)
        (root / build / "COMMIT").write_text(commit + "\n")
    out = tmp_path / "out"
    env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(out),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(root / "tools" / "gpu.sh"), "ab-variants", "--cpu-smoke",
                           "--kinds", "fwd", "--groupings", "R2 maxvio 20", "--reps", "1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["ab.log", "ab_runs.tgz"]
    with tarfile.open(out / "ab_runs.tgz") as tar:
        runs = [json.load(tar.extractfile(m)) for m in tar.getmembers() if m.name.endswith(".json")]
    assert [r["tag"] for r in sorted(runs, key=lambda r: r["index"])] == ["new", "lag2", "lag2",
                                                                           "new"]
    log = (out / "ab.log").read_text()
    assert "lag2: abc overrides DW_LAG_K_TILES=2" in log
    assert any(line.startswith("sum") and line.rstrip().endswith("%") for line in log.splitlines())


def _ncu_csv(path: Path, launches: list[tuple[str, float]], child_lines: list[str]) -> None:
    """An ncu `--csv --metrics gpu__time_duration.sum` stdout: the profiled process's own lines
    among ncu's rows, times in ns."""
    header = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
              "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name",
              "Metric Unit", "Metric Value"]
    lines = ["==PROF== Connected to process 1 (python3)", *child_lines[:1],
             ",".join(f'"{c}"' for c in header)]
    for i, (name, ms) in enumerate(launches):
        row = [str(i), "1", "python3", "127.0.0.1", name, "1", "7", "(384, 1, 1)", "(132, 1, 1)",
               "0", "9.0", "Command line profiler metrics", "gpu__time_duration.sum", "ns",
               f"{ms * 1e6:,.0f}"]
        lines.append(",".join(f'"{c}"' for c in row))
    path.write_text("\n".join(lines + child_lines[1:]) + "\n")


def test_ncu_kernel_times_map_to_the_calls_in_order_without_the_warm_up(tmp_path):
    import ab_gemm
    import _common

    rng = np.random.default_rng()
    reps = 3
    calls = [("gate_up", "fwd"), ("gate_up", "dw"), ("down", "dx")]
    times = rng.uniform(0.1, 2.0, (len(calls), reps + 1)).round(6)
    launches = [(f"kernel_cutlass_GroupedGemm_{ab_gemm.GEMM_KERNELS[kind]}_0", float(ms))
                for (_, kind), row in zip(calls, times) for ms in row]
    csv_path = tmp_path / "run_ncu.csv"
    _ncu_csv(csv_path, launches, ["new gate_up fwd R2 maxvio 1  9.9 ms", "done"])
    parsed = _common.ncu_kernel_times(csv_path)
    assert [n for n, _ in parsed] == [n for n, _ in launches]
    np.testing.assert_allclose([ms for _, ms in parsed], times.ravel(), rtol=0, atol=1e-9)

    wall = rng.uniform(5, 9, (len(calls), reps)).tolist()
    record = {"reps": reps, "results": [
        {"proj": p, "kind": k, "grouping": "R2 maxvio 1", "median_ms": float(np.median(w)),
         "times_ms": w} for (p, k), w in zip(calls, wall)]}
    timed = ab_gemm.with_kernel_times(record, parsed)
    for res, row, w in zip(timed["results"], times, wall):
        np.testing.assert_allclose(res["times_ms"], row[1:], rtol=0, atol=1e-9)
        assert res["median_ms"] == pytest.approx(np.median(row[1:]), abs=1e-9)
        assert res["wall_times_ms_under_ncu"] == w
    assert "ncu" in timed["timing"]

    with pytest.raises(SystemExit, match="expected 3 calls x"):
        ab_gemm.with_kernel_times(record, parsed[:-1])
    swapped = parsed[reps + 1:2 * (reps + 1)] + parsed[:reps + 1] + parsed[2 * (reps + 1):]
    with pytest.raises(SystemExit, match=r"call 0 \(fwd\) launched"):
        ab_gemm.with_kernel_times(record, swapped)


@pytest.mark.parametrize("order", ["interleave", "small_first", "small_last"])
def test_orders_permute_the_local_groups_and_place_the_small_ones(order):
    """`--orders`: the same sizes, only the local groups' permuted (slots and other ranks'
    groups in place); small groups (at most one chunk of rows) keep their order among
    themselves, as do the others, and sit first, last, or spread between the others' tiles."""
    import ab_gemm

    rng = np.random.default_rng()
    epn, rank, tile_m, chunk_m = 40, 1, 384, 128
    sizes = np.zeros(2 * epn + epn, np.int64)
    local = np.where(rng.random(epn) < 0.5, rng.integers(1, chunk_m + 1, epn),
                     rng.integers(chunk_m + 1, 4 * tile_m, epn))
    local[rng.choice(epn, 3, replace=False)] = 0
    sizes[rank * epn:(rank + 1) * epn] = local
    sizes[2 * epn + 5] = 77
    g = {"label": "R2 maxvio 20", "sizes": sizes, "rank": rank, "epn": epn}
    out = ab_gemm.reordered(g, order, tile_m, chunk_m)
    assert out["label"] == f"R2 maxvio 20 [{order}]"
    moved = out["sizes"][rank * epn:(rank + 1) * epn]
    np.testing.assert_array_equal(np.delete(out["sizes"], np.s_[rank * epn:(rank + 1) * epn]),
                                  np.delete(sizes, np.s_[rank * epn:(rank + 1) * epn]))
    is_small = lambda v: 0 < v <= chunk_m  # noqa: E731
    assert sorted(moved) == sorted(local)
    for cls in (is_small, lambda v: v > chunk_m):
        assert [v for v in moved if cls(v)] == [v for v in local if cls(v)]
    kinds = "".join("s" if is_small(v) else "L" for v in moved if v)
    small, large = kinds.count("s"), kinds.count("L")
    if order == "small_first":
        assert kinds == "s" * small + "L" * large
    elif order == "small_last":
        assert kinds == "L" * large + "s" * small
    else:  # between the large groups' tiles: each gap holds the small groups its tiles call for
        tiles = [-(-v // tile_m) for v in moved if v > chunk_m]
        gaps = [len(run) for run in kinds.split("L")]
        assert sum(gaps) == small and len(gaps) == large + 1 and gaps[-1] == 0
        ends = np.cumsum(tiles)
        for i, gap in enumerate(gaps[:-1]):
            lo, hi = (ends[i - 1] if i else 0), ends[i]
            expect = sum(lo <= (k + 0.5) / small * ends[-1] < hi for k in range(small))
            assert gap == expect
