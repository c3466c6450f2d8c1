"""Test setup: 8 simulated CPU devices, strict numerics, GPU tests that skip cleanly on CPU."""

import os
import zlib

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (must follow the XLA_FLAGS line)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from moonep_jax import _ffi  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")


def _gpu_skip_reason() -> str | None:
    if not _ffi.available():
        return f"CUDA extension unavailable: {_ffi.unavailable_reason()}"
    if jax.default_backend() != "gpu":
        return f"no GPU backend (jax.default_backend() is {jax.default_backend()!r})"
    return None


def _multiprocess_gpu_skip_reason() -> str | None:
    """Tests that spawn GPU processes run from a test process that leaves the GPU to them."""
    if not _ffi.available():
        return f"CUDA extension unavailable: {_ffi.unavailable_reason()}"
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        return ("spawns GPU processes: run with JAX_PLATFORMS=cpu so that this process keeps off "
                "the GPU (tools/gpu.sh run does)")
    if not any(os.path.exists(f"/dev/nvidia{i}") for i in range(16)):
        return "no NVIDIA GPU (/dev/nvidia*)"
    return None


def pytest_collection_modifyitems(config, items):
    reasons = {"gpu": _gpu_skip_reason(), "multiprocess_gpu": _multiprocess_gpu_skip_reason()}
    for item in items:
        kind = "multiprocess_gpu" if "multiprocess_gpu" in item.keywords else "gpu"
        if kind in item.keywords and reasons[kind] is not None:
            item.add_marker(pytest.mark.skip(reason=reasons[kind]))


def mesh_devices():
    """The devices meshes are built from: the GPUs when the backend is a GPU, else the CPUs."""
    return jax.devices()


@pytest.fixture(autouse=True)
def _transport_errors_checked(request):
    """After every GPU test: no kernel left an error in a transport area's record."""
    yield
    if "gpu" in request.keywords and _gpu_skip_reason() is None:
        import moonep_jax

        moonep_jax.check_transport_errors()


@pytest.fixture
def mesh_factory():
    """`mesh_factory(R)` -> 1-D ("ep",) mesh over the first R devices; skips if there are fewer.

    `mesh_factory((2, 4), ("data", "ep"))` builds a 2-D mesh the same way.
    """

    def make(shape, axis_names=("ep",)):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        devices = mesh_devices()
        size = int(np.prod(shape))
        if size > len(devices):
            pytest.skip(f"needs {size} devices, have {len(devices)}")
        return jax.sharding.Mesh(np.array(devices[:size]).reshape(shape), axis_names)

    return make


@pytest.fixture
def seed(request):
    """A seed derived from the test id: fresh per test, reproducible across runs."""
    return zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF
