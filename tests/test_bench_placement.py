"""Where `--processes N` puts its ranks (benchmarks/_processes.py): process i on GPU i on a host
with N or more GPUs, all N on GPU 0 under MPS on a host with fewer, the CPU without a GPU or the
CUDA extension; and what the ranks' records then say about the layout."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

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
