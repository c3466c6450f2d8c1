"""bench_layer's dense floor, compiled, runs all six GEMMs of a SwiGLU expert's forward and
backward: it times `jax.value_and_grad`, and under `jax.grad` of its linear loss XLA drops the
forward down projection (five GEMMs), which once made the recorded ratios compare the layer's six
GEMMs against five."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_layer  # noqa: E402


def _dots(fn, args) -> int:
    return fn.lower(*args).compile().as_text().count(" dot(")


def test_dense_floor_step_keeps_the_forward_down_projection():
    step, forward, args = bench_layer.dense_floor(bench_layer.Shape(S=16, H=32, K=2, E=4, F=16))
    assert _dots(step, args) == 6
    assert _dots(forward, args) == 2
