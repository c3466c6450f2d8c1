"""The one module that loads the CUDA extension and registers its XLA FFI targets.

The extension `_moonep_jax_cuda` (a private top-level module, so that an in-tree checkout on
sys.path never shadows the installed binary) is built by CMake when a CUDA toolkit is present. It
exports `registrations()` (target name -> handler capsule); every target is registered once, for
platform "CUDA", when this module is imported. Without the extension the package runs the xla
implementation only, and `unavailable_reason()` says why.
"""

from __future__ import annotations

import importlib
import types

import jax

_lib: types.ModuleType | None = None
_reason: str | None = None

try:
    _lib = importlib.import_module("_moonep_jax_cuda")
except ImportError as e:  # built without CUDA, or not built at all
    _reason = (f"the CUDA extension _moonep_jax_cuda is not importable ({e}); "
               "install with a CUDA 13 toolkit on PATH to build it")
else:
    for _name, _capsule in _lib.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def available() -> bool:
    """Whether the CUDA extension is built and its targets are registered."""
    return _lib is not None


def unavailable_reason() -> str | None:
    """Why the CUDA extension is unavailable, or None when it is available."""
    return _reason


def lib() -> types.ModuleType:
    """The imported extension module; raises if it is unavailable."""
    if _lib is None:
        raise RuntimeError(_reason)
    return _lib
