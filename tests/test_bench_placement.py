"""Where `--processes N` puts its ranks (benchmarks/_processes.py): process i on GPU i on a host
with N or more GPUs, all N on GPU 0 under MPS on a host with fewer, the CPU without a GPU or the
CUDA extension; and what the ranks' records then say about the layout."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import jax
import pytest

import moonep_jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _processes  # noqa: E402


@pytest.fixture
def host(monkeypatch):
    """Sets what the parent sees: GPUs on the host, whether the extension is built, JAX_PLATFORMS;
    launch.run and launch.mps record their calls instead of starting anything."""
    calls = []
    monkeypatch.setattr(_processes.launch, "run", lambda *args, **kwargs: calls.append(kwargs))

    @contextlib.contextmanager
    def mps():
        calls.append("mps")
        yield {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/test-mps/pipe"}

    monkeypatch.setattr(_processes.launch, "mps", mps)

    def set_host(gpus: int, extension: bool = True, jax_platforms: str | None = None):
        monkeypatch.setattr(_processes.launch, "visible_gpu_count", lambda: gpus)
        monkeypatch.setattr(_processes._ffi, "available", lambda: extension)
        if jax_platforms is None:
            monkeypatch.delenv("JAX_PLATFORMS", raising=False)
        else:
            monkeypatch.setenv("JAX_PLATFORMS", jax_platforms)
        calls.clear()
        return calls

    return set_host


@pytest.mark.parametrize("gpus, n, extension, expected", [
    (0, 2, True, "cpu"), (2, 2, False, "cpu"), (1, 2, True, "one_gpu"), (2, 8, True, "one_gpu"),
    (2, 2, True, "gpu_each"), (8, 8, True, "gpu_each"), (8, 4, True, "gpu_each")])
def test_placement_follows_the_host(host, gpus, n, extension, expected):
    host(gpus, extension)
    assert _processes.placement(n) == expected


def test_jax_platforms_cpu_keeps_the_ranks_off_the_gpus(host):
    host(8, jax_platforms="cpu")
    assert _processes.placement(2) == "cpu"


def test_spawn_gives_each_rank_its_own_gpu_where_there_are_enough(host):
    calls = host(2)
    _processes.spawn(__file__, "entry", 2, None)
    (kwargs,) = calls  # no MPS daemon
    assert kwargs["platform"] == "gpu" and kwargs["local_device_ids"] == [[0], [1]]
    assert kwargs["env"][_processes.PLACEMENT_ENV] == "gpu_each"
    assert kwargs["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{_processes.GPU_MEMORY_SHARE:.4f}"
    assert kwargs["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


def test_spawn_shares_gpu_0_under_mps_where_there_are_too_few(host):
    calls = host(2)
    _processes.spawn(__file__, "entry", 4, None)
    assert calls[0] == "mps"
    kwargs = calls[1]
    assert kwargs["platform"] == "gpu" and "local_device_ids" not in kwargs
    env = kwargs["env"]
    assert env[_processes.PLACEMENT_ENV] == "one_gpu"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/test-mps/pipe"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{_processes.GPU_MEMORY_SHARE / 4:.4f}"


def test_spawn_on_cpu(host):
    calls = host(0)
    _processes.spawn(__file__, "entry", 2, None)
    (kwargs,) = calls
    assert "platform" not in kwargs  # launch.run's default, the CPU backend
    assert kwargs["env"] == {_processes.PLACEMENT_ENV: "cpu"}


@pytest.mark.parametrize("where, gpus, name, note, layout", [
    ("one_gpu", 1, "bench_x_cpux1_2proc_mps_quick", _processes.NOT_NVLINK,
     "2 processes sharing one GPU under MPS"),
    ("gpu_each", 2, "bench_x_cpux2_2proc_quick", _processes.ONE_GPU_EACH,
     "2 processes, one GPU each"),
    ("cpu", 0, "bench_x_cpux2_2proc_quick", _processes.CPU_ONLY, "2 processes on the CPU")])
def test_the_ranks_records_name_the_layout(monkeypatch, where, gpus, name, note, layout):
    monkeypatch.setenv(_processes.PLACEMENT_ENV, where)
    record = _processes.provenance(2)
    assert record["physical_gpus"] == gpus and record["timing_note"] == note
    assert record["process_layout"].startswith(layout)
    assert _processes.stem("bench_x", 2, quick=True) == name  # on CPU: the cpu device tag


def test_a_rank_without_the_parents_placement_fails_clearly(monkeypatch):
    monkeypatch.delenv(_processes.PLACEMENT_ENV, raising=False)
    with pytest.raises(RuntimeError, match=_processes.PLACEMENT_ENV):
        _processes.my_placement()


def _layer_methods(monkeypatch, where: str, skip: list[str]):
    import bench_layer

    monkeypatch.setenv(_processes.PLACEMENT_ENV, where)
    mesh = jax.make_mesh((2,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:2])
    cfg = moonep_jax.EPConfig(num_experts=8, top_k=2, tokens_per_rank=16, hidden=32,
                              ffn_hidden=16, num_ranks=2, implementation="xla")
    return bench_layer, *bench_layer.process_methods(cfg, mesh, skip)


@pytest.mark.parametrize("where", ["gpu_each", "cpu"])
def test_bench_layer_ranks_time_the_baselines_where_xlas_collectives_work(monkeypatch, where):
    bench_layer, methods, skipped = _layer_methods(monkeypatch, where, [])
    assert list(methods) == ["moonep_xla", "a2a_pad_gmm", "ragged_a2a_dot"]  # ragged last
    assert [reps for _, reps in methods.values()] == [None, None, 1]
    assert skipped == {"moonep_cuda": "needs the CUDA extension and a GPU"}
    _, methods, skipped = _layer_methods(monkeypatch, where, ["ragged_a2a_dot"])
    assert list(methods) == ["moonep_xla", "a2a_pad_gmm"]
    assert skipped["ragged_a2a_dot"].startswith("skipped on request (--skip)")


def test_bench_layer_ranks_sharing_a_gpu_time_moe_ffn_alone(monkeypatch):
    _, methods, skipped = _layer_methods(monkeypatch, "one_gpu", [])
    assert list(methods) == ["moonep_xla"]
    assert skipped["a2a_pad_gmm"] == skipped["ragged_a2a_dot"] == _processes.NCCL_REFUSES


@pytest.mark.parametrize("gpus, skip, baselines", [
    (1, [], ()), (2, [], ("a2a_pad_gmm", "ragged_a2a_dot")),
    (2, ["--skip", "ragged_a2a_dot"], ("a2a_pad_gmm",))])
def test_bench_layer_job_bound_grows_with_the_baselines_it_runs(host, monkeypatch, gpus, skip,
                                                                baselines):
    import bench_layer

    calls = host(gpus)
    monkeypatch.setattr(sys, "argv", ["bench_layer.py", "--processes", "2", *skip])
    bench_layer.main()
    assert calls[-1]["timeout_s"] == _processes.JOB_TIMEOUT_S + sum(
        bench_layer.METHOD_BUDGET_S[name] for name in baselines)
