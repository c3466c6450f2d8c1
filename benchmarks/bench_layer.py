"""One MoE layer, forward + backward, against the routing skew (maxvio), with XLA baselines.

Shape of record (DESIGN §10): S=8192, H=7168, K=8, E=384, F=2048, bf16, EP = every local device,
maxvio 0.2, 1, 10, 20 (routing from `moonep_jax.routing.lognormal_for_maxvio`). One step is
`jax.value_and_grad` of `sum(out * d_out)` (a fixed random cotangent) w.r.t. x, topk_w, w_gate_up
and w_down of a SwiGLU MoE layer; the same inputs and weights for every method. The loss value
keeps the layer's output live, as the next layer of a real model does: with `jax.grad` alone XLA
drops every forward computation that only the (linear) loss reads, the whole down projection of
the dense floor included (5 GEMMs instead of 6).

Methods:
  moonep_cuda      `moonep_jax.moe_ffn`, implementation="cuda", B = epn (training).
  a2a_pad_gmm      `lax.all_to_all` with worst-case capacity (a `[R, S*K, H]` send buffer per rank:
                   every entry could go to one home rank), a local sort by expert, and our CuTe
                   grouped GEMM with one group per local expert (weights local, no replication).
  ragged_a2a_dot   MaxText's path: `lax.ragged_all_to_all` into a worst-case `[R*S*K, H]` buffer,
                   a local sort by expert, `lax.ragged_dot`; reverse on the way back.
  moonep_xla       the xla reference `moe_ffn`, --quick only (its masked-segment GEMM costs
                   (2*epn) x NvS rows of GEMM, far too slow at the record shape).
Each method compiles once (shapes do not depend on maxvio). A method that fails records
"failed: <reason>"; a method whose compile + runs exceed its time budget skips its remaining
points; ragged_all_to_all, whose NCCL fallback can hang, runs last under a watchdog.

Reported per point: wall time per step (median of --reps after a warm-up, `block_until_ready`);
memory per device from the compiled executable's `memory_analysis()` (argument + output + temp
bytes; `peak_bytes_in_use` cannot be reset between methods in one process); and the prefetch
bandwidth of the moonep plan (bytes of the slowest rank's planned replica weights, gate_up and
down, over the time of a jitted shard_map of the prefetches alone), both as moe_ffn prefetches (both
projections in one call, unused slots left unwritten) and as the public `prefetch` (one call per
projection, unused slots zeroed).

Writes `<out>/bench_layer_<gpu>x<count>.json` and `.png` (`benchmarks/results` by default).
`--quick` runs a tiny shape (CPU smoke test: there the CUDA GEMM of a2a_pad_gmm is replaced by
`lax.ragged_dot`, and the record says so).

One-GPU mode (`--one-gpu`, and the default when jax sees one device): R = 1 with E = 192, i.e.
EP=2's per-rank work of the record shape (S=8192, K=8, H=7168, F=2048, bf16, B = epn), maxvio
0.2/1/10/20 (routing: ONE_GPU_ROUTING below says why a lognormal over the 192 experts). Times
moonep_jax's step (`jax.value_and_grad` w.r.t. x, topk_w and both weights) and its forward next to
the dense floor measured in the same process (the same S*K rows through ONE dense SwiGLU expert, 6
dense GEMMs, `jax.value_and_grad`), their ratio, each point's groups and M tiles, and the memory of
the compiled step. Median of --reps (20) after 2 warm-ups, the four points timed round-robin
(call i of every point before call i + 1 of any: timed one point after another, the later calls
of the last points ran up to 7 % slower than their first ones), so the GPU's clocks are one window
per method over all four (the record's `gpu_clocks_of_all_points`); about a minute of GPU time
after compiles. `--ncu` first re-runs exactly one step under ncu (the recipe of
shared/examples/profile_layer/run_ncu.sh; needs ncu and CuPy or libnvToolsExt) and folds the
per-kernel times into the record by category (grouped GEMM fwd/dX, dW, converts, reduce_grad,
dispatch/combine, rest); the raw CSV goes to
`--out` (or /tmp). Writes `bench_layer_<gpu>x1_onegpu.json` and `.png`. `--one-gpu --quick` is a
CPU smoke test (implementation xla, E=16).

`--processes N`: one EP rank per process (benchmarks/_processes.py), N local processes: one GPU
each on a host with N or more GPUs, at RECORD; else all sharing GPU 0 under MPS, at PROCESS_SHAPE
(S=4096, H=7168, K=8, E=128, F=2048: the record shape's buffers would not fit N ranks on one GPU);
maxvio 1 and 20, --reps 5. With a GPU per rank (NCCL) and on CPU (gloo; the xla implementation
stands in, a harness check) the baselines a2a_pad_gmm and ragged_a2a_dot run too, every method
with the single-process mode's step, one method after another (--skip leaves one out; the job's
bound grows by their budgets: run it under GPU_BENCH_TIMEOUT=420). Sharing one GPU only moe_ffn
runs (XLA's NCCL collectives refuse two ranks on one GPU), each rank's step a `jax.vjp` pullback
of its own d_out inside the shard_map (the same gradients without XLA's all-reduce of a global
loss). Each rank times its own steps; process 0 writes
`bench_layer_<gpu>x<gpus>_<N>proc[_mps].json` (to --out, else benchmarks/results) with every
rank's times and the max over ranks. Sharing one GPU these are NOT NVLink figures: all ranks
share its SMs and HBM.

    python benchmarks/bench_layer.py [--quick] [--out DIR] [--reps N]
    python benchmarks/bench_layer.py --processes N [--quick] [--out DIR] [--reps N]
    python benchmarks/bench_layer.py --one-gpu [--ncu [--ncu-maxvio 1]] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import sys
import threading
import time

# The weights, their replicas and fp32 gradients of the record shape at EP=2 need most of an
# H200: let XLA take more than its default 75% (keeps a user's explicit setting).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import _processes  # noqa: E402

import moonep_jax  # noqa: E402
from moonep_jax import _checks, _ffi, routing  # noqa: E402
from moonep_jax.experts import prefetch  # noqa: E402
from moonep_jax.layer import moe_ffn  # noqa: E402
from moonep_jax.plan import plan  # noqa: E402

MAXVIOS = _common.MAXVIOS
METHOD_BUDGET_S = {"moonep_cuda": 100.0, "a2a_pad_gmm": 60.0, "ragged_a2a_dot": 45.0,
                   "moonep_xla": 120.0}
RAGGED_HANG_S = 90.0
# Why a method may be left out of a run (--skip), written into its record.
SKIP_REASONS = {
    "ragged_a2a_dot": "at the record shape on 2xH200 (jax 0.11.2) its compile fails with "
                      "RESOURCE_EXHAUSTED: XLA lowers ragged_dot over the local experts through a "
                      "dense [rows, epn, K] mask (336 GiB), so the run would only record that "
                      "failure again after ~80 s of autotuning",
}
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Shape:
    S: int
    H: int
    K: int
    E: int
    F: int


RECORD = Shape(S=8192, H=7168, K=8, E=384, F=2048)


def quick_shape(R: int) -> Shape:
    return Shape(S=128, H=256, K=4, E=8 * R, F=128)


# ---- inputs -------------------------------------------------------------------------------------


def draw_inputs(key, shape: Shape, tokens: int, experts: int):
    """`(x, topk_w, w_gate_up, w_down, d_out)` of `tokens` tokens and `experts` experts."""
    S, H, K, E, F = tokens, shape.H, shape.K, experts, shape.F
    k = jax.random.split(key, 5)
    # Drawn in bf16 directly: an fp32 draw of the record shape's weights would need 45 GB.
    normal = lambda i, shp, scale: (  # noqa: E731
        jax.random.normal(k[i], shp, jnp.bfloat16) * jnp.bfloat16(scale))
    return (normal(0, (S, H), 1.0), jax.random.uniform(k[1], (S, K), _F32),
            normal(2, (E, H, 2 * F), H ** -0.5), normal(3, (E, F, H), F ** -0.5),
            normal(4, (S, H), 1.0))


def weights_and_tokens(mesh, shape: Shape):
    """`(x, topk_w, w_gate_up, w_down, d_out)`, drawn on the devices, split over "ep"."""
    R = mesh.shape["ep"]
    split = NamedSharding(mesh, P("ep"))
    draw = jax.jit(draw_inputs, static_argnums=(1, 2, 3), out_shardings=(split,) * 5)
    return draw(jax.random.key(7777), shape, R * shape.S, shape.E)


# ---- the methods: per-rank layers ---------------------------------------------------------------


def swiglu(h):
    gate, up = jnp.split(h.astype(_F32), 2, axis=1)
    return (jax.nn.silu(gate) * up).astype(h.dtype)


def moonep_layer(cfg):
    def layer(x, topk_idx, topk_w, w_gate_up, w_down):
        return moe_ffn(x, topk_idx, topk_w, {"w_gate_up": w_gate_up, "w_down": w_down}, cfg)

    return layer


def cuda_grouped_matmul():
    """`gemm(rows [M, D0], w [epn, D0, D1], sizes [epn]) -> [M, D1]`, differentiable: our CuTe
    kernels with one group per local expert (ep_rank 0, so groups [0, epn) are `w`), rows past
    `sum(sizes)` zero. The slot operand is `w` itself with empty slot groups: no copy, no
    overflow (B == epn)."""
    from moonep_jax._cuda import grouped_matmul as cuda_gmm

    rank0 = jnp.zeros(1, jnp.int32)

    def ends(sizes, num_slot_groups):
        cu = jnp.cumsum(sizes).astype(jnp.int32)
        return jnp.concatenate([cu, jnp.broadcast_to(cu[-1:], (num_slot_groups,))])

    @jax.custom_vjp
    def gmm(rows, w, sizes):
        return cuda_gmm.grouped_matmul_of_groups(rows, w, w, ends(sizes, w.shape[0]), rank0)

    def fwd(rows, w, sizes):
        return gmm(rows, w, sizes), (rows, w, sizes)

    def bwd(res, d_out):
        rows, w, sizes = res
        d_rows = cuda_gmm.grouped_matmul_dx_of_groups(d_out, w, w, ends(sizes, w.shape[0]), rank0)
        no_replicas = jnp.full((1, 1), -1, jnp.int32)  # one rank, one empty slot group
        d_w, _, _ = cuda_gmm.grouped_matmul_dw_of_groups(rows, d_out, ends(sizes, 1), rank0,
                                                         no_replicas, w.shape[0], 0, 1)
        return d_rows, d_w, None  # dW in the weights' dtype

    gmm.defvjp(fwd, bwd)
    return gmm


def ragged_dot_gemm(rows, w, sizes):
    return lax.ragged_dot(rows, w, sizes.astype(jnp.int32))


def expert_ffn(rows, sizes, w_gate_up, w_down, gemm):
    """SwiGLU experts on rows sorted by local expert (`sizes [epn]` rows each)."""
    return gemm(swiglu(gemm(rows, w_gate_up, sizes)), w_down, sizes)


def sort_by_expert(flat, num_experts):
    """Entries sorted by expert (dropped, -1, last): `(order, sorted ids with E for dropped)`."""
    key = jnp.where(flat >= 0, flat, num_experts)
    order = jnp.argsort(key, stable=True)
    return order, key[order]


def weighted_sum(rows_per_entry, topk_w, S, K, dtype):
    """`out[t] = sum_k topk_w[t, k] * rows[t*K + k]` in fp32, rounded to `dtype`."""
    rows = rows_per_entry.astype(_F32).reshape(S, K, -1)
    return jnp.sum(rows * topk_w[:, :, None], axis=1).astype(dtype)


def a2a_pad_layer(cfg, gemm):
    """`lax.all_to_all` of a worst-case `[R, S*K, H]` buffer, experts computed at home."""
    R, S, K, E, epn = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k, cfg.num_experts, cfg.epn
    N = S * K

    def layer(x, topk_idx, topk_w, w_gate_up, w_down):
        flat = topk_idx.reshape(-1)
        order, sorted_ids = sort_by_expert(flat, E)
        sorted_dest = sorted_ids // epn                         # R for dropped entries
        counts = jnp.zeros(R + 1, jnp.int32).at[sorted_dest].add(1)
        position = jnp.arange(N) - (jnp.cumsum(counts) - counts)[sorted_dest]
        # Send buffers: rows and local expert ids (epn marks an empty row), chunk d for rank d.
        send = jnp.zeros((R, N, x.shape[1]), x.dtype).at[sorted_dest, position].set(
            x[order // K], mode="drop")
        send_ids = jnp.full((R, N), epn, jnp.int32).at[sorted_dest, position].set(
            sorted_ids % epn, mode="drop")
        recv = lax.all_to_all(send, "ep", 0, 0, tiled=True).reshape(R * N, -1)
        recv_ids = lax.all_to_all(send_ids, "ep", 0, 0, tiled=True).reshape(R * N)
        perm = jnp.argsort(recv_ids, stable=True)
        sizes = jnp.zeros(epn + 1, jnp.int32).at[recv_ids].add(1)[:epn]
        y = expert_ffn(recv[perm], sizes, w_gate_up, w_down, gemm)
        y_recv = jnp.zeros_like(y).at[perm].set(y).reshape(R, N, -1)
        back = lax.all_to_all(y_recv, "ep", 0, 0, tiled=True)
        y_sorted = back.at[sorted_dest, position].get(mode="fill", fill_value=0)
        y_entry = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
        return weighted_sum(y_entry, topk_w, S, K, x.dtype)

    return layer


def ragged_a2a_layer(cfg):
    """MaxText's dropless path: ragged_all_to_all there and back, ragged_dot in between."""
    R, S, K, E, epn = cfg.num_ranks, cfg.tokens_per_rank, cfg.top_k, cfg.num_experts, cfg.epn
    N = S * K

    def layer(x, topk_idx, topk_w, w_gate_up, w_down):
        flat = topk_idx.reshape(-1)
        order, sorted_ids = sort_by_expert(flat, E)
        per_expert = jnp.zeros(E + 1, jnp.int32).at[sorted_ids].add(1)[:E]
        send_sizes = per_expert.reshape(R, epn).sum(axis=1)
        input_offsets = jnp.cumsum(send_sizes) - send_sizes
        me = lax.axis_index("ep")
        every_expert = lax.all_gather(per_expert, "ep")              # [source, E]
        sizes_to = every_expert.reshape(R, R, epn).sum(axis=2)       # [source, dest]
        landing = jnp.cumsum(sizes_to, axis=0) - sizes_to             # dest's offset per source
        recv_sizes = sizes_to[:, me]
        recv_offsets = landing[:, me]
        received = lax.ragged_all_to_all(
            x[order // K], jnp.zeros((R * N, x.shape[1]), x.dtype), input_offsets, send_sizes,
            landing[me], recv_sizes, axis_name="ep")
        # Received rows: per source rank, sorted by expert; the counts say which expert is where.
        mine = lax.dynamic_slice_in_dim(every_expert, me * epn, epn, axis=1)  # [source, epn]
        segment_ends = jnp.cumsum(mine.reshape(-1))
        segment = jnp.searchsorted(segment_ends, jnp.arange(R * N), side="right")
        row_ids = jnp.where(segment < R * epn, segment % epn, epn)
        perm = jnp.argsort(row_ids, stable=True)
        y = expert_ffn(received[perm], mine.sum(axis=0), w_gate_up, w_down, ragged_dot_gemm)
        y_recv = jnp.zeros_like(y).at[perm].set(y)
        # Back: the chunk from source s returns to where s sent it from.
        every_offset = lax.all_gather(input_offsets, "ep")           # [source, dest]
        y_sorted = lax.ragged_all_to_all(
            y_recv, jnp.zeros((N, x.shape[1]), x.dtype), recv_offsets, recv_sizes,
            every_offset[:, me], send_sizes, axis_name="ep")
        y_entry = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
        return weighted_sum(y_entry, topk_w, S, K, x.dtype)

    return layer


def training_step(layer, mesh):
    """jit: `sum(out * d_out)` and its grads w.r.t. x, topk_w, w_gate_up, w_down (the value keeps
    the forward's output computed; see the module docstring)."""
    per_rank = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))

    def step(x, topk_idx, topk_w, w_gate_up, w_down, d_out):
        def loss(x, topk_w, w_gate_up, w_down):
            out = per_rank(x, topk_idx, topk_w, w_gate_up, w_down)
            return jnp.sum(out.astype(_F32) * d_out.astype(_F32))

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, topk_w, w_gate_up, w_down)

    return jax.jit(step)


