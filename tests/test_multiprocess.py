"""Several JAX processes (moonep_jax.launch, gloo on CPU) give bitwise the results of one.

2 processes x 4 CPU devices and 1 process x 8 run the same global inputs (skewed lognormal
routing with repeated ids and -1 entries, fresh seeds): plan, dispatch, combine, prefetch,
grouped_matmul, reduce_grad and moe_ffn forward and gradients must be `np.array_equal`.
Shapes are tiny: each launch starts fresh processes and compiles once (CI has 2 cores).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from moonep_jax import launch

from _mp_workloads import Sizes, assemble

WORKLOADS = str(Path(__file__).with_name("_mp_workloads.py"))


def _run(num_processes: int, devices_per_process: int, *args):
    results = launch.run(f"{WORKLOADS}:ep_ops", num_processes, args,
                         cpu_devices=devices_per_process, timeout_s=240)
    return assemble([r.value for r in results])


@pytest.mark.parametrize("maxvio", [10.0])
def test_two_processes_bitwise_equal_to_one(seed, maxvio):
    args = (seed, maxvio, "xla", "cpu", Sizes(S=6, K=3, E=16, H=8, F=8))
    one = _run(1, 8, *args)
    two = _run(2, 4, *args)
    assert one.keys() == two.keys()
    assert {"dst", "recv_x", "combine", "moe_ffn", "d_x", "d_w_gate_up", "reduce_grad"} <= set(one)
    for name in one:
        np.testing.assert_array_equal(two[name], one[name], err_msg=name)
    assert (one["dst"] == np.iinfo(np.int32).min).any(), "the routing must drop entries"


def test_failing_process_stops_the_job_with_its_output():
    with pytest.raises(launch.LaunchError, match="exit codes") as info:
        launch.run("moonep_jax.launch:load_target", 2, ("no_colon",), timeout_s=120)
    assert "target must be" in str(info.value)


@pytest.mark.parametrize("name,value,setting", [
    ("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async", "XLA_PYTHON_CLIENT_ALLOCATOR='cuda_async'"),
    ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform", "XLA_PYTHON_CLIENT_ALLOCATOR='platform'"),
    ("XLA_PYTHON_CLIENT_PREALLOCATE", "false", "XLA_PYTHON_CLIENT_PREALLOCATE=false"),
])
def test_pool_settings_that_cannot_be_mapped_once_are_refused(monkeypatch, name, value, setting):
    from moonep_jax._cuda import transport

    monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match=re.escape(setting)):
        transport.check_pool_settings()


def test_default_pool_settings_pass_and_no_errors_without_transport(monkeypatch):
    import moonep_jax
    from moonep_jax._cuda import transport

    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    transport.check_pool_settings()
    moonep_jax.check_transport_errors()  # nothing bootstrapped here: nothing to report


def test_multiprocess_bootstrap_exchanges_handles_and_takes_peer_descriptors(tmp_path):
    """The bootstrap of an EP group spanning 2 processes x 2 devices, with the extension's CUDA
    steps stood in for: handles travel through the key-value store, each process takes its
    peer's pool descriptor with pidfd_getfd, and registers every rank (local: its ordinal and
    area; remote: the peer's mapped pool and base)."""
    results = launch.run(f"{WORKLOADS}:fake_bootstrap_across_processes", 2,
                         (str(tmp_path), False), cpu_devices=2, timeout_s=120)
    pids = {r.value["process"]: r.value["pid"] for r in results}
    for r in results:
        me, other = r.value["process"], 1 - r.value["process"]
        assert r.value["taken"] == [pids[other]]  # read through the descriptor it took
        (ranks,) = r.value["registered"]
        ids = [rank[0] for rank in ranks]  # device ids in rank order (jax's, per process)
        assert ids == sorted(ids) and len(set(ids)) == 4
        for rank, (device_id, ordinal, area, base, size, mapped) in enumerate(ranks):
            if rank // 2 == me:
                assert ordinal >= 0 and area == 0xA0000 + pids[me] and size == 0
            else:
                assert ordinal == -1 and area == 0xC0000 and mapped == 0xB0000 + pids[other]
                assert size == 1 << 62


def test_multiprocess_bootstrap_refuses_an_ep_group_spanning_hosts(tmp_path):
    results = launch.run(f"{WORKLOADS}:fake_bootstrap_across_processes", 2,
                         (str(tmp_path), True), cpu_devices=2, timeout_s=120)
    for r in results:
        assert "spans several hosts" in r.value["error"]
        assert "('data', 'ep')" in r.value["error"]


def test_gpu_suite_harness_on_cpu(seed):
    """tests/test_multiprocess_gpu.py's workload and checks, with the xla implementation on the
    CPU standing in for the CUDA ops (their harness must not first fail on the GPU runner)."""
    from _mp_workloads import check_suite

    cases = (("train", Sizes(S=8, K=2, E=8, H=8, F=8), True),
             ("infer", Sizes(S=8, K=2, E=8, H=8, F=8, B=1, tp=2), False))
    results = launch.run(f"{WORKLOADS}:gpu_suite", 2, (seed, (0.0, 2.0), cases, 12, "xla", "cpu"),
                         timeout_s=240)
    check_suite([r.value for r in results], "cpu harness", 12)


def test_combine_shapes_harness_on_cpu(seed):
    """tests/test_multiprocess_gpu.py's combine workload and check, xla standing in for CUDA."""
    from _mp_workloads import check_combine_shapes

    cases = ((Sizes(S=8, K=3, E=8, H=13, combine_on_owner=True), "float32"),
             (Sizes(S=8, K=2, E=8, H=7), "bfloat16"))
    results = launch.run(f"{WORKLOADS}:combine_shapes", 2, (seed, cases, "xla", "cpu"),
                         timeout_s=240)
    check_combine_shapes([r.value for r in results], "cpu harness")
    assert len(results[0].value) == 2


def test_plan_loop_harness_on_cpu(seed):
    """tests/test_multiprocess_gpu.py's planner loop and check, with the xla planner on the CPU
    standing in for the CUDA one."""
    from _mp_workloads import check_plan_loop

    shapes = (Sizes(S=40, K=2, E=8), Sizes(S=24, K=3, E=8, B=1, tp=2))
    results = launch.run(f"{WORKLOADS}:plan_back_to_back", 2, (seed, 10, shapes, 2, "xla", "cpu"),
                         timeout_s=240)
    check_plan_loop([r.value for r in results], "cpu harness", 10, 2)
