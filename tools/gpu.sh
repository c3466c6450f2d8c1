#!/usr/bin/env bash
# The GPU runner, in two halves of one script.
#
#   bash tools/gpu.sh build            # here, on the CPU machine: compile the extension into .gpu/
#   bash tools/gpu.sh run [BENCH ...]  # there, through the device tool with carry [".gpu"]:
#                                      # every @pytest.mark.gpu test (the multi-process ones in a
#                                      # second pytest run that stays off the GPU itself), then the
#                                      # named benchmarks
#   bash tools/gpu.sh build-base REV   # here: the extension of commit REV into .gpu_base/
#   bash tools/gpu.sh ab ARGS          # there, carry [".gpu", ".gpu_base"]: benchmarks/ab_gemm.py
#                                      # run ARGS with .gpu ("new") and .gpu_base ("base") in the
#                                      # process order new base base new, then their comparison
#   bash tools/gpu.sh build-variant NAME NAME=VALUE ...
#                                      # here: this tree's extension with those integer constants
#                                      # of the CuTe DSL kernels overridden (build_aot.py
#                                      # --override) into .gpu_variants/NAME/, for a tuning sweep
#   bash tools/gpu.sh ab-variants ARGS # there, carry [".gpu", ".gpu_variants"]: ab_gemm.py run
#                                      # ARGS with .gpu ("new") and every variant, in that order
#                                      # and then reversed, then their comparison
#                                      # (ab and ab-variants: ARGS with --ncu time the GEMM
#                                      # kernels under ncu instead of the wall clock)
#
# `run` writes under $OUT (the device tool's folder that comes back, at most 8 files):
# gpu_tests.log (environment + pytest), benchmarks.log, and each benchmark's JSON record (+ PNG)
# (benchmarks/<name>.py --out $OUT).
# GPU_TEST_ARGS / GPU_MP_TEST_ARGS narrow the single- / multi-process test runs (setting only
# GPU_TEST_ARGS skips the multi-process run); they are split on spaces, so a pytest -k expression
# goes in GPU_TEST_K instead, passed whole to both runs (a quoted `-k 'a or b'` in GPU_TEST_ARGS
# reached pytest as four words and selected nothing).
# BENCH names are benchmark scripts without .py (bench_dispatch, bench_gemm, bench_layer) and may
# carry arguments after a colon: bench_dispatch:--quick. GPU_STOP_ON_FAIL=1 skips the benchmarks
# when a test failed (a kernel under test that hangs would otherwise hang every benchmark too).
# GPU_SKIP_TESTS=1 runs the benchmarks alone (the device tool allows 10 minutes a command: the
# tests and all benchmarks do not fit in one); GPU_BENCH_TIMEOUT (300 s) bounds each benchmark.
# Quote a BENCH spec with several arguments: 'bench_layer:--one-gpu --ncu'; on one GPU,
# 'bench_dispatch:--processes 2' 'bench_layer:--processes 2' run one EP rank per process
# (2 processes sharing the GPU under MPS, started by the benchmark).
set -uo pipefail
cd "$(dirname "$0")/.."

# The GPU machine's Python: the extension is built for it (its ABI tag), whatever runs here.
GPU_PYTHON_VERSION=3.12

# build_tree SRC DEST [OVERRIDES]: the extension of the source tree SRC (its CMake build in
# SRC/build/gpu) into DEST/, with DEST/COMMIT; OVERRIDES ("NAME=VALUE;...", build_aot.py
# --override) makes a tuning variant, and every other build resets them.
build_tree() {
  set -e
  local src=$1 dest=$2 overrides=${3:-}
  local py=${PYTHON:-}
  if [ -z "$py" ]; then py=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 ); fi
  local version; version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ "$version" != "$GPU_PYTHON_VERSION" ]; then
    echo "tools/gpu.sh build: the GPU machine runs Python $GPU_PYTHON_VERSION, so the extension" \
      "must be built with Python $GPU_PYTHON_VERSION; $py is Python $version. Recreate .venv" \
      "with it (rm -rf .venv && bash tools/setup.sh picks 3.12) or set PYTHON=python3.12." >&2
    return 1
  fi
  # The cmake and ninja that tools/setup.sh installs into the venv, next to its python: a system
  # cmake may be older than CMakeLists.txt's minimum.
  # Absolute paths: cmake runs its checks in other directories.
  local bin; bin=$(cd "$(dirname "$(command -v "$py")")" && pwd)
  local python=$bin/$(basename "$(command -v "$py")") cmake=$bin/cmake ninja=$bin/ninja
  [ -x "$cmake" ] || cmake=$(command -v cmake)
  [ -x "$ninja" ] || ninja=$(command -v ninja)
  local need have
  need=$(sed -n 's/^cmake_minimum_required(VERSION \([0-9.]*\)).*/\1/p' "$src/CMakeLists.txt")
  have=$("$cmake" --version | head -1 | awk '{print $3}')
  if [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
    echo "tools/gpu.sh build: $cmake is cmake $have; CMakeLists.txt needs >= $need" \
      "(bash tools/setup.sh installs one into .venv)." >&2
    return 1
  fi
  "$cmake" -S "$src" -B "$src/build/gpu" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_MAKE_PROGRAM="$ninja" -DPython_EXECUTABLE="$python" \
    -Dpybind11_DIR="$("$python" -m pybind11 --cmakedir)" \
    -DMOONEP_CUTEDSL_OVERRIDES="$overrides"
  "$cmake" --build "$src/build/gpu"
  rm -rf "$dest" && mkdir -p "$dest"
  cp "$src"/build/gpu/_moonep_jax_cuda*.so "$dest/"
  # The device machine gets no git history: record which commit (and whether the tree was dirty)
  # the binary and the sources that travel with it come from.
  echo "$(git -C "$src" rev-parse HEAD)$(git -C "$src" diff --quiet HEAD -- . ':!benchmarks/results' || echo -dirty)${overrides:+ overrides $overrides}" > "$dest/COMMIT"
}