def per_rank_training_step(layer, mesh):
    """`training_step` with no collective of XLA's own (`--processes`: NCCL refuses two ranks on
    one GPU): inside the shard_map, each rank pulls back its own `d_out` through the layer (the
    cotangent of `sum(out * d_out)`, so the same gradients) instead of summing a global loss, and
    returns its output with them (kept live, as the loss value keeps it in `training_step`)."""

    def step(x, topk_idx, topk_w, w_gate_up, w_down, d_out):
        out, pullback = jax.vjp(lambda *a: layer(a[0], topk_idx, *a[1:]), x, topk_w, w_gate_up,
                                w_down)
        return out, pullback(d_out)

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


# ---- measuring ----------------------------------------------------------------------------------


def memory_of(compiled) -> dict:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes")
    memory = {f: int(getattr(analysis, f, 0)) for f in fields}
    memory["total_bytes"] = (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
                             + memory["temp_size_in_bytes"] - memory["alias_size_in_bytes"])
    return memory


class Method:
    """One method: compiles on first use, then times every point, within its time budget."""

    def __init__(self, name: str, step, budget_s: float, reps: int | None = None):
        self.name, self.step, self.budget_s, self.reps = name, step, budget_s, reps
        self.compiled, self.memory, self.spent_s, self.failure = None, None, 0.0, None

    def run(self, args, reps: int) -> dict:
        result = {"method": self.name}
        if self.failure is not None:
            return {**result, "status": self.failure}
        if self.spent_s > self.budget_s:
            return {**result, "status": f"skipped: time budget of {self.budget_s:.0f} s spent"}
        t0 = time.perf_counter()
        try:
            if self.compiled is None:
                self.compiled = self.step.lower(*args).compile()
                self.memory = memory_of(self.compiled)
            times = _common.time_calls(self.compiled, args, self.reps or reps)
        except Exception as e:  # noqa: BLE001  (a method that cannot run is recorded, not fatal)
            self.failure = f"failed: {type(e).__name__}: {str(e)[:400]}"
            return {**result, "status": self.failure}
        finally:
            self.spent_s += time.perf_counter() - t0
        return {**result, "status": "ok", "times_ms": times, "median_ms": float(np.median(times)),
                "memory": self.memory, "memory_source": "compiled.memory_analysis() per device"}


