"""benchmarks/_common.py's round-robin timing: the order of the calls and a failing set."""

from __future__ import annotations

import pathlib
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import _common  # noqa: E402


def test_round_robin_times_call_i_of_every_set_before_call_i_plus_1_and_drops_a_failing_set():
    calls = []
    fail_after = np.random.default_rng().integers(1, 4)  # set 2 raises on this call of its own

    def fn(name, x):
        calls.append(name)
        if name == "c" and calls.count("c") > fail_after:
            raise RuntimeError("out of memory")
        return x * 2

    sets = [("a", jnp.ones(3)), ("b", jnp.ones(3)), ("c", jnp.ones(3))]
    results = _common.time_round_robin(fn, sets, reps=5, warmups=1)
    timed_c = fail_after - 1  # its warm-up, then fail_after - 1 timed calls before the failure
    assert calls[:3] == ["a", "b", "c"]  # the warm-ups
    expected = [n for i in range(5) for n in "abc" if n != "c" or i <= timed_c]
    assert calls[3:] == expected
    for r in results[:2]:
        assert r["status"] == "ok" and len(r["times_ms"]) == 5
        assert r["median_ms"] == np.median(r["times_ms"]) and min(r["times_ms"]) > 0
    assert results[2]["status"] == "failed: RuntimeError: out of memory"
    assert "times_ms" not in results[2]
