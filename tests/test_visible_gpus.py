"""`launch.visible_gpu_count`: what the launcher, the demo and the benchmarks' placement believe
the host offers, read without touching CUDA: nvidia-smi's list (device nodes where it is
missing), narrowed by CUDA_VISIBLE_DEVICES the way CUDA reads it."""

from __future__ import annotations

import random

import pytest

from moonep_jax import launch


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """A fake nvidia-smi on PATH listing `n` GPUs (or exiting with `code`)."""

    def install(n: int, code: int = 0):
        script = tmp_path / "nvidia-smi"
        lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i:04x})'\n" for i in range(n))
        script.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] || exit 2\n{lines}exit {code}\n")
        script.chmod(0o755)
        monkeypatch.setenv("PATH", str(tmp_path))
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    return install


def test_counts_the_gpus_nvidia_smi_lists(smi):
    n = random.randint(1, 8)
    smi(n)
    assert launch.visible_gpu_count() == n


@pytest.mark.parametrize("visible, expected", [
    ("0,1", 2), ("1", 1), ("1, 0", 2), ("0,7", 1), ("7,0", 0), ("-1", 0), ("", 0), ("0,-1,1", 1),
    ("GPU-0001,0", 2), ("MIG-abc", 1)])
def test_cuda_visible_devices_narrows_it_as_cuda_does(smi, monkeypatch, visible, expected):
    smi(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert launch.visible_gpu_count() == expected


def test_an_nvidia_smi_that_fails_means_no_gpu(smi):
    smi(4, code=9)
    assert launch.visible_gpu_count() == 0


def test_without_nvidia_smi_the_device_nodes_count(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nodes = ["nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia-caps", "null"]
    monkeypatch.setattr(launch.os, "listdir", lambda path: nodes if path == "/dev" else [])
    assert launch.visible_gpu_count() == 3