def skipped_on_request(name: str) -> str:
    """The record's reason for a method left out with --skip."""
    return f"skipped on request (--skip): {SKIP_REASONS.get(name, 'no reason given')}"


def hang_watchdog(name: str, seconds: float, point: dict, write) -> threading.Timer:
    """A started watchdog for method `name` at `point`: after `seconds` it records the hang there
    and writes the record (`write`; None in a process that does not write it), then exits the
    process, since a hung collective cannot be cancelled."""

    def expire():
        if write is not None:
            point["results"].append({"method": name,
                                     "status": f"failed: no result after {seconds:.0f} s"})
            write()
        print(f"{name}: no result after {seconds:.0f} s; exiting", flush=True)
        os._exit(0)

    return _common.watchdog(seconds, expire)


def prefetch_bandwidth(mesh, cfg, shape: Shape, topk_idx, w_gate_up, w_down, reps: int) -> dict:
    """Planned replica bytes of the slowest rank (both projections) over the time of the
    prefetches alone, as moe_ffn's forward runs them (one call, unused slots left unwritten) and
    as the public `prefetch` does (one call per projection, unused slots zeroed: B = epn slots of
    writes however few replicas the plan has)."""
    stacked = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    plans = jax.jit(stacked(lambda idx: plan(idx, cfg)))(topk_idx)
    slots = np.asarray(plans.experts_to_copy).reshape(cfg.num_ranks, cfg.num_ranks, -1)
    used = np.array([(slots[r, r] >= 0).sum() for r in range(cfg.num_ranks)])
    expert_bytes = 2 * (shape.H * 2 * shape.F + shape.F * shape.H)
    impl = _checks.implementation(cfg)
    result = {"replicas_per_rank": used.tolist(),
              "bytes_slowest_rank": int(used.max() * expert_bytes)}
    both_ways = {  # (w_gate_up, w_down, plan) -> both projections' slots
        # what moe_ffn's forward calls: both projections in one prefetch, used slots only
        "layer": lambda wg, wd, p: impl.prefetch((wg, wd), p, cfg, zero_unused_slots=False),
        # the public op, one projection per call
        "zero_unused": lambda wg, wd, p: (prefetch(wg, p, cfg), prefetch(wd, p, cfg)),
    }
    for name, fn in both_ways.items():
        both = jax.jit(stacked(fn))
        times = _common.time_calls(both, (w_gate_up, w_down, plans), reps)
        median = float(np.median(times))
        result[name] = {"times_ms": times, "median_ms": median,
                        "gbps": float(used.max() * expert_bytes / (median * 1e-3) / 1e9)}
    return result


# ---- record and plot ----------------------------------------------------------------------------


