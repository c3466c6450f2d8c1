"""`--processes N` of the benchmarks: one EP rank per process, timed together, gathered at 0.

The benchmark script (the parent) spawns N local processes with `moonep_jax.launch` and stays off
the GPU itself. On a host with N or more GPUs process i drives GPU i (the product's layout: the
ranks reach each other over NVLink through their peer mappings); on a host with fewer, all N
share GPU 0 under MPS (`launch.mps`), each with 1/N of its memory; on CPU each has one CPU device
and XLA's CPU collectives go through gloo (the path's CPU test). Every process owns one rank of
a 1-D ("ep",) mesh, times its own calls after a warm-up with a barrier through jax.distributed's
key-value store before every repetition (so that no rank starts a repetition while a peer is
still in the previous one), and process 0 gathers every rank's results through the same store
and writes the record.

Baselines that need XLA's own collectives between the ranks run only where those work: over one
GPU per rank (NCCL) and on CPU (gloo), not when the ranks share one GPU (NCCL refuses two ranks on
one device); each benchmark says which of its baselines it times here (`collectives_work`,
`skipped_methods`).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moonep_jax import _distributed, _ffi, launch

import _common

NOT_NVLINK = ("N processes share ONE GPU under MPS: all ranks run on the same SMs and HBM and the "
              "'link' between ranks is that GPU's HBM, so these times are NOT NVLink figures (nor "
              "what one GPU per rank would give); bytes/s are HBM traffic of the one GPU")
CPU_ONLY = ("N processes on the CPU backend (gloo), implementation 'xla': a harness check of the "
            "multi-process path, not a performance figure")
ONE_GPU_EACH = ("one process per GPU: the ranks reach each other's buffers over the GPUs' peer "
                "link (NVLink on an H100/H200 node) through their peer mappings (CUDA IPC of the "
                "transport areas, VMM of the XLA pools)")
NCCL_REFUSES = ("left out when the ranks share one GPU: XLA's GPU collectives (NCCL) refuse two "
                "ranks on one GPU")
BASELINES_ELSEWHERE = ("left out of --processes, which times the moonep ops only: XLA's GPU "
                       "collectives (NCCL) refuse two ranks on one GPU, and over one GPU per rank "
                       "the baselines run in the single-process benchmark (one process driving the "
                       "same GPUs)")
XLA_REFERENCE_ELSEWHERE = ("the xla reference is timed next to the CUDA ops by the single-process "
                           "benchmark only")
# How the parent placed the ranks, for the ranks' records: one of PLACEMENTS.
PLACEMENT_ENV = "MOONEP_BENCH_PLACEMENT"
PLACEMENTS = ("cpu", "one_gpu", "gpu_each")
# The ranks' share of each GPU's memory (XLA preallocates its pool: the transport maps it once at
# bootstrap), split N ways when N ranks share one GPU; the rest is left for the CUDA contexts
# (and the MPS server).
GPU_MEMORY_SHARE = 0.9
# Bounds: a job stays under tools/gpu.sh's GPU_BENCH_TIMEOUT (300 s by default) unless its
# benchmark asks for more (`spawn`'s timeout_s); one wait for peers covers a peer's compile.
JOB_TIMEOUT_S = 280.0
WAIT_S = 120.0
# The ranks' CUDA waits for each other (CudaOptions.timeout_s, 10 s by default): ranks sharing one
# GPU start their calls a host round trip apart and an MPS client may be descheduled for a while.
CUDA_WAIT_S = 60.0


def placement(n: int) -> str:
    """Where the parent puts n ranks: 'cpu' (no GPU, or no CUDA extension), 'gpu_each' (the host
    shows n or more GPUs: process i drives GPU i) or 'one_gpu' (all share GPU 0 under MPS)."""
    on_cpu = os.environ.get("JAX_PLATFORMS", "").lower() == "cpu"
    gpus = 0 if on_cpu else launch.visible_gpu_count()
    if gpus == 0 or not _ffi.available():
        return "cpu"
    return "gpu_each" if gpus >= n else "one_gpu"


def described(n: int, where: str) -> dict:
    """What a record says of n ranks placed `where` (one of PLACEMENTS)."""
    return {
        "gpu_each": {"process_layout": f"{n} processes, one GPU each, one EP rank each",
                     "physical_gpus": n, "timing_note": ONE_GPU_EACH},
        "one_gpu": {"process_layout": f"{n} processes sharing one GPU under MPS, one EP rank each",
                    "physical_gpus": 1, "timing_note": NOT_NVLINK},
        "cpu": {"process_layout": f"{n} processes on the CPU backend (gloo), one EP rank (one CPU "
                                  "device) each", "physical_gpus": 0, "timing_note": CPU_ONLY},
    }[where]


def spawn(script: str, entry: str, n: int, args, timeout_s: float = JOB_TIMEOUT_S) -> None:
    """Runs `entry(args)` of the file `script` in `n` processes (one EP rank each, placed by
    `placement`) and waits for them; raises `launch.LaunchError` when one fails (the others are
    then killed) or after `timeout_s`. Their output goes to this process's stdout."""
    jax.config.update("jax_platforms", "cpu")  # the parent never takes the ranks' GPU memory
    where = placement(n)
    target = f"{pathlib.Path(script).resolve()}:{entry}"
    print(f"spawning {described(n, where)['process_layout']}", flush=True)
    run = functools.partial(launch.run, target, n, (args,), timeout_s=timeout_s,
                            stream_output=True)
    placed = {PLACEMENT_ENV: where}
    if where == "cpu":
        run(env=placed)
        return
    # XLA preallocates its pool: the transport maps it once at bootstrap.
    placed["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
    if where == "gpu_each":
        run(platform="gpu", local_device_ids=[[i] for i in range(n)],
            env=dict(placed, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{GPU_MEMORY_SHARE:.4f}"))
        return
    with launch.mps() as mps_env:
        run(platform="gpu", env=dict(mps_env, **placed,
                                     XLA_PYTHON_CLIENT_MEM_FRACTION=f"{GPU_MEMORY_SHARE / n:.4f}"))


# ---- inside a rank's process --------------------------------------------------------------------


def ep_mesh() -> jax.sharding.Mesh:
    """("ep",) mesh over the job's devices (one per process), in device-id order; on GPU with
    the CUDA transport bootstrapped on it (each peer's pool mapped once)."""
    if jax.local_device_count() != 1:
        raise RuntimeError(f"--processes: each process must own one device; process "
                           f"{jax.process_index()} has {jax.local_device_count()}")
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",),
                             axis_types=(jax.sharding.AxisType.Explicit,))
    if implementation() == "cuda":
        import moonep_jax

        moonep_jax.bootstrap(mesh, "ep")
    return mesh


def implementation() -> str:
    """What the ranks time: the CUDA ops on GPU; on CPU the xla ones stand in."""
    return "cuda" if jax.default_backend() == "gpu" else "xla"


def collectives_work(where: str | None = None) -> bool:
    """Whether XLA's own collectives (a baseline's all_to_all, a global loss's all-reduce) can run
    between ranks placed `where` (one of PLACEMENTS; this job's by default): over one GPU each
    (NCCL) and on CPU (gloo), not on one shared GPU."""
    return (where or my_placement()) != "one_gpu"


def untimed_implementation() -> dict:
    """The moe_ffn implementation that the ranks do not time, and why."""
    if implementation() == "cuda":
        return {"moonep_xla": XLA_REFERENCE_ELSEWHERE}
    return {"moonep_cuda": "needs the CUDA extension and a GPU"}


def skipped_methods(baselines: tuple[str, ...], reason: str) -> dict:
    """Why each method that `--processes` leaves out is left out: `baselines` for `reason`, and
    the moe_ffn implementation that the ranks do not time."""
    return {**{name: reason for name in baselines}, **untimed_implementation()}


def my_rank(mesh: jax.sharding.Mesh) -> int:
    """This process's EP rank: its device's position on the mesh."""
    return list(mesh.devices.flat).index(jax.local_devices()[0])


def put(mesh, value: np.ndarray) -> jax.Array:
    """The global array `value` (the same in every process), split over "ep" on axis 0."""
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("ep")),
                                        lambda index: value[index])


