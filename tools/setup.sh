#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs moonep_jax with every extra ([dev]), building the
# CUDA extension when nvcc is on PATH. Idempotent: re-running rebuilds the package only.
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
  for candidate in "${PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  # pyenv keeps newer interpreters out of PATH until selected.
  if command -v pyenv >/dev/null 2>&1 || [ -x "$HOME/.pyenv/bin/pyenv" ]; then
    local pyenv_bin; pyenv_bin=$(command -v pyenv || echo "$HOME/.pyenv/bin/pyenv")
    local version; version=$("$pyenv_bin" versions --bare | grep -E '^3\.(1[2-9])' | sort -V | tail -1)
    if [ -n "$version" ]; then echo "$("$pyenv_bin" root)/versions/$version/bin/python3"; return 0; fi
  fi
  echo "moonep_jax needs Python >= 3.12 (python3 is $(python3 --version 2>&1)); set PYTHON=..." >&2
  return 1
}

if [ ! -x .venv/bin/python ]; then
  "$(pick_python)" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# Build requirements go into the venv so the build runs without isolation (one download, and the
# same jax whose FFI headers the extension is compiled against). The CUDA 13 CuTe DSL libraries are
# a build-time dependency only.
.venv/bin/python -m pip install -q -c tools/constraints.txt \
  "scikit-build-core>=0.10" "pybind11>=2.13" cmake ninja "jax>=0.11" "nvidia-cutlass-dsl[cu13]"
.venv/bin/python -m pip install -q -c tools/constraints.txt --no-build-isolation -e ".[dev]"
# cuobjdump + nvdisasm (no GPU needed) let the tests check the SASS of the CuTe DSL GEMM.
if command -v nvcc >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
fi
.venv/bin/python - <<'PY'
from moonep_jax import _ffi
print("moonep_jax installed;", "CUDA extension built" if _ffi.available()
      else f"pure-Python install (xla implementation only): {_ffi.unavailable_reason()}")
PY