def plot(record: dict, path: pathlib.Path) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _common.plot_vs_maxvio(ax, record["points"], lambda r: True, "ms per forward + backward",
                           f"MoE layer, {record['device_kind']} x{record['num_devices']}, "
                           f"{record['shape']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- one GPU: EP=2's per-rank work against the dense floor --------------------------------------

ONE_GPU = Shape(S=8192, H=7168, K=8, E=192, F=2048)


def one_gpu_quick_shape() -> Shape:
    return Shape(S=128, H=256, K=4, E=16, F=128)


ONE_GPU_ROUTING = (
    "moonep_jax.routing.lognormal_for_maxvio(jax.random.key(1234), R=1, S, K, E=192, maxvio): a "
    "log-normal popularity over the 192 experts of the one rank, as the verified probe "
    "(shared/examples/profile_layer) draws it, so the numbers compare with it. Not a rank's slice "
    "of an E=384 routing over 2 ranks: tokens of such a routing pick experts of both ranks, and "
    "keeping only rank-local picks would change K per token. What matches EP=2 is the work: S*K = "
    "65536 rows over 192 local experts per rank (at EP=2 the planner also caps every rank at S*K "
    "rows and moves the excess of hot experts into the other rank's slots, so a real EP=2 rank's "
    "groups are less skewed than this R=1 routing at the same maxvio, and it has 1-2 used slots "
    "that R=1 lacks: bench_gemm's R=2 groupings are those). Each point records its groups and M "
    "tiles.")

# ncu kernel categories, first match wins (re.search on the kernel name). Names: the CuTe DSL
# kernels are kernel_cutlass_rows_kernel_* (forward and dX) and kernel_cutlass_weight_grad_kernel_*
# (dW); the CUDA kernels are moonep::<anon>::<name>_kernel; XLA's fusions carry their root op.
NCU_CATEGORIES = (
    ("gemm_fwd_dx", r"rows_kernel|grouped_matmul_overflow_kernel"),
    ("gemm_dw", r"weight_grad_kernel"),
    ("converts", r"convert"),
    ("reduce_grad", r"reduce_grad"),
    ("dispatch_combine", r"dispatch_\w*kernel|combine_\w*kernel"),
    ("planner", r"plan_\w*kernel"),
    ("rest", r"."),
)
NCU_TIMEOUT_S = 300
# --command-buffers: every command type XLA can capture, moonep's custom calls included (all its
# FFI handlers are kCmdBufferCompatible), and graphs of any size.
COMMAND_BUFFER_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL "
                        "--xla_gpu_graph_min_graph_size=1")


def nvtx_push_pop():
    """`(push(name), pop(), source)`: CuPy's NVTX (the verified recipe), else libnvToolsExt."""
    try:
        from cupy.cuda import nvtx

        return nvtx.RangePush, nvtx.RangePop, "cupy.cuda.nvtx"
    except Exception:  # noqa: BLE001
        pass
    import ctypes

    for name in ("libnvToolsExt.so.1", "libnvToolsExt.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        return (lambda s: lib.nvtxRangePushA(s.encode())), lib.nvtxRangePop, name
    raise RuntimeError("no NVTX: neither cupy nor libnvToolsExt is importable")


def one_gpu_problem(shape: Shape, implementation: str):
    """`(mesh, cfg, inputs, step, forward)` of moe_ffn on a 1-device mesh."""
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    cfg = moonep_jax.EPConfig(num_experts=shape.E, top_k=shape.K, tokens_per_rank=shape.S,
                              hidden=shape.H, ffn_hidden=shape.F, num_ranks=1,
                              implementation=implementation)
    if implementation == "cuda":
        from moonep_jax._cuda import transport

        transport.bootstrap(mesh, "ep")
    inputs = weights_and_tokens(mesh, shape)
    layer = moonep_layer(cfg)
    return mesh, cfg, inputs, training_step(layer, mesh), forward_loss(layer, mesh)


def forward_loss(layer, mesh):
    """jit: `sum(out * d_out)` of the layer (the forward of `training_step`)."""
    per_rank = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))

    def loss(x, topk_idx, topk_w, w_gate_up, w_down, d_out):
        out = per_rank(x, topk_idx, topk_w, w_gate_up, w_down)
        return jnp.sum(out.astype(_F32) * d_out.astype(_F32))

    return jax.jit(loss)


def one_gpu_routing(mesh, shape: Shape, maxvio: float):
    topk_idx, sigma, realised = routing.lognormal_for_maxvio(jax.random.key(1234), 1, shape.S,
                                                             shape.K, shape.E, maxvio)
    topk_idx = jax.device_put(np.asarray(topk_idx).reshape(shape.S, shape.K),
                              NamedSharding(mesh, P("ep")))
    return topk_idx, float(sigma), float(realised)


def dense_floor(shape: Shape):
    """`(step, forward, args)`: the same S*K rows through ONE dense SwiGLU expert (x @ W_gu,
    SwiGLU, @ W_down; `jax.value_and_grad` w.r.t. rows and both weights: 6 dense GEMMs), inputs
    drawn like the layer's on the default device."""
    M = shape.S * shape.K

    @jax.jit
    def draw(key):
        k = jax.random.split(key, 4)
        normal = lambda i, shp, scale: (  # noqa: E731
            jax.random.normal(k[i], shp, jnp.bfloat16) * jnp.bfloat16(scale))
        return (normal(0, (M, shape.H), 1.0), normal(1, (shape.H, 2 * shape.F), shape.H ** -0.5),
                normal(2, (shape.F, shape.H), shape.F ** -0.5), normal(3, (M, shape.H), 1.0))

    def loss(rows, w_gate_up, w_down, d_rows):
        y = swiglu(rows @ w_gate_up) @ w_down
        return jnp.sum(y.astype(_F32) * d_rows.astype(_F32))

    return (jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), jax.jit(loss),
            draw(jax.random.key(4242)))


def timed(compiled, args, reps: int, warmups: int = 2) -> dict:
    for _ in range(warmups - 1):  # time_calls warms up once more
        jax.block_until_ready(compiled(*args))
    with _common.gpu_clocks() as clocks:
        times = _common.time_calls(compiled, args, reps)
    return {"status": "ok", "times_ms": times, "median_ms": float(np.median(times)),
            "gpu_clocks": clocks}


def plan_groups(cfg, mesh, topk_idx, tile_m: int) -> dict:
    """This point's groups and M tiles (plan_groupings.rank_summary of the plan's cu_seqlens)."""
    import plan_groupings

    cu = jax.jit(jax.shard_map(lambda i: plan(i, cfg).cu_seqlens, mesh=mesh, in_specs=P("ep"),
                               out_specs=P("ep")))(topk_idx)
    return plan_groupings.rank_summary(np.asarray(cu), 0, 1, tile_m, E=cfg.num_experts)