def draw_on_rank(mesh, rank: int, draw) -> tuple[jax.Array, ...]:
    """`draw(key)`'s arrays as this rank's shards of global "ep"-split arrays: drawn on its own
    device from a key of its own, with no collective (NCCL refuses two ranks on one GPU) and no
    host draw (numpy takes tens of seconds for the record shape's rows)."""
    split = NamedSharding(mesh, P("ep"))
    with jax.default_device(jax.local_devices()[0]):
        mine = jax.jit(draw)(jax.random.fold_in(jax.random.key(7777), rank))
    return tuple(jax.make_array_from_single_device_arrays((mesh.size * a.shape[0], *a.shape[1:]),
                                                          split, [a]) for a in mine)


def local(array: jax.Array) -> np.ndarray:
    """This process's shard of an "ep"-split array, on the host."""
    (shard,) = array.addressable_shards
    return np.asarray(shard.data)


def cuda_options():
    """The CudaOptions of the ranks' configs: the default knobs, a longer bound on waits."""
    import moonep_jax

    return moonep_jax.CudaOptions(timeout_s=CUDA_WAIT_S)


def compiled_together(fn, args, barrier) -> object:
    """The jitted `fn` compiled for `args`, returned once every process has compiled it: a rank's
    first call must not wait in a kernel for a peer that is still compiling."""
    compiled = fn.lower(*args).compile()
    barrier()
    return compiled


