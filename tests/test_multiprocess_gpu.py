"""EP groups spanning processes: R = 2, 4, 8 JAX processes, one EP rank each, placed two ways:
all sharing the one GPU under MPS ("one_gpu", each with `CUDA_VISIBLE_DEVICES=0`), and one GPU
per process ("gpu_each", `local_device_ids`; skipped on a host with fewer than R GPUs).

The transport maps every peer's XLA pool once at bootstrap and the kernels reach the peers'
buffers through those mappings. XLA's GPU collectives refuse two ranks on one GPU, so each
process also computes the xla reference on the job's CPU devices (gloo), on the same inputs:
- plan, dispatch, combine, prefetch and reduce_grad must be bitwise equal to it;
- the grouped GEMM (training, and inference with overflow experts read from the peers' pools)
  and moe_ffn forward and gradients within `||a - b|| / ||b|| < 1e-2` (the CuTe GEMM
  accumulates in another order than XLA's CPU dot, as in the single-process GPU tests);
at maxvio 0 to 20 with repeated ids and -1 entries; then 1000 back-to-back calls with changing
routings, each bitwise equal to its reference; and 1000 plans back to back with many CTAs per
kernel grid and changing shapes and routings (invalid ids in some), each bitwise equal. The last
test kills one process mid-run: the others' bounded waits fire (rank and epoch in the report) and
they exit; nothing hangs.

Run from a test process that stays off the GPU: `JAX_PLATFORMS=cpu` (tools/gpu.sh run does).
"""

from __future__ import annotations

import dataclasses
import re
import signal
import time
from pathlib import Path

import pytest

from moonep_jax import launch

from _mp_workloads import Sizes, check_combine_shapes, check_plan_loop, check_suite

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess_gpu]

WORKLOADS = str(Path(__file__).with_name("_mp_workloads.py"))
MAXVIOS = (0.0, 1.0, 20.0)
TRAIN = Sizes(S=32, K=2, E=64, H=64, F=32)
INFER = Sizes(S=32, K=2, E=64, H=64, F=32, B=2, tp=2)
# K = 8 >= R: tokens spread over many ranks, several entries of a token on one rank (with the
# owners summing combine's first stage, as over several GPUs: its staged partials fill up to
# min(R - 1, K // 2) slots; TRAIN and INFER take the default, the home reading in place on one GPU),
# and F = 32, less than one K tile of the grouped matmul: its moe_ffn once gave NaN where a K tile
# read past a replica slot into the next, unused one (left unwritten by the layer); the GEMM's
# weights are rank-3 TMA tensors since, which read zeros past each matrix.
SPREAD = Sizes(S=32, K=8, E=64, H=64, F=32, combine_on_owner=True)
CASES = (("train", TRAIN, True), ("infer", INFER, False), ("spread", SPREAD, False))
CALLS = 1000
# Plan grids of 40 CTAs (3 blocks of chunks, the last partial), 8 and 32 per rank, and the largest
# E (alloc [E, R] takes more than the default 48 KiB of shared memory at R >= 2), in turn.
PLAN_SHAPES = (Sizes(S=2500, K=8, E=64), Sizes(S=600, K=6, E=48, B=2, tp=4),
               Sizes(S=4096, K=4, E=32, tp=2), Sizes(S=256, K=8, E=2048))


PLACEMENTS = ("one_gpu", "gpu_each")


@pytest.fixture(scope="module")
def mps_env():
    """An MPS daemon for the module (started here unless one runs), and the clients' env."""
    with launch.mps() as env:
        yield env


