#!/usr/bin/env bash
# What CI runs for the Bazel build (BUILD.bazel, WORKSPACE, bazel/), offline.
#
#   bash tools/bazel_check.sh           # checks that need no compiler, ~10-30 s
#   bash tools/bazel_check.sh --build   # also builds //:_moonep_jax_cuda and loads it: a cold build
#                                       # compiles every source with nvcc (minutes on 2 cores), a warm
#                                       # one only what changed
#
# Without --build: BUILD.bazel lists what CMakeLists.txt builds (its globs, every header, the CuTe
# DSL kernels, its nvcc flags), and Bazel analyses //:_moonep_jax_cuda, which runs the repository
# rules (the interpreter has jax and pybind11, the toolkit is found) with downloads disabled.
# With --build: the library links, its CUDA runtime is static, and loading it registers every
# target of xla_ffi/targets.inc.
#
# Needs Bazel 4.2 (Debian: apt-get install bazel-bootstrap) and an interpreter with jax, pybind11
# and nvidia-cutlass-dsl: $MOONEP_PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."

build=0
case "${1:-}" in
  "") ;;
  --build) build=1 ;;
  *) echo "usage: bash tools/bazel_check.sh [--build]" >&2; exit 2 ;;
esac

if ! command -v bazel >/dev/null 2>&1; then
  echo "bazel_check: no bazel on PATH; install Bazel 4.2 (Debian: apt-get install bazel-bootstrap)" >&2
  exit 1
fi
if [ -z "${MOONEP_PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then MOONEP_PYTHON="$PWD/.venv/bin/python"; else MOONEP_PYTHON=python3; fi
fi
export MOONEP_PYTHON
echo "bazel_check: $(command -v bazel), MOONEP_PYTHON=$MOONEP_PYTHON"

# Bazel's progress output goes to stderr; keep it only when a step fails.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
run_bazel() {
  if ! bazel "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "bazel_check: FAIL: bazel $*" >&2
    exit 1
  fi
}

"$MOONEP_PYTHON" bazel/check.py files bazel
run_bazel build --nobuild //:_moonep_jax_cuda
echo "ok   bazel analyses //:_moonep_jax_cuda offline"

if [ "$build" = 1 ]; then
  start=$SECONDS
  run_bazel build //:_moonep_jax_cuda
  echo "ok   bazel build //:_moonep_jax_cuda ($((SECONDS - start)) s)"
  library=bazel-bin/_moonep_jax_cuda.so
  if ldd "$library" | grep -q libcudart; then
    echo "FAIL $library links the CUDA runtime dynamically: $(ldd "$library" | grep libcudart)" >&2
    exit 1
  fi
  echo "ok   CUDA runtime linked statically"
  # Link order matters for static archives: a CUDA symbol left undefined would only fail at load.
  undefined_cuda=$(nm -D --undefined-only "$library" | awk '{print $NF}' | grep -E '^_?cu' || true)
  if [ -n "$undefined_cuda" ]; then
    echo "FAIL $library leaves CUDA symbols undefined:" $undefined_cuda >&2
    exit 1
  fi
  echo "ok   no CUDA symbol left undefined"
  "$MOONEP_PYTHON" bazel/check.py module "$library"
fi
echo "bazel_check: all passed"
