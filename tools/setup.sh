#!/usr/bin/env bash
# Creates .venv with Python 3.12 (failing that, >= 3.12) and installs moonep_jax with every extra
# ([dev]), building the CUDA extension when nvcc is on PATH. Idempotent: re-running rebuilds the
# package only. `--which-python` prints the interpreter a fresh setup would use, and exits.
set -euo pipefail
cd "$(dirname "$0")/.."

# The GPU machine runs Python 3.12, and `tools/gpu.sh build` compiles the extension for the venv's
# interpreter, so 3.12 comes first: $PYTHON, python3.12 on PATH, pyenv's newest 3.12.x, and only
# then any other Python >= 3.12 (with a warning: the GPU runner cannot use that venv).
is_version() {  # is_version PYTHON EXPR: EXPR on sys.version_info holds
  "$1" -c "import sys; v = sys.version_info; sys.exit(not ($2))" 2>/dev/null
}

pyenv_python() {  # pyenv_python REGEX: newest pyenv interpreter whose version matches
  local pyenv_bin
  pyenv_bin=$(command -v pyenv) || pyenv_bin=$HOME/.pyenv/bin/pyenv
  [ -x "$pyenv_bin" ] || return 1
  local version; version=$("$pyenv_bin" versions --bare | grep -E "$1" | sort -V | tail -1)
  [ -n "$version" ] && echo "$("$pyenv_bin" root)/versions/$version/bin/python3"
}

pick_python() {
  local candidate
  local pyenv_3_12 pyenv_newer
  pyenv_3_12=$(pyenv_python '^3\.12(\.[0-9]+)?$' || true)
  pyenv_newer=$(pyenv_python '^3\.(1[3-9])(\.[0-9]+)?$' || true)
  for candidate in "${PYTHON:-}" python3.12 "$pyenv_3_12" python3; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
    if is_version "$candidate" "v[:2] == (3, 12)"; then echo "$candidate"; return 0; fi
  done
  for candidate in "${PYTHON:-}" python3.13 "$pyenv_newer" python3; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
    if is_version "$candidate" "v >= (3, 12)"; then
      echo "warning: no Python 3.12 found; using $candidate ($("$candidate" --version 2>&1))." \
        "The package works, but tools/gpu.sh build needs 3.12 (the GPU machine's Python)." >&2
      echo "$candidate"; return 0
    fi
  done
  echo "moonep_jax needs Python >= 3.12, preferably 3.12 (python3 is $(python3 --version 2>&1));" \
    "set PYTHON=..." >&2
  return 1
}

if [ "${1:-}" = "--which-python" ]; then pick_python; exit; fi  # what a fresh setup would use

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
