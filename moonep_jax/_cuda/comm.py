"""CUDA backends of the communication ops: zero-copy dispatch, combine, prefetch and reduce_grad.

Each function has the signature of docs/CONTRACT.md and runs inside `jax.shard_map` over the EP
axis, per rank. It is one XLA FFI call (`xla_ffi/<op>.cc`): the kernels publish the addresses of
XLA's own operand/result buffers to the peers, barrier, move rows over NVLink straight into (or out
of) those buffers, and barrier again on exit (a group of one rank skips the barriers). Result
types come from `jax.typeof(...)` so that they keep the operands' varying-mesh-axis annotation.

Every call also receives the transport attributes: `mesh_devices` (the JAX device ids of the
bootstrapped mesh, one row per EP group; the kernels find their EP rank in it), `num_ranks`,
`num_sms` (CTAs of the data kernels, `transport.comm_ctas`) and `timeout_ns` (bound of every
cross-GPU wait).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moonep_jax import _ffi
from moonep_jax._cuda import transport
from moonep_jax.config import EPConfig
from moonep_jax.plan_types import Plan

# Dtypes the kernels move as byte copies (dispatch, prefetch) and that combine sums in fp32.
_COPY_ITEMSIZES = (2, 4)
_SUM_DTYPES = (jnp.bfloat16, jnp.float32)


def _transport_attrs(cfg: EPConfig) -> dict:
    mesh_devices = transport.mesh_devices(cfg)
    return dict(
        mesh_devices=mesh_devices,
        num_ranks=np.int32(cfg.num_ranks),
        num_sms=np.int32(transport.comm_ctas(cfg, mesh_devices)),
        timeout_ns=np.int64(round(cfg.cuda.timeout_s * 1e9)),
    )


def _require_copyable(op: str, name: str, x: jax.Array) -> None:
    if jnp.dtype(x.dtype).itemsize not in _COPY_ITEMSIZES:
        raise NotImplementedError(
            f"`{op}` (implementation='cuda'): `{name}` must have a 2- or 4-byte dtype "
            f"(bfloat16, float16, float32); got {x.dtype}. Use implementation='xla'.")


def _require_summable(op: str, name: str, x: jax.Array) -> None:
    if x.dtype not in _SUM_DTYPES:
        raise NotImplementedError(
            f"`{op}` (implementation='cuda'): `{name}` must be bfloat16 or float32; got {x.dtype}. "
            "Use implementation='xla'.")


def dispatch(x: jax.Array, topk_w: jax.Array, plan: Plan,
                  cfg: EPConfig) -> tuple[jax.Array, jax.Array]:
    """Zero-copy dispatch: `x [S, H]`, `topk_w [S, K] f32` -> `(recv_x [NvS, H], recv_w [NvS] f32)`.

    Each receiver pulls every token it receives once from the token's rank and writes it, in the
    same pass, to the token's primary and duplicate rows; rows no entry owns are zeroed. A row
    whose plan disagrees with the source's `dst` is zeroed and reported as bad plan data.
    """
    _require_copyable("moonep_jax.dispatch", "x", x)
    recv_x = jax.typeof(x).update(shape=(cfg.nvs, x.shape[1]))
    recv_w = jax.typeof(x).update(shape=(cfg.nvs,), dtype=jnp.float32)
    return jax.ffi.ffi_call("moonep_dispatch", (recv_x, recv_w))(
        x, topk_w, plan.dst, plan.recv_src, plan.recv_primary, **_transport_attrs(cfg))


def combine(y: jax.Array, plan: Plan, cfg: EPConfig) -> jax.Array:
    """Combine: `y [NvS, H]` -> `[S, H]`, each token's rows summed where they are, then at home.

    Two-stage sum of docs/CONTRACT.md (per destination rank in ascending k, rounded to y's dtype,
    then over destinations in the order of their lowest k), bitwise equal to the xla reference.
    With `transport.combine_on_owner`, one row per (token, other destination rank) crosses the
    link: the rank holding two or more of a token's rows sums them (stage 1) and stores the
    partial into the home's `staging` (one slot per other rank that holds two or more of the
    token's rows: at most min(R - 1, K // 2)); the home reads a lone row in place, and sums its
    own rows' stage 1 itself. Otherwise, and with K = 1 (no rank holds two of a token's rows),
    `staging` has no slots and the home reads every row in place. `staging` is a second,
    discarded result of the call, so XLA allocates it for the call's duration only.
    """
    _require_summable("moonep_jax.combine", "y", y)
    S, H = cfg.tokens_per_rank, y.shape[1]
    attrs = _transport_attrs(cfg)
    slots = (min(cfg.num_ranks - 1, cfg.top_k // 2)
             if transport.combine_on_owner(cfg, attrs["mesh_devices"]) else 0)
    out = jax.typeof(y).update(shape=(S, H))
    staging = jax.typeof(y).update(shape=(S, slots, H))
    combined, _ = jax.ffi.ffi_call("moonep_combine", (out, staging))(
        y, plan.dst, top_k=np.int32(cfg.top_k), **attrs)
    return combined


def combine_weights(recv_w: jax.Array, plan: Plan, cfg: EPConfig) -> jax.Array:
    """Weight gather (dispatch backward): `recv_w [NvS] f32` -> `topk_w [S, K] f32`.

    `topk_w[t, k]` = the owner's `recv_w` at entry (t, k)'s own row (duplicates included); 0 for
    dropped entries.
    """
    topk_w = jax.typeof(recv_w).update(shape=(cfg.tokens_per_rank, cfg.top_k))
    return jax.ffi.ffi_call("moonep_combine_weights", topk_w)(
        recv_w, plan.dst, **_transport_attrs(cfg))


def prefetch(w_locals: tuple[jax.Array, ...], plan: Plan, cfg: EPConfig, *,
             zero_unused_slots: bool = True) -> tuple[jax.Array, ...]:
    """Zero-copy prefetch of several weight arrays in one call: `w_locals`, N arrays
    `[epn, ...]` (each its own trailing dims and dtype) -> their N `w_slots [B, ...]`, pulled
    from the homes.

    `w_slots[b]` is exactly the home rank's weights of `experts_to_copy[rank, b]`; unused slots are
    zero, or left unwritten with `zero_unused_slots=False` (moe_ffn: its GEMMs read only used
    slots, and zeroing B = epn slots costs more than the copies). One FFI call for all N arrays:
    one entry rendezvous publishing every `w_local`, one copy kernel (bulk TMA copies) over every
    (array, slot), one exit barrier. N is at most the op's mailbox slots (`MAX_PREFETCH_WEIGHTS`
    of the extension).
    """
    max_weights = _ffi.lib().MAX_PREFETCH_WEIGHTS
    if not 1 <= len(w_locals) <= max_weights:
        raise ValueError(f"`moonep_jax.prefetch` (implementation='cuda'): takes 1 to "
                         f"{max_weights} weight arrays per call; got {len(w_locals)}.")
    for i, w_local in enumerate(w_locals):
        _require_copyable("moonep_jax.prefetch", f"w_locals[{i}]", w_local)
    w_slots = tuple(jax.typeof(w).update(shape=(cfg.num_slots,) + tuple(w.shape[1:]))
                    for w in w_locals)
    return tuple(jax.ffi.ffi_call("moonep_prefetch", w_slots)(
        plan.experts_to_copy, *w_locals, zero_unused_slots=np.int32(zero_unused_slots),
        **_transport_attrs(cfg)))


def reduce_grad(g: jax.Array, g_slots: jax.Array, plan: Plan, cfg: EPConfig, *,
                     g_partial: jax.Array | None = None) -> jax.Array:
    """Zero-copy gradient reduction into `g [epn, D0, D1]` (f32, or bf16 with `g_partial`).

    For every expert e that some (source rank r, slot b) replicates: `g_partial[e]` (fp32; `g`
    itself when None), then for (r, b) ascending with `experts_to_copy[r, b] == e`, `+= g_slots
    of rank r [b]` in fp32, read in place from rank r, rounded to g's dtype once (bitwise equal
    to the xla reference). The other experts keep `g`, untouched: the result is written over `g`
    (aliased), so an expert without replicas costs neither a read nor a write.
    """
    if g_partial is None:
        g_partial = jnp.zeros((0,) + g.shape[1:], jnp.float32)  # the handler reads g instead
    return jax.ffi.ffi_call("moonep_reduce_grad", jax.typeof(g), input_output_aliases={0: 0})(
        g, g_partial, g_slots, plan.experts_to_copy, **_transport_attrs(cfg))