def run_ncu(args, shape: Shape, out_dir: pathlib.Path, stem: str) -> dict:
    """Re-runs this script under ncu for exactly one step (`--ncu-child`: two warm-up steps, then
    one inside the NVTX range "step"), as shared/examples/profile_layer/run_ncu.sh does, and folds
    the per-kernel times (gpu__time_duration.sum) into NCU_CATEGORIES. Runs before this process
    touches the GPU (XLA's preallocation would leave the child no memory)."""
    import re

    result = {"maxvio_target": args.ncu_maxvio, "categories_by": "re.search of NCU_CATEGORIES on "
              "the kernel name, first match", "categories_regex": dict(NCU_CATEGORIES)}
    argv = [str(pathlib.Path(__file__).resolve()), "--ncu-child", "--ncu-maxvio",
            str(args.ncu_maxvio)] + (["--quick"] if args.quick else [])
    try:
        command = _common.ncu_command(["--nvtx", "--nvtx-include", "step/"], argv)
    except FileNotFoundError as e:
        return {**result, "status": f"skipped: {e}"}
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / f"{stem}_ncu.csv"
    result.update(ncu=command[0], command=" ".join(command), csv=str(csv_path))
    t0 = time.perf_counter()
    print(f"ncu: one step at maxvio {args.ncu_maxvio} (up to {args.ncu_timeout:.0f} s)", flush=True)
    returncode, stderr = _common.run_under_ncu(command, csv_path, args.ncu_timeout)
    result["seconds"] = time.perf_counter() - t0
    if returncode is None:
        return {**result, "status": f"failed: ncu run over {args.ncu_timeout:.0f} s"}
    result["stderr_tail"] = stderr[-1500:]
    launches = _common.ncu_kernel_times(csv_path)
    if returncode != 0 or not launches:
        return {**result, "status": f"failed: ncu rc {returncode}, {len(launches)} launches"}
    per_name: dict[str, list] = {}
    for name, ms in launches:
        entry = per_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += ms

    def short(name: str) -> str:
        name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
        return name.split("(")[0][:120]

    categories = {c: {"ms": 0.0, "launches": 0, "kernels": []} for c, _ in NCU_CATEGORIES}
    for name, (count, ms) in sorted(per_name.items(), key=lambda kv: -kv[1][1]):
        cat = next(c for c, pattern in NCU_CATEGORIES if re.search(pattern, name))
        categories[cat]["ms"] += ms
        categories[cat]["launches"] += count
        categories[cat]["kernels"].append({"name": short(name), "launches": count, "ms": ms})
    total = sum(ms for _, ms in launches)
    result.update(status="ok", total_kernel_ms=total, num_launches=len(launches),
                  categories=categories,
                  launch_order=[{"name": short(n), "ms": ms} for n, ms in launches])
    print(f"ncu: {total:.2f} ms of kernels in {len(launches)} launches")
    for cat, c in categories.items():
        print(f"  {cat:18s} {c['ms']:8.2f} ms  {c['launches']:4d} launches")
    return result


def ncu_child(args) -> None:
    """The profiled process: the one-GPU step, two warm-ups, one step inside NVTX range "step"."""
    push, pop, _ = nvtx_push_pop()
    shape = one_gpu_quick_shape() if args.quick else ONE_GPU
    implementation = "cuda" if jax.default_backend() == "gpu" and _ffi.available() else "xla"
    mesh, cfg, (x, topk_w, w_gate_up, w_down, d_out), step, _ = one_gpu_problem(shape,
                                                                                 implementation)
    topk_idx, _, _ = one_gpu_routing(mesh, shape, args.ncu_maxvio)
    step_args = (x, topk_idx, topk_w, w_gate_up, w_down, d_out)
    compiled = step.lower(*step_args).compile()
    for _ in range(2):
        jax.block_until_ready(compiled(*step_args))
    push("step")
    jax.block_until_ready(compiled(*step_args))
    pop()
    print("ncu child: done", file=sys.stderr, flush=True)


