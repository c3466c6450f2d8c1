"""bench_dispatch times `--iters` calls of an op unrolled in one program: an XLA while loop would
add a host round trip per call to what it measures."""

import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_dispatch  # noqa: E402


def test_looped_calls_are_unrolled_and_chained(seed):
    mesh = jax.make_mesh((1,), ("ep",))
    rng = np.random.default_rng(seed)
    sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec("ep"))
    x = jax.device_put(rng.standard_normal((1, 8)).astype(np.float32), sharding)
    scale = jax.device_put(rng.uniform(0.5, 1.5, (1, 8)).astype(np.float32), sharding)
    loop = bench_dispatch.looped(lambda c, s: c * s + 1.0, mesh, 3)
    hlo = loop.lower(x, scale).as_text()
    assert "while" not in hlo
    expected = ((np.asarray(x) * np.asarray(scale) + 1) * np.asarray(scale) + 1) * np.asarray(
        scale) + 1
    np.testing.assert_allclose(np.asarray(loop(x, scale)), expected, rtol=1e-6)


def test_copy_passes_are_separate_kernels(seed):
    """The copy ceiling's passes each read and write the whole buffer: none folded into another
    (a fused chain of adds would read and write it once) and none dropped."""
    iters = 4
    buffer = np.random.default_rng(seed).integers(0, 2**32 - iters, 1000, dtype=np.uint32)
    passes = bench_dispatch.copy_passes(iters)
    compiled = passes.lower(buffer).compile().as_text()
    assert "while" not in compiled
    assert compiled.count(" add(") == iters
    np.testing.assert_array_equal(np.asarray(passes(buffer)), buffer + iters)


def test_hbm_floor_sums_the_ranks_of_one_gpu(seed):
    rng = np.random.default_rng(seed)
    read, written = rng.integers(1, 10**9, 4), rng.integers(1, 10**9, 4)
    moved = {"read": read.tolist(), "written": written.tolist()}
    ceiling_gbps, t_ms = float(rng.uniform(1e3, 5e3)), float(rng.uniform(0.1, 2.0))
    each = bench_dispatch.hbm_floor(moved, t_ms, ceiling_gbps, 1)
    assert each["hbm_floor_ms"] == (read + written).max() / (ceiling_gbps * 1e9) * 1e3
    shared = bench_dispatch.hbm_floor(moved, t_ms, ceiling_gbps, 4)
    assert np.isclose(shared["hbm_floor_ms"], (read + written).sum() / (ceiling_gbps * 1e6))
    pairs = bench_dispatch.hbm_floor(moved, t_ms, ceiling_gbps, 2)
    busiest = max((read + written)[:2].sum(), (read + written)[2:].sum())
    assert np.isclose(pairs["hbm_floor_ms"], busiest / (ceiling_gbps * 1e6))
    assert shared["x_hbm_floor"] == t_ms / shared["hbm_floor_ms"]