build() {
  build_tree . .gpu
  echo "built $(ls .gpu); pass carry [\".gpu\"] and run: bash tools/gpu.sh run"
}

# build-base REV: commit REV checked out in build/base_src (a git worktree), built into
# .gpu_base/ for `ab`, with REV's moonep_jax package beside the extension: `ab` puts .gpu_base
# first on the base runs' PYTHONPATH, so they call the extension through its own Python (an
# FFI call's results may differ between the two commits: 6713821's A/B lost its base runs to that).
build_base() {
  local rev=${1:?usage: bash tools/gpu.sh build-base REV}
  set -e
  git worktree remove --force build/base_src 2>/dev/null || rm -rf build/base_src
  git worktree prune
  git worktree add --detach build/base_src "$rev"
  build_tree build/base_src .gpu_base
  cp -r build/base_src/moonep_jax .gpu_base/
  echo "built .gpu_base from $(cat .gpu_base/COMMIT); carry [\".gpu\", \".gpu_base\"] and run:" \
    "bash tools/gpu.sh ab --kinds ... --groupings ..."
}

# build-variant NAME NAME=VALUE ...: this tree built with those kernel constants into
# .gpu_variants/NAME/ (its COMMIT names them).
build_variant() {
  local name=${1:?usage: bash tools/gpu.sh build-variant NAME NAME=VALUE ...}
  shift
  [ $# -gt 0 ] || { echo "tools/gpu.sh build-variant: name at least one NAME=VALUE" >&2; return 1; }
  local overrides; overrides=$(IFS=';'; echo "$*")
  build_tree . ".gpu_variants/$name" "$overrides"
  echo "built .gpu_variants/$name ($(cat ".gpu_variants/$name/COMMIT")); carry" \
    "[\".gpu\", \".gpu_variants\"] and run: bash tools/gpu.sh ab-variants --kinds ... --groupings ..."
}

# The environment of every GPU process the runner starts: NVLink multicast off (NVLS), output
# unbuffered (the device tool returns what was printed when a command is killed), XLA's logs quiet.
export_gpu_env() {
  export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
}

# ab_runs TAG:DIR ...: benchmarks/ab_gemm.py run "${AB_ARGS[@]}" once per TAG:DIR, in the
# order given, then the comparison of all runs, into $OUT/ab.log; the runs' JSON is packed into
# $OUT/ab_runs.tgz (the device tool brings back at most 8 files).
ab_runs() {
  local out=${OUT:-$PWD/gpu_out}
  local runs=$out/ab_runs index=0 status=0 spec tag dir
  mkdir -p "$runs" && : > "$out/ab.log"
  export_gpu_env
  for spec in "$@"; do
    tag=${spec%%:*} dir=${spec#*:}
    echo "$tag: $(cat "$dir/COMMIT")" | tee -a "$out/ab.log"
    MOONEP_GIT_COMMIT=$(cat "$dir/COMMIT") PYTHONPATH="$PWD/$dir:$PWD" \
      timeout "${GPU_BENCH_TIMEOUT:-300}" python3 benchmarks/ab_gemm.py run --tag "$tag" \
      --index "$index" --out "$runs" "${AB_ARGS[@]}" 2>&1 | tee -a "$out/ab.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    index=$((index + 1))
  done
  # ab_gemm imports bench_gemm, which imports moonep_jax (from the tree, with the first build).
  PYTHONPATH="$PWD/${1#*:}:$PWD" python3 benchmarks/ab_gemm.py compare "$runs"/ab_gemm_*.json \
    | tee -a "$out/ab.log"
  tar czf "$out/ab_runs.tgz" -C "$out" ab_runs && rm -rf "$runs"
  return $status
}

# ab ARGS: benchmarks/ab_gemm.py run ARGS with each build, new base base new (the second process
# of a pair runs a few % slower), then the comparison; ab.log and ab_runs.tgz under $OUT.
ab() {
  if [ ! -f .gpu_base/COMMIT ] || [ ! -f .gpu/COMMIT ]; then
    echo "tools/gpu.sh ab: needs .gpu and .gpu_base (bash tools/gpu.sh build, then build-base" \
      "REV, and carry [\".gpu\", \".gpu_base\"])" >&2
    return 1
  fi
  AB_ARGS=("$@"); ab_runs new:.gpu base:.gpu_base base:.gpu_base new:.gpu
}

# ab-variants ARGS: benchmarks/ab_gemm.py run ARGS with .gpu ("new") and every .gpu_variants/*
# (tagged by name), in that order and then reversed, then the comparison, in % of "new".
ab_variants() {
  local dir specs=()
  for dir in .gpu_variants/*/; do
    [ -f "$dir/COMMIT" ] && specs+=("$(basename "$dir"):${dir%/}")
  done
  if [ ! -f .gpu/COMMIT ] || [ ${#specs[@]} = 0 ]; then
    echo "tools/gpu.sh ab-variants: needs .gpu and .gpu_variants/* (bash tools/gpu.sh build," \
      "then build-variant NAME NAME=VALUE ..., and carry [\".gpu\", \".gpu_variants\"])" >&2
    return 1
  fi
  local order=(new:.gpu "${specs[@]}") reversed=() i
  for ((i = ${#order[@]} - 1; i >= 0; i--)); do reversed+=("${order[i]}"); done
  AB_ARGS=("$@"); ab_runs "${order[@]}" "${reversed[@]}"
}

# run_pytest TIMEOUT ARGS...: pytest (with -k "$GPU_TEST_K" when set) under a timeout, appended
# to gpu_tests.log; selecting no test (exit 5, e.g. GPU_TEST_ARGS naming only multi-process
# tests) is not a failure.
run_pytest() {
  local limit=$1; shift
  [ -n "${GPU_TEST_K:-}" ] && set -- -k "$GPU_TEST_K" "$@"
  timeout "$limit" python3 -m pytest -v -rs --tb=short "$@" 2>&1 | tee -a "$OUT/gpu_tests.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || [ "$rc" = 5 ]
}

run() {
  OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
  export PYTHONPATH="$PWD/.gpu:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export_gpu_env
  # The records' commit: the one the carried binary was built from (benchmarks/_common.py).
  MOONEP_GIT_COMMIT=$(cat .gpu/COMMIT 2>/dev/null || true); export MOONEP_GIT_COMMIT
  { nvidia-smi; python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())";
    echo "commit $(cat .gpu/COMMIT 2>/dev/null || echo unknown)"; } > "$OUT/gpu_tests.log" 2>&1
  cat "$OUT/gpu_tests.log"
  local status=0
  if [ "${GPU_SKIP_TESTS:-0}" = 1 ]; then
    echo "== GPU tests skipped (GPU_SKIP_TESTS=1)" | tee -a "$OUT/gpu_tests.log"
  else
    # shellcheck disable=SC2086
    run_pytest "${GPU_TEST_TIMEOUT:-420}" -m "gpu and not multiprocess_gpu" --durations=20 \
      ${GPU_TEST_ARGS:-tests} || status=1
    # EP groups spanning processes: R = 2, 4, 8 processes sharing GPU 0 under MPS (the tests
    # start the MPS daemon unless one runs), and one GPU per process where the host has R GPUs.
    # The test process itself stays off the GPU.
    if [ -z "${GPU_TEST_ARGS:-}" ] || [ -n "${GPU_MP_TEST_ARGS:-}" ]; then
      # shellcheck disable=SC2086
      (export JAX_PLATFORMS=cpu; run_pytest "${GPU_MP_TEST_TIMEOUT:-480}" -m multiprocess_gpu \
        --durations=10 ${GPU_MP_TEST_ARGS:-tests/test_multiprocess_gpu.py}) || status=1
    fi
  fi
  if [ "$status" != 0 ] && [ "${GPU_STOP_ON_FAIL:-0}" = 1 ]; then
    echo "== tests failed: benchmarks skipped (GPU_STOP_ON_FAIL=1)" | tee -a "$OUT/benchmarks.log"
    return $status
  fi
  for spec in "$@"; do
    local name=${spec%%:*} args=""
    [ "$spec" != "$name" ] && args=${spec#*:}
    echo "== benchmark $name $args" | tee -a "$OUT/benchmarks.log"
    # shellcheck disable=SC2086
    timeout "${GPU_BENCH_TIMEOUT:-300}" python3 "benchmarks/$name.py" --out "$OUT" $args \
      2>&1 | tee -a "$OUT/benchmarks.log"
    local rc=${PIPESTATUS[0]}
    echo "== benchmark $name exit $rc" | tee -a "$OUT/benchmarks.log"
    [ "$rc" = 0 ] || status=1
  done
  tail -n 30 "$OUT/gpu_tests.log" | grep -E "passed|failed|error" || true
  return $status
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  build-base) shift; build_base "$@" ;;
  ab) shift; ab "$@" ;;
  build-variant) shift; build_variant "$@" ;;
  ab-variants) shift; ab_variants "$@" ;;
  *) echo "usage: bash tools/gpu.sh build | run [BENCH[:ARGS] ...] | build-base REV | ab ARGS" \
       "| build-variant NAME NAME=VALUE ... | ab-variants ARGS" >&2
     exit 2 ;;
esac