def main_one_gpu(args) -> None:
    shape = one_gpu_quick_shape() if args.quick else ONE_GPU
    reps = args.reps if args.reps is not None else 20
    tag = None
    ncu = None
    outs = [pathlib.Path(__file__).parent / "results"] + ([args.out] if args.out else [])
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(124))  # runs `finally`s
    if args.ncu:  # first: this process has not touched the GPU yet
        ncu_stem = "bench_layer_onegpu" + ("_quick" if args.quick else "")
        ncu = run_ncu(args, shape, args.out or pathlib.Path("/tmp"), ncu_stem)
    cuda = jax.default_backend() == "gpu" and _ffi.available()
    implementation = "cuda" if cuda else "xla"
    if not cuda and not args.quick:
        print("bench_layer --one-gpu: skipped, the record shape needs the CUDA extension and a GPU "
              f"(backend {jax.default_backend()!r}; {_ffi.unavailable_reason() or 'extension built'}"
              "); --quick runs a tiny shape with the xla implementation")
        return
    devices = jax.devices()
    tag = ("".join(c if c.isalnum() else "_" for c in devices[0].device_kind) + "x1"
           if jax.default_backend() == "gpu" else "cpux1")
    stem = (f"bench_layer_{tag}_onegpu" + ("_command_buffers" if args.command_buffers else "")
            + ("_quick" if args.quick else ""))
    tile_m = plan_tile_m()
    mesh, cfg, (x, topk_w, w_gate_up, w_down, d_out), step, forward = one_gpu_problem(
        shape, implementation)
    K, S, H, F = shape.K, shape.S, shape.H, shape.F
    flops_fwd = 2.0 * S * K * (H * 2 * F + F * H)
    record = {"schema": "moonep_jax.bench_layer_one_gpu/2", **_common.provenance(),
              "mode": "one_gpu", "gpu_used": f"{devices[0].device_kind} x1 (jax.devices()[0] of "
              f"{len(devices)})", "process": "one process, one device; mesh ('ep',) of size 1",
              "equivalent_to": "EP=2's per-rank work at the record shape (S=8192, K=8, E=384 "
                               "over 2 ranks: 192 local experts, S*K = 65536 rows per rank)",
              "shape": dataclasses.asdict(shape), "dtype": "bfloat16", "num_ranks": 1,
              "implementation": implementation, "nvs": cfg.nvs, "prefetch_slots": cfg.num_slots,
              "tile_m": tile_m, "reps": reps, "warmups": 2,
              "gpu_clocks": _common.CLOCKS_METHOD,
              "timing": "median wall ms of reps calls of the compiled step after 2 warm-up calls, "
                        "each until ready; the maxvio points timed round-robin (call i of every "
                        "point before call i+1 of any: benchmarks/_common.py time_round_robin)",
              # Per method, one window over its round-robin timing: the points' calls
              # interleave, so no point has clocks of its own.
              "gpu_clocks_of_all_points": {},
              "xla_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
              "xla_flags": os.environ.get("XLA_FLAGS"),
              "routing": ONE_GPU_ROUTING,
              "step": "jax.jit(jax.value_and_grad) of sum(out * d_out) (fp32) w.r.t. x, topk_w, "
                      "w_gate_up, w_down (the value keeps the forward's output computed); "
                      "forward = the same loss without grad",
              "dense_floor_method": "the same S*K rows through ONE dense SwiGLU expert: rows @ "
                                    "W_gu [H, 2F], SwiGLU (fp32 math, bf16 out), @ W_down [F, H], "
                                    "loss sum(y * d_rows) in fp32, jax.value_and_grad w.r.t. rows "
                                    "and both weights (6 dense GEMMs); timed before and after the "
                                    "layer, median over both",
              "flops_fwd": flops_fwd, "points": [], "ncu": ncu}

    def write():
        for out in outs:
            _common.write_json(out / f"{stem}.json", record)

    print(f"one GPU: {record['gpu_used']}, {implementation}, shape {shape}", flush=True)
    t0 = time.perf_counter()
    dense_step, dense_fwd, dense_args = dense_floor(shape)
    dense_step, dense_fwd = (dense_step.lower(*dense_args).compile(),
                             dense_fwd.lower(*dense_args).compile())
    dense = {"fwd_bwd": timed(dense_step, dense_args, reps), "fwd": timed(dense_fwd, dense_args,
                                                                         reps)}
    record["dense_floor"] = {"memory": memory_of(dense_step)}
    print(f"dense floor: fwd+bwd {dense['fwd_bwd']['median_ms']:.3f} ms, fwd "
          f"{dense['fwd']['median_ms']:.3f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)

    memory, point_args = {}, []
    for maxvio in MAXVIOS:
        topk_idx, sigma, realised = one_gpu_routing(mesh, shape, maxvio)
        point_args.append((x, topk_idx, topk_w, w_gate_up, w_down, d_out))
        record["points"].append({"maxvio_target": maxvio, "maxvio_measured": realised,
                                 "sigma": sigma, "results": [],
                                 "groups": plan_groups(cfg, mesh, topk_idx, tile_m)})
    # One compile per method (shapes do not depend on maxvio); the points timed round-robin.
    for name, fn in (("moonep fwd+bwd", step), ("moonep fwd", forward)):
        try:
            compiled = fn.lower(*point_args[0]).compile()
            memory[name] = memory_of(compiled)
            with _common.gpu_clocks() as clocks:
                results = _common.time_round_robin(compiled, point_args, reps, warmups=2)
        except Exception as e:  # noqa: BLE001  (recorded, the other method still runs)
            results = [{"status": f"failed: {type(e).__name__}: {str(e)[:400]}"}] * len(MAXVIOS)
            clocks = {"status": "not timed"}
        record["gpu_clocks_of_all_points"][name] = clocks
        for point, result in zip(record["points"], results):
            point["results"].append({"method": name, **result})
            print(f"maxvio {point['maxvio_target']:5.1f} {name:15s} "
                  f"{result.get('median_ms', float('nan')):9.3f} ms {result['status'][:120]}",
                  flush=True)
        write()
    if jax.default_backend() == "gpu":
        stats = devices[0].memory_stats() or {}
        record["process_peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    for kind, fn in (("fwd_bwd", dense_step), ("fwd", dense_fwd)):  # again after the layer
        again = timed(fn, dense_args, reps)
        dense[kind]["gpu_clocks_after"] = again["gpu_clocks"]
        dense[kind]["times_ms"] += again["times_ms"]
        dense[kind]["median_ms"] = float(np.median(dense[kind]["times_ms"]))
    record["dense_floor"].update(
        fwd_bwd=dense["fwd_bwd"], fwd=dense["fwd"],
        fwd_bwd_tflops=3 * flops_fwd / (dense["fwd_bwd"]["median_ms"] * 1e-3) / 1e12,
        fwd_tflops=flops_fwd / (dense["fwd"]["median_ms"] * 1e-3) / 1e12)
    record["memory"] = {name: m for name, m in memory.items()}
    record["memory_source"] = ("compiled.memory_analysis(): argument + output + temp - alias "
                               "bytes; process_peak_bytes_in_use is the device allocator's peak "
                               "over the whole run")
    for point in record["points"]:
        for r, floor in zip(point["results"], ("fwd_bwd", "fwd")):
            if r["status"] == "ok":
                r["ratio_to_dense_floor"] = r["median_ms"] / dense[floor]["median_ms"]
        point["results"] += [{"method": "dense floor fwd+bwd", "status": "ok",
                              "median_ms": dense["fwd_bwd"]["median_ms"]},
                             {"method": "dense floor fwd", "status": "ok",
                              "median_ms": dense["fwd"]["median_ms"]}]
    steps = [p["results"][0]["median_ms"] for p in record["points"]
             if p["results"][0]["status"] == "ok"]
    if steps:
        record["summary"] = {"fwd_bwd_ms": steps, "max_over_min": max(steps) / min(steps),
                             "ratio_to_dense_floor": [s / dense["fwd_bwd"]["median_ms"]
                                                      for s in steps],
                             "dense_floor_fwd_bwd_ms": dense["fwd_bwd"]["median_ms"],
                             "dense_floor_fwd_ms": dense["fwd"]["median_ms"]}
    record["seconds"] = time.perf_counter() - t0
    write()
    print("ms, as a README table:")
    print("| maxvio (measured) | M tiles | fwd+bwd | dense floor | ratio | fwd | dense fwd | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for p in record["points"]:
        fb, fw = p["results"][0], p["results"][1]
        print(f"| {p['maxvio_measured']:.2f} | {p['groups']['m_tiles']} | "
              f"{fb.get('median_ms', float('nan')):.1f} | {dense['fwd_bwd']['median_ms']:.1f} | "
              f"{fb.get('ratio_to_dense_floor', float('nan')):.2f}x | "
              f"{fw.get('median_ms', float('nan')):.1f} | {dense['fwd']['median_ms']:.1f} | "
              f"{fw.get('ratio_to_dense_floor', float('nan')):.2f}x |")
    if ncu and ncu.get("status") == "ok":
        print(f"ncu, one step at maxvio {ncu['maxvio_target']:g}: {ncu['total_kernel_ms']:.1f} ms "
              f"of kernels in {ncu['num_launches']} launches")
        print("| kernels | ms | launches |\n|---|---|---|")
        for cat, c in ncu["categories"].items():
            print(f"| {cat} | {c['ms']:.2f} | {c['launches']} |")
    elif ncu:
        print(f"ncu: {ncu.get('status')}")
    print(f"dense floor: fwd+bwd {dense['fwd_bwd']['median_ms']:.2f} ms, fwd "
          f"{dense['fwd']['median_ms']:.2f} ms; memory of the step (GB): " +
          ", ".join(f"{n} {m.get('total_bytes', 0) / 1e9:.1f}" for n, m in memory.items()))
    for out in outs:
        plot(record, out / f"{stem}.png")
    print(f"wrote {', '.join(str(o / stem) + '.json' for o in outs)} ({record['seconds']:.0f} s)")


# ---- --processes N: one EP rank per process ----------------------------------------------------

# Fits N=2 processes' weights, replica slots, gradients and activations in one H200 with room to
# spare (the record shape needs most of a GPU per rank): 64 local experts, S*K = 32768 rows.
PROCESS_SHAPE = Shape(S=4096, H=7168, K=8, E=128, F=2048)
# Two ends of the sweep, to keep the run on one shared GPU short.
PROCESS_MAXVIOS = (1.0, 20.0)
PROCESS_REPS = 5


def process_methods(cfg, mesh, skip: list[str]) -> tuple[dict, dict]:
    """What `--processes` times, `{name: (jitted step, reps or None)}` in the order to run them
    (ragged_a2a_dot last, as in the single-process mode: its NCCL fallback can hang), and why the
    others are left out. Where XLA's collectives work between the ranks every method takes the
    single-process mode's `training_step`; on one shared GPU only moe_ffn runs, each rank pulling
    back its own d_out (`per_rank_training_step`)."""
    own = f"moonep_{cfg.implementation}"
    if not _processes.collectives_work():
        return ({own: (per_rank_training_step(moonep_layer(cfg), mesh), None)},
                _processes.skipped_methods(("a2a_pad_gmm", "ragged_a2a_dot"),
                                           _processes.NCCL_REFUSES))
    skipped = _processes.untimed_implementation()
    gemm = cuda_grouped_matmul() if cfg.implementation == "cuda" else ragged_dot_gemm
    methods = {own: (training_step(moonep_layer(cfg), mesh), None),
               "a2a_pad_gmm": (training_step(a2a_pad_layer(cfg, gemm), mesh), None),
               "ragged_a2a_dot": (training_step(ragged_a2a_layer(cfg), mesh), 1)}
    for name in skip:
        skipped[name] = skipped_on_request(name)
        methods.pop(name, None)
    return methods, skipped


def run_ranks(args) -> None:
    """One EP rank of `--processes N` (every process of the launched job runs this): each method's
    forward + backward timed on this rank at each maxvio, one method after another (compiled once,
    freed before the next); process 0 gathers every rank's times and writes the record after each
    point. A method that raises is recorded as failed and not run again; one that hangs (a
    collective that never completes) ends the job after its watchdog, its point recorded."""
    mesh = _processes.ep_mesh()
    R, rank, first = mesh.size, _processes.my_rank(mesh), jax.process_index() == 0
    impl = _processes.implementation()
    full = _processes.my_placement() == "gpu_each"  # a GPU per rank holds the record shape
    shape = quick_shape(R) if args.quick else RECORD if full else PROCESS_SHAPE
    cfg = moonep_jax.EPConfig(num_experts=shape.E, top_k=shape.K, tokens_per_rank=shape.S,
                              hidden=shape.H, ffn_hidden=shape.F, num_ranks=R,
                              implementation=impl, cuda=_processes.cuda_options())
    methods, skipped = process_methods(cfg, mesh, args.skip)
    collective = _processes.collectives_work()
    reps = args.reps or PROCESS_REPS
    record = {"schema": "moonep_jax.bench_layer_processes/3", **_processes.provenance(R),
              "shape": dataclasses.asdict(shape), "dtype": "bfloat16", "num_ranks": R,
              "implementation": impl, "nvs": cfg.nvs, "prefetch_slots": cfg.num_slots,
              "reps": reps, "xla_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
              "step": ("jax.value_and_grad of sum(out * d_out) w.r.t. x, topk_w, w_gate_up, "
                       "w_down (the single-process mode's step)" if collective else
                       "jax.jit(jax.shard_map) of jax.vjp of the layer, each rank pulling back its "
                       "d_out (= the gradients of sum(out * d_out)) w.r.t. x, topk_w, w_gate_up, "
                       "w_down"),
              "methods": list(methods), "skipped_methods": skipped,
              "not_measured": {"prefetch": "prefetch bandwidth: single-process runs only"},
              "points": []}
    stem = _processes.stem("bench_layer", R, args.quick)
    outs = [args.out] if args.out else [pathlib.Path(__file__).parent / "results"]

    def write():
        for out in outs:
            _common.write_json(out / f"{stem}.json", record)

    if first:
        print(f"bench_layer --processes {R}: {record['process_layout']}, shape {shape}, {impl}, "
              f"B={cfg.num_slots}, methods {', '.join(methods)}\n  NOTE: "
              f"{record['timing_note']}", flush=True)
    x, topk_w, w_gate_up, w_down, d_out = _processes.draw_on_rank(
        mesh, rank, lambda key: draw_inputs(key, shape, shape.S, shape.E // R))
    routings = []
    for maxvio in args.maxvios:
        topk_idx, sigma, realised = routing.lognormal_for_maxvio(
            jax.random.key(1234), R, shape.S, shape.K, shape.E, maxvio)
        routings.append(_processes.put(mesh, np.asarray(topk_idx).reshape(R * shape.S, shape.K)))
        record["points"].append({"maxvio_target": maxvio, "maxvio_measured": realised,
                                 "sigma": sigma, "results": []})
    barrier = _processes.barrier("bench_layer")
    for name, (step, method_reps) in methods.items():
        # Dropping the previous method's executable here frees it before this one compiles.
        compiled, memory, failure = None, None, None
        for i, (topk_idx, point) in enumerate(zip(routings, record["points"])):
            timer = hang_watchdog(name, METHOD_BUDGET_S[name] + RAGGED_HANG_S, point,
                                  write if first else None)
            mine = {"rank": rank}
            if failure is None:
                step_args = (x, topk_idx, topk_w, w_gate_up, w_down, d_out)
                try:
                    if compiled is None:  # shapes do not depend on maxvio: one compile
                        compiled = _processes.compiled_together(step, step_args, barrier)
                        memory = memory_of(compiled)
                    mine.update(times_ms=_common.time_calls(compiled, step_args,
                                                            method_reps or reps, barrier),
                                memory=memory)
                except Exception as e:  # noqa: BLE001  (recorded, not fatal)
                    failure = f"failed: {type(e).__name__}: {str(e)[:400]}"
            timer.cancel()
            mine["status"] = failure or "ok"
            everyone = _processes.gather(f"bench_layer/{name}/point{i}", mine)
            if first:
                point["results"].append(point_result(name, everyone))
                write()
                print_result(point, point["results"][-1])
    if first:
        print(f"  NOTE: {record['timing_note']}\nwrote "
              f"{', '.join(str(o / stem) + '.json' for o in outs)}", flush=True)


def point_result(name: str, everyone: list[dict]) -> dict:
    """One method's result at one point from every rank's (status, times): the max over ranks of
    the medians when all ran, else the first failure."""
    failed = [v for v in everyone if v["status"] != "ok"]
    if failed:
        return {"method": name, "status": f"rank {failed[0]['rank']}: {failed[0]['status']}"}
    per_rank = sorted(({"rank": v["rank"], "times_ms": v["times_ms"],
                        "median_ms": float(np.median(v["times_ms"])), "memory": v["memory"]}
                       for v in everyone), key=lambda v: v["rank"])
    return {"method": name, "status": "ok", **_processes.across_ranks(per_rank),
            "memory_source": "compiled.memory_analysis() per device"}


def print_result(point: dict, result: dict) -> None:
    outcome = (f"max over ranks {result['median_ms']:9.3f} ms (per rank "
               f"{', '.join(f'{t:.3f}' for t in result['median_ms_per_rank'])})"
               if result["status"] == "ok" else result["status"][:160])
    print(f"maxvio {point['maxvio_target']:5.1f} {result['method']:15s} fwd+bwd: {outcome}",
          flush=True)


def plan_tile_m() -> int:
    try:
        from moonep_jax._cuda import grouped_matmul as cuda_gmm

        return int(cuda_gmm.tile_m())
    except Exception:  # noqa: BLE001  (pure-Python install)
        return 256



def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape (CPU smoke test)")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="also write the JSON and PNG here (benchmarks/results always)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed steps per point (3; --one-gpu 20)")
    parser.add_argument("--skip", action="append", default=[], choices=sorted(METHOD_BUDGET_S),
                        help="methods not to run (recorded as skipped, with SKIP_REASONS' reason)")
    parser.add_argument("--one-gpu", action="store_true",
                        help="R=1 with E=192 (EP=2's per-rank work) against the dense floor, on "
                             "jax.devices()[0]; the default when there is one device")
    parser.add_argument("--ncu", action="store_true",
                        help="with --one-gpu (implied): first re-run one step under ncu and fold "
                             "its per-kernel times into the record (needs ncu and CuPy or "
                             "libnvToolsExt; about a minute more)")
    parser.add_argument("--ncu-maxvio", type=float, default=1.0,
                        help="the routing skew of the ncu step (default 1)")
    parser.add_argument("--ncu-timeout", type=float, default=NCU_TIMEOUT_S,
                        help=f"seconds for the ncu run (default {NCU_TIMEOUT_S})")
    parser.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--command-buffers", action="store_true",
                        help="with --one-gpu: XLA captures the step into CUDA graphs, the moonep "
                             "custom calls included (COMMAND_BUFFER_FLAGS; the dense floor runs "
                             "under the same flags); the record's name ends in _command_buffers")
    parser.add_argument("--processes", type=int, default=1,
                        help="one EP rank per process, N local processes (one GPU each where "
                             "the host has N, at RECORD; else all sharing GPU 0 under MPS at "
                             "PROCESS_SHAPE: not NVLink figures); the baselines too where "
                             "XLA's collectives work between the ranks (not on one shared GPU)")
    args = parser.parse_args()
    if args.command_buffers:  # before the first jax.devices(): XLA reads its flags at start-up
        os.environ["XLA_FLAGS"] = " ".join(
            filter(None, [os.environ.get("XLA_FLAGS"), COMMAND_BUFFER_FLAGS]))
    if args.ncu_child:
        ncu_child(args)
        return
    if args.processes > 1:
        args.maxvios = PROCESS_MAXVIOS
        # The baselines' budgets on top where they run (their compiles at the record shape).
        baselines = ("a2a_pad_gmm", "ragged_a2a_dot")
        extra_s = (sum(METHOD_BUDGET_S[b] for b in baselines if b not in args.skip)
                   if _processes.collectives_work(_processes.placement(args.processes)) else 0.0)
        _processes.spawn(__file__, "run_ranks", args.processes, args,
                         timeout_s=_processes.JOB_TIMEOUT_S + extra_s)
        return
    if args.one_gpu or args.ncu or len(jax.devices()) == 1:
        main_one_gpu(args)
        return
    args.reps = args.reps or 3

    R = len(jax.devices())
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    on_gpu = jax.default_backend() == "gpu"
    cuda = on_gpu and _ffi.available()
    shape = quick_shape(R) if args.quick else RECORD
    config = functools.partial(moonep_jax.EPConfig, num_experts=shape.E, top_k=shape.K,
                               tokens_per_rank=shape.S, hidden=shape.H, ffn_hidden=shape.F,
                               num_ranks=R)
    cfg_cuda, cfg_xla = config(implementation="cuda"), config(implementation="xla")

    methods, skipped, notes = [], {}, {}
    if cuda:
        from moonep_jax._cuda import transport

        transport.bootstrap(mesh, "ep")
        methods.append(Method("moonep_cuda", training_step(moonep_layer(cfg_cuda), mesh),
                              METHOD_BUDGET_S["moonep_cuda"]))
        gemm = cuda_grouped_matmul()
    else:
        skipped["moonep_cuda"] = "needs the CUDA extension and a GPU"
        gemm = ragged_dot_gemm
        notes["a2a_pad_gmm"] = "grouped GEMM replaced by lax.ragged_dot (no CUDA extension/GPU)"
    methods.append(Method("a2a_pad_gmm", training_step(a2a_pad_layer(cfg_xla, gemm), mesh),
                          METHOD_BUDGET_S["a2a_pad_gmm"]))
    if args.quick:
        methods.append(Method("moonep_xla", training_step(moonep_layer(cfg_xla), mesh),
                              METHOD_BUDGET_S["moonep_xla"]))
    else:
        skipped["moonep_xla"] = "masked-segment reference GEMM, far too slow at this shape"
    # One timed step: at ~7 TFLOP/s (ragged_dot) a step of the record shape takes seconds.
    methods.append(Method("ragged_a2a_dot", training_step(ragged_a2a_layer(cfg_xla), mesh),
                          METHOD_BUDGET_S["ragged_a2a_dot"], reps=1))
    for name in args.skip:
        skipped[name] = skipped_on_request(name)
    methods = [m for m in methods if m.name not in args.skip]

    record = {"schema": "moonep_jax.bench_layer/2", **_common.provenance(),
              "shape": dataclasses.asdict(shape), "dtype": "bfloat16", "num_ranks": R,
              "nvs": cfg_xla.nvs, "prefetch_slots": cfg_xla.num_slots, "reps": args.reps,
              "xla_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
              "step": "jax.value_and_grad of sum(out * d_out) w.r.t. x, topk_w, w_gate_up, w_down",
              "methods": [m.name for m in methods], "skipped_methods": skipped, "notes": notes,
              "points": []}
    stem = f"bench_layer_{_common.device_tag()}" + ("_quick" if args.quick else "")
    outs = [pathlib.Path(__file__).parent / "results"] + ([args.out] if args.out else [])

    def write():
        for out in outs:
            _common.write_json(out / f"{stem}.json", record)

    x, topk_w, w_gate_up, w_down, d_out = weights_and_tokens(mesh, shape)
    split = NamedSharding(mesh, P("ep"))
    points = {}
    for maxvio in MAXVIOS:
        topk_idx, sigma, realised = routing.lognormal_for_maxvio(
            jax.random.key(1234), R, shape.S, shape.K, shape.E, maxvio)
        topk_idx = jax.device_put(np.asarray(topk_idx).reshape(R * shape.S, shape.K), split)
        point = {"maxvio_target": maxvio, "maxvio_measured": realised, "sigma": sigma,
                 "results": []}
        if cuda:
            try:
                point["prefetch"] = prefetch_bandwidth(mesh, cfg_cuda, shape, topk_idx,
                                                       w_gate_up, w_down, args.reps)
            except Exception as e:  # noqa: BLE001
                point["prefetch"] = {"status": f"failed: {type(e).__name__}: {str(e)[:300]}"}
        points[maxvio] = (topk_idx, point)
        record["points"].append(point)
    write()

    for method in methods:  # ragged_a2a_dot last: a hang there cannot cost the other methods
        for maxvio, (topk_idx, point) in points.items():
            timer = hang_watchdog(method.name, RAGGED_HANG_S + method.budget_s, point, write)
            result = method.run((x, topk_idx, topk_w, w_gate_up, w_down, d_out), args.reps)
            timer.cancel()
            point["results"].append(result)
            write()
            outcome = (f"{result['median_ms']:9.3f} ms" if result["status"] == "ok"
                       else result["status"][:160])
            print(f"maxvio {maxvio:5.1f} {method.name:15s} {outcome}", flush=True)
        method.compiled = None  # free the executable before the next method compiles

    for point in record["points"]:
        for name in ("layer", "zero_unused"):
            measured = point.get("prefetch", {}).get(name)
            if measured:
                print(f"maxvio {point['maxvio_target']:5.1f} prefetch ({name}) "
                      f"{measured['median_ms']:.3f} ms {measured['gbps']:.0f} GB/s "
                      f"replicas {point['prefetch']['replicas_per_rank']}")
    for out in outs:
        plot(record, out / f"{stem}.png")
    print(f"wrote {', '.join(str(o / stem) + '.json' for o in outs)}")


if __name__ == "__main__":
    main()
