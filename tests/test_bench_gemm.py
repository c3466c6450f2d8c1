"""`bench_gemm --cpu-smoke` runs end to end on CPU: the grouped GEMM's three calls (XLA
stand-ins with the extension's signatures) on every grouping of both projections, next to the
dense references, so that a rename in the extension cannot leave the GPU benchmark broken."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
pytestmark = pytest.mark.slow  # plans every grouping and compiles ~40 tiny GEMMs (~40 s)


def test_bench_gemm_cpu_smoke_times_every_call(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_gemm.py"), "--cpu-smoke",
                           "--no-mgpu", "--out", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("bench_gemm_cpux*_cpusmoke.json")
    record = json.loads(path.read_text())
    timed = {r["name"] for r in record["records"] if r.get("median_ms", 0) > 0}
    for proj in ("gate_up", "down"):
        for call in ("dense_fwd", "dense_dx", "dense_dw_bf16", "moonep_fwd", "moonep_dx",
                     "moonep_dw"):
            assert f"{proj}/{call}" in timed
        assert any(key.startswith(f"{proj}/R") for key in record["dw"])
        # The dense references are timed on both sides of the projection's grouped GEMMs, and
        # every % of dense is against the median over both timings.
        for kind in ("fwd", "dx", "dw_bf16", "dw_fp32"):
            phases = [r["phase"] for r in record["records"] if r["name"] == f"{proj}/dense_{kind}"]
            assert sorted(phases) == ["after", "before"], (proj, kind, phases)
            times = [t for r in record["records"] if r["name"] == f"{proj}/dense_{kind}"
                     for t in r["times_ms"]]
            rate = record["dense_tflops"][f"{proj}/{kind}"]
            assert rate == pytest.approx(
                2.0 * record["M_per_rank"] * _dims(record, proj) / np.median(times) * 1e-9)
        for r in record["records"]:
            if r["name"].startswith(f"{proj}/moonep_"):
                ref = r["dense_reference"].replace("/dense_", "/")
                assert r["pct_of_dense"] == pytest.approx(100 * r["tflops"]
                                                          / record["dense_tflops"][ref])
                # ... and against its dense reference timed in turn with it, call by call.
                assert len(r["dense_interleaved_times_ms"]) == len(r["times_ms"]) == record["reps"]
                assert r["dense_interleaved_ms"] == np.median(r["dense_interleaved_times_ms"])
                assert r["pct_of_dense_interleaved"] == pytest.approx(
                    100 * r["dense_interleaved_ms"] / r["median_ms"])


def _dims(record, proj):
    """D0 * D1 of a projection."""
    h, f = record["H"], record["F"]
    return h * 2 * f if proj == "gate_up" else f * h