def _placed(placement: str, R: int, request) -> dict:
    """launch.run's arguments that place R ranks: all on GPU 0 under MPS (the module's daemon),
    each with a share of its memory, or process i on GPU i, without MPS (every process still sees
    every GPU, to map its peers; skipped where the host shows fewer than R)."""
    memory = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    if placement == "one_gpu":
        return dict(platform="gpu", env=dict(request.getfixturevalue("mps_env"), **memory,
                                             XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.6 / R:.4f}"))
    gpus = launch.visible_gpu_count()
    if gpus < R:
        pytest.skip(f"one GPU per process at R = {R} needs {R} GPUs; this host shows {gpus}")
    return dict(platform="gpu", local_device_ids=[[i] for i in range(R)],
                env=dict(XLA_PYTHON_CLIENT_MEM_FRACTION="0.6", **memory))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("R", [2, 4, 8])
def test_cuda_ops_in_processes_match_xla(request, seed, R, placement):
    results = launch.run(f"{WORKLOADS}:gpu_suite", R, (seed, MAXVIOS, CASES, CALLS),
                         timeout_s=300, **_placed(placement, R, request))
    check_suite([r.value for r in results], f"R={R} {placement}", CALLS)
    # Where a group's ranks share one GPU, combine reads in place by default; over several GPUs
    # the owners sum its first stage.
    assert [r.value["combine_on_owner"] for r in results] == [placement == "gpu_each"] * R


# Combine's row loops past one step (bf16 rows of 129 16-byte vectors), 4-byte vectors (f32,
# H = 13) with K = 12 and element-wise rows (bf16, H = 7), each with the owners summing the first
# stage (as over several GPUs) and read in place.
COMBINE_SHAPES = tuple((dataclasses.replace(sizes, combine_on_owner=on_owner), dtype)
                       for sizes, dtype in ((Sizes(S=48, K=8, E=64, H=1032), "bfloat16"),
                                            (Sizes(S=32, K=12, E=48, H=13), "float32"),
                                            (Sizes(S=32, K=8, E=32, H=7), "bfloat16"))
                       for on_owner in (True, False))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("R", [2, 4, 8])
def test_combine_row_shapes_in_processes_match_xla(request, seed, R, placement):
    results = launch.run(f"{WORKLOADS}:combine_shapes", R, (seed, COMBINE_SHAPES),
                         timeout_s=300, **_placed(placement, R, request))
    check_combine_shapes([r.value for r in results], f"R={R} {placement}")


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("R", [2, 8])
def test_plan_back_to_back_with_many_ctas_in_processes_matches_xla(request, seed, R, placement):
    """1000 plans back to back whose kernel grids have many CTAs (the last one of each waits on
    the peers' grids, which run in other processes) and whose shapes change from call to call:
    every call bitwise equal to its reference (tickets, block sums, invalid counts reset)."""
    results = launch.run(f"{WORKLOADS}:plan_back_to_back", R, (seed, CALLS, PLAN_SHAPES),
                         timeout_s=300, **_placed(placement, R, request))
    check_plan_loop([r.value for r in results], f"R={R} {placement}", CALLS, R)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_dead_process_makes_the_others_exit_through_bounded_waits(request, seed, placement):
    # Four ranks on the one GPU; over GPUs, two (what a two-GPU host holds).
    R, victim, timeout_s = (4, 2, 3.0) if placement == "one_gpu" else (2, 1, 3.0)
    start = time.monotonic()
    results = launch.run(f"{WORKLOADS}:die_mid_run", R, (seed, victim, 200, TRAIN, timeout_s),
                         timeout_s=150, expect_failure=True, stop_on_failure=False,
                         **_placed(placement, R, request))
    elapsed = time.monotonic() - start
    assert results[victim].returncode == -signal.SIGKILL, results[victim].tail()
    assert f"process {victim}: killing myself" in results[victim].output
    survivors = [r for r in results if r.process_id != victim]
    for r in survivors:  # exit 3: the error reached Python; XLA may also abort on a lost context
        assert r.returncode not in (0, None), f"process {r.process_id} hung or went on:\n{r.tail()}"
    # The record of an expired wait (read from its host-mapped mirror after the trap) names the
    # rank, the epoch and what it awaited.
    reports = "\n".join(r.output for r in survivors)
    assert re.search(r"timeout at EP rank \d, epoch \d+: \w", reports) or (
        "timed out" in reports and "epoch" in reports), reports[-4000:]
    assert elapsed < 150
