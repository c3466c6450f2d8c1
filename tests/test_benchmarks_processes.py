"""`bench_dispatch` and `bench_layer --processes 2 --quick` run end to end on CPU (gloo, xla).

The GPU runner runs the same path with N processes on GPUs (one each, or all sharing one under
MPS: `_processes.placement`, tests/test_bench_placement.py); here it must not
first fail on the harness: spawning the ranks, the barriers, the gather at process 0 and the
record, which must hold every rank's times and say what the times are not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_dispatch  # noqa: E402
# Each run starts 3 Python processes and compiles the quick shape (~15 s on 2 cores).
pytestmark = pytest.mark.slow


def _run(name: str, out: Path) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--processes", "2",
                           "--quick", "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not a performance figure" in proc.stdout
    (path,) = out.glob(f"{name}_cpux2_2proc_quick.json")
    return json.loads(path.read_text())


def _check_per_rank(record: dict, ops: int) -> None:
    """Every point holds `ops` results, each timed on both ranks, its median the slowest rank's."""
    assert record["processes"] == 2 and "2 processes" in record["process_layout"]
    assert record["timing_note"]
    assert len(record["points"]) == 2  # maxvio 1 and 20
    for point in record["points"]:
        assert len(point["results"]) == ops
        for result in point["results"]:
            assert result["status"] == "ok"
            assert [r["rank"] for r in result["per_rank"]] == [0, 1]
            for r in result["per_rank"]:
                assert len(r["times_ms"]) == record["reps"] and min(r["times_ms"]) > 0
            assert result["median_ms"] == max(r["median_ms"] for r in result["per_rank"])


def test_bench_dispatch_two_processes_on_cpu(tmp_path):
    record = _run("bench_dispatch", tmp_path)
    _check_per_rank(record, ops=4)
    assert {"all_to_all_pad", "ragged_a2a", "moonep_cuda"} <= set(record["skipped_methods"])
    ceiling = record["copy_ceiling"]
    assert ceiling["bytes_per_pass"] > 0 and len(ceiling["times_ms"]) == record["reps"]
    assert np.isclose(ceiling["gbps"], ceiling["bytes_per_pass"] / ceiling["median_ms"] / 1e6)
    for point in record["points"]:
        assert point["ranks"] == [0, 1]
        for op in ("plan", "dispatch", "combine"):
            moved = point["hbm_bytes"][op]
            assert len(moved["read"]) == len(moved["written"]) == 2
            assert min(moved["read"]) > 0 and min(moved["written"]) > 0
        # prefetch: both projections' experts of the used slots, read and written once each.
        assert len(point["replicas"]) == 2 and sum(point["replicas"]) > 0
        moved, F = point["hbm_bytes"]["prefetch"], record["shape"]["F"]
        expert_bytes = 2 * 3 * record["shape"]["H"] * F
        assert moved["written"] == [n * expert_bytes for n in point["replicas"]]
        assert all(r > w for r, w in zip(moved["read"], moved["written"]))
        # Over the link: every row a rank pulls from another (one per token and remote rank, what
        # its senders count as deduplicated remote rows) with K dst entries and weights; every
        # remote entry's row once for combine as the xla reference runs it (no CUDA op here);
        # every used slot's experts for prefetch.
        R, row_bytes = 2, 2 * record["shape"]["H"]
        K, S = record["shape"]["K"], record["shape"]["S"]
        link = point["link_bytes"]
        assert point["combine_on_owner"] is None
        assert sum(link["dispatch"]) == sum(point["dedup_remote_rows"]) * (row_bytes + 8 * K) > 0
        assert link["combine"] == [n * row_bytes for n in point["remote_rows"]]
        # Had the owners summed combine's first stage: one row per (token, remote rank), fewer
        # than the remote entries (some tokens have two on the other rank), and the peers' dst.
        cfg = bench_dispatch.config(bench_dispatch.Shape(**record["shape"]), R, "xla")
        owners = bench_dispatch.link_bytes(point, cfg, row_bytes, True)["combine"]
        assert sum(owners) == (sum(point["dedup_remote_rows"]) * row_bytes
                               + R * (R - 1) * S * K * 4)
        assert sum(point["dedup_remote_rows"]) < sum(point["remote_rows"])
        assert link["prefetch"] == moved["written"]
        # Every rank's entries are received somewhere; primaries are at most the entries.
        assert sum(map(sum, point["entries_to"])) == sum(point["entries"])
        assert all(p <= e for p, e in zip(point["primary_rows"], point["entries"]))
        # A (token, rank) pair of two or more entries has one primary and a duplicate there.
        for shared, primaries, entries in zip(point["shared_groups_to"], point["primaries_to"],
                                              point["entries_to"]):
            assert all(2 * s <= e and s <= p for s, p, e in zip(shared, primaries, entries))
        for result in point["results"]:
            assert len(result["hbm_gbps_per_rank"]) == 2 and result["hbm_gbps_all_ranks"] > 0
            # Each rank on a CPU device of its own: the floor is the busiest rank's bytes at the
            # copy rate that process 0 measured.
            moved = point["hbm_bytes"][result["op"]]
            busiest = max(r + w for r, w in zip(moved["read"], moved["written"]))
            assert np.isclose(result["hbm_floor_ms"], busiest / (ceiling["gbps"] * 1e6))
            assert np.isclose(result["x_hbm_floor"], result["median_ms"] / result["hbm_floor_ms"])


def test_bench_layer_two_processes_on_cpu(tmp_path):
    """XLA's collectives work between the CPU ranks (gloo): the padded all_to_all baseline runs
    next to moe_ffn, both with the single-process mode's step; MaxText's path fails there (XLA:CPU
    has no ragged-all-to-all), which its results record."""
    record = _run("bench_layer", tmp_path)
    assert record["methods"] == ["moonep_xla", "a2a_pad_gmm", "ragged_a2a_dot"]
    assert set(record["skipped_methods"]) == {"moonep_cuda"}
    assert record["step"].startswith("jax.value_and_grad")
    ragged = [point["results"].pop() for point in record["points"]]
    _check_per_rank(record, ops=2)
    for result in ragged:
        assert result["method"] == "ragged_a2a_dot" and "ragged-all-to-all" in result["status"]