def barrier(tag: str):
    """A callable that makes every process of the job meet (a fresh barrier name each call)."""
    count = iter(range(1 << 30))
    return lambda: _distributed.barrier(f"moonep_bench/{tag}/{next(count)}", WAIT_S)


def gather(key: str, value) -> list | None:
    """Every process's JSON-able `value`, in process order, at process 0 (None elsewhere)."""
    me = jax.process_index()
    _distributed.put(f"moonep_bench/{key}/{me}", json.dumps(value))
    if me != 0:
        return None
    return [json.loads(_distributed.get(f"moonep_bench/{key}/{p}", WAIT_S, f"process {p}'s {key}"))
            for p in range(jax.process_count())]


def across_ranks(per_rank: list[dict]) -> dict:
    """Times of one op on every rank (`per_rank[i]` of rank i: times_ms, median_ms) and the
    slowest rank's median (the op ends when its last rank does)."""
    medians = [r["median_ms"] for r in per_rank]
    return {"per_rank": per_rank, "median_ms": max(medians),
            "slowest_rank": int(np.argmax(medians)), "median_ms_per_rank": medians}


def my_placement() -> str:
    """How the parent placed this job's ranks (`placement`), from the environment it set."""
    where = os.environ.get(PLACEMENT_ENV)
    if where not in PLACEMENTS:
        raise RuntimeError(f"--processes: ${PLACEMENT_ENV} must be one of {PLACEMENTS} (the "
                           f"benchmark's spawn sets it); got {where!r}")
    return where


def provenance(n: int) -> dict:
    """`_common.provenance()` plus the process layout and what the times mean."""
    return {**_common.provenance(), "processes": n, **described(n, my_placement()),
            "timing": "each rank times its own calls: median of reps after a warm-up, a barrier "
                      "(jax.distributed key-value store) before each repetition; median_ms of an "
                      "op is the max over ranks"}


def stem(bench: str, n: int, quick: bool) -> str:
    """File name of the record: GPU model x GPUs (x1 and `_mps` when all ranks share one GPU)
    and the process count."""
    shared = my_placement() == "one_gpu"
    return (f"{bench}_{_common.device_tag(1 if shared else n)}_{n}proc"
            + ("_mps" if shared else "") + ("_quick" if quick else ""))
