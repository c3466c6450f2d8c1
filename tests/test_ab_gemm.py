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
