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
