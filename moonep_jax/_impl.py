"""Choosing the implementation behind the public ops (tokamax-style `implementation=` switch)."""

from __future__ import annotations

import functools
import warnings

import jax

from moonep_jax import _ffi
from moonep_jax.config import EPConfig


def resolved_implementation(cfg: EPConfig) -> str:
    """The implementation the ops run for `cfg`: "cuda" or "xla".

    "auto" picks "cuda" when the CUDA extension is built and JAX's default backend is a GPU, and
    "xla" otherwise. It never falls back after a kernel error. "cuda" without the extension or
    without a GPU raises, naming the reason.
    """
    if cfg.implementation == "xla":
        return "xla"
    on_gpu = jax.default_backend() == "gpu"
    if cfg.implementation == "auto":
        if on_gpu and not _ffi.available():
            _warn_gpu_without_extension()
        return "cuda" if (on_gpu and _ffi.available()) else "xla"
    if not _ffi.available():
        raise RuntimeError(
            "`EPConfig.implementation='cuda'` needs the CUDA extension: "
            f"{_ffi.unavailable_reason()}")
    if not on_gpu:
        raise RuntimeError(
            "`EPConfig.implementation='cuda'` needs a GPU backend; "
            f"jax.default_backend() is {jax.default_backend()!r}.")
    return "cuda"


@functools.cache
def _warn_gpu_without_extension() -> None:
    warnings.warn(
        "moonep_jax: running implementation='xla' on a GPU because the CUDA extension is "
        f"unavailable: {_ffi.unavailable_reason()}", RuntimeWarning, stacklevel=3)
