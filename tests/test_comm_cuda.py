"""The CUDA zero-copy dispatch, combine, prefetch and reduce_grad against the xla reference.

Runs on 1 and 2 GPUs (R = 1 and R = 2; a test skips when fewer GPUs exist). Plans come from the
xla planner, so these tests isolate the communication kernels. Both implementations run in the
same jitted program on the same inputs and are compared with `np.array_equal`; combine is also
checked against an fp32 reference built on the host, and prefetch / reduce_grad against NumPy.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import moonep_jax
from moonep_jax import _checks, routing
from moonep_jax.combine import combine
from moonep_jax.dispatch import dispatch
from moonep_jax.experts import prefetch, reduce_grad
from moonep_jax.plan import plan

pytestmark = pytest.mark.gpu

IMPLS = ("xla", "cuda")
MAXVIOS = (0.0, 0.2, 1.0, 10.0, 20.0)
# (dtype, H, maxvio): the sweep on 16-byte rows, then rows of 4-byte (f32, H=100) and 2-byte
# (bf16, H=7) multiples, which take the narrower copy paths.
ROW_CASES = ([(jnp.bfloat16, 256, maxvio) for maxvio in MAXVIOS]
             + [(jnp.float32, 100, 10.0), (jnp.bfloat16, 7, 1.0)])
# E / K = 32 > 21, so a maxvio of 20 is reachable with K distinct experts per token.
S, K, E = 96, 4, 128


def _config(R: int, impl: str, H: int = 256, **overrides) -> moonep_jax.EPConfig:
    kwargs = dict(num_experts=E, top_k=K, tokens_per_rank=S, hidden=H, ffn_hidden=16,
                  num_ranks=R, token_padding=2, implementation=impl)
    kwargs.update(overrides)
    return moonep_jax.EPConfig(**kwargs)


def _configs(R: int, **overrides) -> dict[str, moonep_jax.EPConfig]:
    return {impl: _config(R, impl, **overrides) for impl in IMPLS}


@pytest.fixture(params=[1, 2], ids=["R1", "R2"])
def mesh(request, mesh_factory):
    from moonep_jax._cuda import transport

    mesh = mesh_factory(request.param)
    transport.bootstrap(mesh, "ep")
    return mesh


def _routing(seed: int, R: int, maxvio: float, cfg: moonep_jax.EPConfig) -> np.ndarray:
    """Global `[R * S, K]` ids at about `maxvio`, with repeated ids in 20% of the tokens and 10%
    of the entries dropped (-1)."""
    key = jax.random.key(seed)
    S_, K_, E_ = cfg.tokens_per_rank, cfg.top_k, cfg.num_experts
    topk_idx, _, _ = routing.lognormal_for_maxvio(key, R, S_, K_, E_, maxvio)
    topk_idx = routing.with_duplicates(jax.random.fold_in(key, 1), topk_idx, 0.2)
    topk_idx = routing.with_dropped(jax.random.fold_in(key, 2), topk_idx, 0.1)
    return np.asarray(topk_idx).reshape(R * S_, K_)


def _per_rank(fn, mesh):
    """jit(shard_map(fn)) with every operand and output split over "ep" on the leading axis."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def _stack(tree):
    """Gives every leaf a leading rank axis of 1, so that out_specs=P("ep") stacks the ranks."""
    return jax.tree.map(lambda leaf: leaf[None], tree)


def _poison_allocator(mesh, nbytes_per_rank: int) -> None:
    """Allocates and frees NaN-filled buffers so that fresh XLA buffers likely start as NaN."""
    sharding = jax.NamedSharding(mesh, P("ep"))
    n = mesh.devices.size * (nbytes_per_rank // 4 + 1)
    jax.device_put(np.full(n, np.nan, np.float32), sharding).block_until_ready()


# ---- dispatch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,H,maxvio", ROW_CASES)
def test_dispatch_rows_and_weights_bitwise_equal_to_xla(mesh, seed, maxvio, dtype, H):
    R = mesh.devices.size
    cfgs = _configs(R, H=H)
    rng = np.random.default_rng(seed)
    topk_idx = _routing(seed, R, maxvio, cfgs["xla"])
    x = rng.standard_normal((R * S, H)).astype(dtype)
    topk_w = rng.random((R * S, K), np.float32) + 0.5

    def per_rank(topk_idx, x, topk_w):
        p = plan(topk_idx, cfgs["xla"])
        out = {impl: dispatch(x, topk_w, p, cfg) for impl, cfg in cfgs.items()}
        return _stack((out, p.recv_src))

    _poison_allocator(mesh, 4 * cfgs["xla"].nvs * H)
    out, recv_src = _per_rank(per_rank, mesh)(topk_idx, x, topk_w)
    for xla_result, cuda_result in zip(out["xla"], out["cuda"]):
        np.testing.assert_array_equal(np.asarray(cuda_result), np.asarray(xla_result))
    # Rows no entry owns (padding with tp = 2, the tail) are zero, not left over memory.
    unowned = np.asarray(recv_src) < 0
    assert unowned.any()
    assert not np.asarray(out["cuda"][0], np.float32)[unowned].any()
    assert not np.asarray(out["cuda"][1])[unowned].any()


def test_dispatch_overwrites_result_buffers_that_hold_old_rows(mesh, seed):
    """XLA may hand dispatch result buffers that hold earlier data. Here they are donated: NaN
    first, then the results of another routing, some of whose owned rows are padding now. Every
    row must be written: bitwise equal to xla, unowned rows zero."""
    R = mesh.devices.size
    cfgs = _configs(R)
    nvs, H = cfgs["xla"].nvs, cfgs["xla"].hidden
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R * S, H)).astype(jnp.bfloat16)
    topk_w = rng.random((R * S, K), np.float32) + 0.5

    def reference(topk_idx, x, topk_w):
        p = plan(topk_idx, cfgs["xla"])
        return _stack((dispatch(x, topk_w, p, cfgs["xla"]), p.recv_src))

    def into_old_buffers(topk_idx, x, topk_w, old_x, old_w):
        del old_x, old_w  # donated: XLA places the results in their buffers
        return _stack(dispatch(x, topk_w, plan(topk_idx, cfgs["xla"]), cfgs["cuda"]))

    cuda = jax.jit(jax.shard_map(into_old_buffers, mesh=mesh, in_specs=P("ep"),
                                 out_specs=P("ep")), donate_argnums=(3, 4), keep_unused=True)
    sharding = jax.NamedSharding(mesh, P("ep"))
    old = (jnp.full((R, nvs, H), jnp.nan, jnp.bfloat16, device=sharding),
           jnp.full((R, nvs), jnp.nan, jnp.float32, device=sharding))
    owned_before = None
    for maxvio in (20.0, 0.2):
        topk_idx = _routing(seed, R, maxvio, cfgs["xla"])
        want, recv_src = _per_rank(reference, mesh)(topk_idx, x, topk_w)
        buffers = [[s.data.unsafe_buffer_pointer() for s in a.addressable_shards] for a in old]
        got = cuda(topk_idx, x, topk_w, *old)
        assert [[s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
                for a in got] == buffers, "XLA did not place the results in the donated buffers"
        for cuda_result, xla_result in zip(got, want):
            np.testing.assert_array_equal(np.asarray(cuda_result), np.asarray(xla_result))
        owned = np.asarray(recv_src) >= 0
        assert not np.asarray(got[0], np.float32)[~owned].any()
        if owned_before is not None:
            assert (owned_before & ~owned).any()  # old rows now in padding positions
        owned_before, old = owned, got


@pytest.mark.parametrize("corruption", ["duplicate_recv_primary", "primary_recv_src"])
def test_dispatch_zeroes_and_reports_rows_whose_plan_disagrees_with_the_source(mesh, seed,
                                                                               corruption):
    """On each rank, the first duplicate row gets recv_primary -1 (not a row), or its primary row
    a recv_src naming another entry of the same source (one the source's dst does not point
    back from). Those rows (and the primary's duplicates) are zeroed and reported with the row;
    every other row is bitwise the xla result."""
    R = mesh.devices.size
    cfgs = _configs(R)
    nvs, H = cfgs["xla"].nvs, cfgs["xla"].hidden
    rng = np.random.default_rng(seed)
    topk_idx = _routing(seed, R, 10.0, cfgs["xla"])
    x = rng.standard_normal((R * S, H)).astype(jnp.bfloat16)
    topk_w = rng.random((R * S, K), np.float32) + 0.5

    def per_rank(topk_idx, x, topk_w):
        p = plan(topk_idx, cfgs["xla"])
        want_x, want_w = dispatch(x, topk_w, p, cfgs["xla"])
        rows = jnp.arange(nvs)
        is_duplicate = (p.recv_primary != rows) & (p.recv_src >= 0)
        duplicate = jnp.argmax(is_duplicate)
        primary = p.recv_primary[duplicate]
        if corruption == "duplicate_recv_primary":
            bad = dataclasses.replace(p, recv_primary=p.recv_primary.at[duplicate].set(-1))
            zeroed, value = rows == duplicate, jnp.int32(-1)
        else:  # entry i ^ 1 of the same source: N is even
            bad = dataclasses.replace(p, recv_src=p.recv_src.at[primary].set(
                p.recv_src[primary] ^ 1))
            zeroed = (rows == primary) | ((p.recv_primary == primary) & is_duplicate)
            value = primary
        got = dispatch(x, topk_w, bad, cfgs["cuda"])
        want = (jnp.where(zeroed[:, None], jnp.zeros((), x.dtype), want_x),
                jnp.where(zeroed, 0.0, want_w))
        return _stack((got, want, is_duplicate.any(), value))

    assert S * K % 2 == 0
    moonep_jax.check_transport_errors()  # nothing left over from other tests
    got, want, has_duplicate, value = _per_rank(per_rank, mesh)(topk_idx, x, topk_w)
    assert np.asarray(has_duplicate).all()
    for cuda_result, expected in zip(got, want):
        np.testing.assert_array_equal(np.asarray(cuda_result), np.asarray(expected))
    what = {"duplicate_recv_primary": r"plan\.recv_primary is not a primary row",
            "primary_recv_src": r"plan\.dst disagrees with plan\.recv_src"}[corruption]
    with pytest.raises(moonep_jax.TransportError) as error:
        moonep_jax.check_transport_errors()
    for rank, v in enumerate(np.asarray(value)):
        assert re.search(rf"bad plan data at EP rank {rank}, epoch \d+: {what} \(value {v}\)",
                         str(error.value)), str(error.value)
    moonep_jax.check_transport_errors()  # cleared by the read


def test_bad_plan_data_is_skipped_and_reported_by_check_transport_errors(mesh, seed):
    """A dst naming a rank outside the group is skipped on the device (never written through)
    and recorded; the host reads the record at `check_transport_errors()`, which clears it."""
    R = mesh.devices.size
    cfg = _config(R, "cuda")
    topk_idx = _routing(seed, R, 1.0, cfg)
    x = np.ones((R * S, cfg.hidden), jnp.bfloat16)
    topk_w = np.ones((R * S, K), np.float32)
    bad = R * cfg.nvs + 5  # decodes to rank R: outside the group

    def per_rank(topk_idx, x, topk_w):
        p = plan(topk_idx, dataclasses.replace(cfg, implementation="xla"))
        p = dataclasses.replace(p, dst=p.dst.at[0].set(bad))
        return _stack(dispatch(x, topk_w, p, cfg)[:2])

    moonep_jax.check_transport_errors()  # nothing left over from other tests
    jax.block_until_ready(_per_rank(per_rank, mesh)(topk_idx, x, topk_w))
    with pytest.raises(moonep_jax.TransportError,
                       match=r"bad plan data at EP rank \d+, epoch \d+: plan\.dst names a rank "
                             rf"outside the group \(value {bad}\)"):
        moonep_jax.check_transport_errors()
    moonep_jax.check_transport_errors()  # cleared by the read


# ---- combine ------------------------------------------------------------------------------------


def _bf16_ulp(value: np.ndarray) -> np.ndarray:
    """Spacing of bfloat16 numbers (8 significant bits) at |value|."""
    exponent = np.floor(np.log2(np.maximum(np.abs(value), np.finfo(np.float32).tiny)))
    return np.exp2(exponent - 7)


def _entry_rows(y: np.ndarray, dst: np.ndarray, nvs: int):
    """Every entry's row `[R, S, K, H]` (from all ranks' y), its destination rank and validity."""
    R = y.shape[0]
    dst = dst.reshape(R, S, K).astype(np.int64)
    valid = dst != moonep_jax.DROPPED
    raw = np.where(valid, np.where(dst >= 0, dst, -dst - 1), 0)
    dest = np.where(valid, raw // nvs, -1)
    return y[raw // nvs, raw % nvs], dest, valid


def _fp32_combine_reference(y: np.ndarray, dst: np.ndarray, nvs: int) -> np.ndarray:
    """`[R, S, H]` float64 exact sums of every token's valid entries' rows."""
    rows, _, valid = _entry_rows(y, dst, nvs)
    return np.where(valid[..., None], rows.astype(np.float64), 0.0).sum(axis=2)


def _two_stage_combine_oracle(y: np.ndarray, dst: np.ndarray, nvs: int) -> np.ndarray:
    """docs/CONTRACT.md's combine in NumPy float32: per destination rank, the rows in ascending k
    summed from +0.0 and rounded to y's dtype; those partials summed in the order of their lowest
    k, rounded again."""
    rows, dest, valid = _entry_rows(y, dst, nvs)
    rows = rows.astype(np.float32)
    out = np.zeros(rows.shape[:2] + rows.shape[3:], np.float32)
    for k in range(K):
        same = [valid[:, :, k] & (dest[:, :, j] == dest[:, :, k]) for j in range(K)]
        leads = valid[:, :, k].copy()
        for j in range(k):
            leads &= ~same[j]
        partial = np.zeros_like(out)
        for j in range(k, K):
            partial = np.where(same[j][..., None], partial + rows[:, :, j], partial)
        partial = partial.astype(y.dtype).astype(np.float32)
        out = np.where(leads[..., None], out + partial, out)
    return out.astype(y.dtype)


@pytest.mark.parametrize("dtype,H,maxvio", ROW_CASES)
def test_combine_bitwise_equal_to_two_stage_oracle_and_xla(mesh, seed, maxvio, dtype, H):
    R = mesh.devices.size
    cfgs = _configs(R, H=H)
    nvs = cfgs["xla"].nvs
    rng = np.random.default_rng(seed)
    topk_idx = _routing(seed, R, maxvio, cfgs["xla"])
    y = rng.standard_normal((R * nvs, H)).astype(dtype)

    def per_rank(topk_idx, y):
        p = plan(topk_idx, cfgs["xla"])
        return _stack(({impl: combine(y, p, cfg) for impl, cfg in cfgs.items()}, p.dst))

    # Fresh out and staging buffers ([S, min(R - 1, K // 2), H]: the owners' partials) start as NaN:
    # a row or slot left unwritten would show.
    _poison_allocator(mesh, 4 * S * H * (1 + min(R - 1, K // 2)))
    out, dst = _per_rank(per_rank, mesh)(topk_idx, y)
    oracle = _two_stage_combine_oracle(y.reshape(R, nvs, H), np.asarray(dst), nvs)
    np.testing.assert_array_equal(np.asarray(out["cuda"]), oracle)
    np.testing.assert_array_equal(np.asarray(out["cuda"]), np.asarray(out["xla"]))


def test_combine_skips_and_reports_bad_plan_data(mesh, seed):
    """A dst naming a rank outside the group counts as dropped, on its home and on every owner
    (which read the home's dst), and is recorded; the other entries' sums are exact."""
    R = mesh.devices.size
    cfgs = _configs(R)
    nvs = cfgs["xla"].nvs
    rng = np.random.default_rng(seed)
    topk_idx = _routing(seed, R, 1.0, cfgs["xla"])
    y = rng.standard_normal((R * nvs, cfgs["xla"].hidden)).astype(jnp.bfloat16)
    bad = R * nvs + 5  # decodes to rank R: outside the group

    def per_rank(topk_idx, y):
        p = plan(topk_idx, cfgs["xla"])
        bad_entries = jnp.arange(0, S * K, 7)
        as_dropped = dataclasses.replace(p, dst=p.dst.at[bad_entries].set(moonep_jax.DROPPED))
        with_bad = dataclasses.replace(p, dst=p.dst.at[bad_entries].set(bad))
        return _stack((combine(y, with_bad, cfgs["cuda"]), combine(y, as_dropped, cfgs["xla"])))

    moonep_jax.check_transport_errors()  # nothing left over from other tests
    _poison_allocator(mesh, 4 * S * cfgs["xla"].hidden * (1 + min(R - 1, K // 2)))
    cuda, xla = _per_rank(per_rank, mesh)(topk_idx, y)
    np.testing.assert_array_equal(np.asarray(cuda), np.asarray(xla))
    with pytest.raises(moonep_jax.TransportError,
                       match=rf"bad plan data at EP rank \d+, epoch \d+: plan\.dst names a rank "
                             rf"outside the group \(value {bad}\)"):
        moonep_jax.check_transport_errors()
    moonep_jax.check_transport_errors()  # cleared by the read


@pytest.mark.parametrize("maxvio", (0.2, 20.0))
def test_combine_within_one_and_a_half_bf16_ulp_of_fp32(mesh, seed, maxvio):
    """Two roundings (per destination rank, then the total) of same-sign terms: at most 1 ulp of
    the result plus 0.5 ulp per extra destination rank; with R <= 2, 1.5 ulp (MoonEP's bound)."""
    R = mesh.devices.size
    cfg = _config(R, "cuda")
    rng = np.random.default_rng(seed)
    topk_idx = _routing(seed, R, maxvio, cfg)
    x = rng.standard_normal((R * S, cfg.hidden)).astype(jnp.bfloat16)
    row_scale = (1.0 + (np.arange(cfg.nvs) % 7) / 8).astype(np.float32)

    def per_rank(topk_idx, x):
        p = plan(topk_idx, dataclasses.replace(cfg, implementation="xla"))
        recv_x, _ = dispatch(x, jnp.ones((S, K), jnp.float32), p, cfg)
        y = (recv_x.astype(jnp.float32) * row_scale[:, None]).astype(jnp.bfloat16)  # same signs
        return _stack((combine(y, p, cfg), y, p.dst))

    out, y, dst = map(np.asarray, _per_rank(per_rank, mesh)(topk_idx, x))
    reference = _fp32_combine_reference(y, dst, cfg.nvs)
    error_in_ulps = np.abs(out.astype(np.float64) - reference) / _bf16_ulp(reference)
    assert error_in_ulps.max() <= 1.5, error_in_ulps.max()


@pytest.mark.parametrize("maxvio", (0.0, 10.0))
def test_combine_weights_bitwise_equal_to_xla(mesh, seed, maxvio):
    R = mesh.devices.size
    cfgs = _configs(R)
    rng = np.random.default_rng(seed)
    topk_idx = _routing(seed, R, maxvio, cfgs["xla"])
    recv_w = rng.standard_normal(R * cfgs["xla"].nvs).astype(np.float32)

    def per_rank(topk_idx, recv_w):
        p = plan(topk_idx, cfgs["xla"])
        return _stack({impl: _checks.implementation(cfg).combine_weights(recv_w, p, cfg)
                       for impl, cfg in cfgs.items()})

    out = _per_rank(per_rank, mesh)(topk_idx, recv_w)
    np.testing.assert_array_equal(np.asarray(out["cuda"]), np.asarray(out["xla"]))


# ---- prefetch and reduce_grad -------------------------------------------------------------------


@pytest.mark.parametrize("num_slots", [None, 3], ids=["B=epn", "B=3"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_prefetch_copies_home_weights_exactly(mesh, seed, num_slots, dtype):
    from moonep_jax._cuda import ops as cuda_ops

    R = mesh.devices.size
    cfgs = _configs(R, prefetch_slots=num_slots)
    epn = cfgs["xla"].epn
    rng = np.random.default_rng(seed)
    topk_idx = _routing(seed, R, 10.0, cfgs["xla"])
    w_local = rng.standard_normal((R * epn, 24, 40)).astype(dtype)

    def per_rank(topk_idx, w_local):
        p = plan(topk_idx, cfgs["xla"])
        slots = {impl: prefetch(w_local, p, cfg) for impl, cfg in cfgs.items()}
        # moe_ffn's variant: unused slots left unwritten (poisoned here), used ones exact.
        (slots["cuda_used_only"],) = cuda_ops.prefetch((w_local,), p, cfgs["cuda"],
                                                       zero_unused_slots=False)
        return _stack((slots, p.experts_to_copy))

    _poison_allocator(mesh, 4 * w_local.size // R)
    slots, experts_to_copy = _per_rank(per_rank, mesh)(topk_idx, w_local)
    np.testing.assert_array_equal(np.asarray(slots["cuda"]), np.asarray(slots["xla"]))
    experts_to_copy = np.asarray(experts_to_copy)[0]  # the full table, the same on every rank
    cuda_slots, used_only = np.asarray(slots["cuda"]), np.asarray(slots["cuda_used_only"])
    for r in range(R):
        for b, e in enumerate(experts_to_copy[r]):
            expected = w_local[e] if e >= 0 else np.zeros_like(w_local[0])
            np.testing.assert_array_equal(cuda_slots[r, b], expected)
            if e >= 0:
                np.testing.assert_array_equal(used_only[r, b], expected)


# Weight arrays of one multi-array prefetch, (trailing dims, dtype): a bf16 expert of 260 KiB (at
# num_sms = 1 nine bulk chunks through the four stages, every stage reused twice), an fp32 one of
# 960 bytes (bulk, a 16-byte share per CTA), and experts of 42 and 20 bytes (not multiples of 16:
# the 2- and 4-byte vector paths, from addresses that are not 16-byte aligned).
PREFETCH_WEIGHTS = (((256, 520), jnp.bfloat16), ((12, 20), jnp.float32), ((3, 7), jnp.bfloat16),
                    ((5,), jnp.float32))


@pytest.mark.parametrize("num_sms", [1, None], ids=["1cta", "per_sm"])
@pytest.mark.parametrize("zero_unused_slots", [True, False], ids=["zero_unused", "used_only"])
def test_prefetch_of_several_arrays_in_one_call_bitwise_equal_to_xla(mesh, seed, num_sms,
                                                                     zero_unused_slots):
    """One CUDA prefetch call of four weight arrays of different dtypes and expert sizes, into
    poisoned result buffers: every used slot is bitwise its home expert and equal to the xla
    reference (itself equal to one xla call per array); unused slots are zero with
    `zero_unused_slots`, and may hold anything without (only used slots are compared)."""
    from moonep_jax import _xla
    from moonep_jax._cuda import ops as cuda_ops

    R = mesh.devices.size
    cfgs = _configs(R, cuda=moonep_jax.CudaOptions(num_sms=num_sms))
    epn = cfgs["xla"].epn
    rng = np.random.default_rng(seed)
    topk_idx = _routing(seed, R, 10.0, cfgs["xla"])
    w_locals = tuple(rng.standard_normal((R * epn, *dims)).astype(dtype)
                     for dims, dtype in PREFETCH_WEIGHTS)

    def per_rank(topk_idx, *w_locals):
        p = plan(topk_idx, cfgs["xla"])
        slots = {"cuda": cuda_ops.prefetch(w_locals, p, cfgs["cuda"],
                                           zero_unused_slots=zero_unused_slots),
                 "xla": _xla.prefetch(w_locals, p, cfgs["xla"]),
                 "xla_one_by_one": tuple(_xla.prefetch((w,), p, cfgs["xla"])[0]
                                         for w in w_locals)}
        return _stack((slots, p.experts_to_copy))

    _poison_allocator(mesh, 2 * sum(w.nbytes for w in w_locals) // R)
    slots, experts_to_copy = _per_rank(per_rank, mesh)(topk_idx, *w_locals)
    experts_to_copy = np.asarray(experts_to_copy)[0]  # the full table, the same on every rank
    used = experts_to_copy >= 0  # R = 1: no other rank's experts, every slot unused
    assert (R == 1 or used.any()) and (~used).any(), "the routing must use some slots, not all"
    for w, w_local in enumerate(w_locals):
        cuda, xla = np.asarray(slots["cuda"][w]), np.asarray(slots["xla"][w])
        assert cuda.dtype == w_local.dtype and cuda.shape == (R, cfgs["xla"].num_slots,
                                                              *w_local.shape[1:])
        np.testing.assert_array_equal(xla, np.asarray(slots["xla_one_by_one"][w]))
        as_bits = lambda a: a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)  # noqa: E731
        if zero_unused_slots:
            np.testing.assert_array_equal(as_bits(cuda), as_bits(xla), err_msg=f"array {w}")
        np.testing.assert_array_equal(as_bits(cuda[used]), as_bits(xla[used]), err_msg=f"array {w}")
        np.testing.assert_array_equal(as_bits(cuda[used]), as_bits(w_local[experts_to_copy[used]]))


@pytest.mark.parametrize("bad", ["E", -2])
def test_prefetch_skips_and_reports_a_slot_naming_no_expert(mesh, seed, bad):
    """A slot whose expert lies outside [-1, E) is never read through: with two arrays in one
    call it comes out zero (into poisoned buffers) like an unused slot, every other slot exact,
    and the host reads it as bad plan data at `check_transport_errors()`."""
    from moonep_jax import _xla
    from moonep_jax._cuda import ops as cuda_ops

    R = mesh.devices.size
    cfgs = _configs(R)
    bad = cfgs["xla"].num_experts if bad == "E" else bad
    rng = np.random.default_rng(seed)
    topk_idx = _routing(seed, R, 10.0, cfgs["xla"])
    w_locals = (rng.standard_normal((R * cfgs["xla"].epn, 24, 40)).astype(jnp.bfloat16),
                rng.standard_normal((R * cfgs["xla"].epn, 3, 7)).astype(jnp.float32))

    def per_rank(topk_idx, *w_locals):
        p = plan(topk_idx, cfgs["xla"])
        with_slot0 = lambda e: dataclasses.replace(  # noqa: E731
            p, experts_to_copy=p.experts_to_copy.at[:, 0].set(e))
        return _stack((cuda_ops.prefetch(w_locals, with_slot0(bad), cfgs["cuda"]),
                       _xla.prefetch(w_locals, with_slot0(-1), cfgs["xla"])))

    moonep_jax.check_transport_errors()  # nothing left over from other tests
    _poison_allocator(mesh, 2 * sum(w.nbytes for w in w_locals) // R)
    got, want = _per_rank(per_rank, mesh)(topk_idx, *w_locals)
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert not np.any(w[:, 0])  # the bad slot: zero
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    with pytest.raises(moonep_jax.TransportError,
                       match=r"bad plan data at EP rank \d+, epoch \d+: plan\.experts_to_copy "
                             rf"names an expert.*\(value {bad}\)"):
        moonep_jax.check_transport_errors()
    moonep_jax.check_transport_errors()  # cleared by the read


def _reduce_grad_case(mesh, seed: int, maxvio: float):
    """(R, configs, epn, B, rng, global topk_idx) of a reduce_grad test."""
    R = mesh.devices.size
    cfgs = _configs(R)
    return (R, cfgs, cfgs["xla"].epn, cfgs["xla"].num_slots, np.random.default_rng(seed),
            _routing(seed, R, maxvio, cfgs["xla"]))


def _spread(rng, n):
    """`n` fp32 [8, 12] matrices with magnitudes spread over 2^-20 .. 2^20: any summation order
    other than the contract's changes the bits."""
    scale = np.exp2(rng.integers(-20, 20, (n, 1, 1)))
    return (rng.standard_normal((n, 8, 12)) * scale).astype(np.float32)


@pytest.mark.parametrize("maxvio", (1.0, 20.0))
def test_reduce_grad_bitwise_equal_to_xla_and_rank_slot_order(mesh, seed, maxvio):
    R, cfgs, epn, B, rng, topk_idx = _reduce_grad_case(mesh, seed, maxvio)
    g_local, g_slots = _spread(rng, R * epn), _spread(rng, R * B)

    def per_rank(topk_idx, g_local, g_slots):
        p = plan(topk_idx, cfgs["xla"])
        out = {impl: reduce_grad(g_local, g_slots, p, cfg) for impl, cfg in cfgs.items()}
        return _stack((out, p.experts_to_copy))

    out, experts_to_copy = _per_rank(per_rank, mesh)(topk_idx, g_local, g_slots)
    np.testing.assert_array_equal(np.asarray(out["cuda"]), np.asarray(out["xla"]))
    experts_to_copy = np.asarray(experts_to_copy)[0]
    expected = g_local.reshape(R, epn, 8, 12).copy()
    slots = g_slots.reshape(R, B, 8, 12)
    for r in range(R):
        for b in range(B):
            e = experts_to_copy[r, b]
            if e >= 0:
                expected[e // epn, e % epn] += slots[r, b]  # fp32, (rank, slot) ascending
    np.testing.assert_array_equal(np.asarray(out["cuda"]), expected)


@pytest.mark.parametrize("maxvio", (1.0, 20.0))
def test_reduce_grad_into_bf16_from_partials_bitwise_equal_to_xla(mesh, seed, maxvio):
    """moe_ffn's reduce_grad: replicated experts' sums start from fp32 partials and are rounded
    to bf16 once, written over the bf16 gradient; every other expert keeps its bf16 matrix."""
    from moonep_jax import _xla
    from moonep_jax._cuda import ops as cuda_ops

    R, cfgs, epn, B, rng, topk_idx = _reduce_grad_case(mesh, seed, maxvio)
    g_partial, g_slots = _spread(rng, R * epn), _spread(rng, R * B)
    g = _spread(rng, R * epn).astype(jnp.bfloat16)
    impls = {"xla": _xla.reduce_grad, "cuda": cuda_ops.reduce_grad}

    def per_rank(topk_idx, g, g_partial, g_slots):
        p = plan(topk_idx, cfgs["xla"])
        out = {name: impl(g, g_slots, p, cfgs[name], g_partial=g_partial)
               for name, impl in impls.items()}
        return _stack((out, p.experts_to_copy))

    out, experts_to_copy = _per_rank(per_rank, mesh)(topk_idx, g, g_partial, g_slots)
    np.testing.assert_array_equal(np.asarray(out["cuda"]), np.asarray(out["xla"]))
    experts_to_copy = np.asarray(experts_to_copy)[0]
    sums = g_partial.reshape(R, epn, 8, 12).copy()
    expected = np.asarray(g).reshape(R, epn, 8, 12).copy()
    slots = g_slots.reshape(R, B, 8, 12)
    replicated = np.zeros((R, epn), bool)
    for r in range(R):
        for b in range(B):
            e = experts_to_copy[r, b]
            if e >= 0:
                sums[e // epn, e % epn] += slots[r, b]  # fp32, (rank, slot) ascending
                replicated[e // epn, e % epn] = True
    expected[replicated] = sums[replicated].astype(jnp.bfloat16)
    assert replicated.any() == (R > 1)  # R = 1: nothing to add, every expert kept
    np.testing.assert_array_equal(np.asarray(out["cuda"]).reshape(R, epn, 8, 12), expected)


# ---- gradients, repeated calls, layers in a scan -----------------------------------------------


def _layer(x, topk_w, topk_idx, cfg, plan_cfg):
    """dispatch -> scale rows by their weights -> combine, as moe_ffn does around the experts."""
    p = plan(topk_idx, plan_cfg)
    recv_x, recv_w = dispatch(x, topk_w, p, cfg)
    y = (recv_x.astype(jnp.float32) * recv_w[:, None]).astype(x.dtype)
    return combine(y, p, cfg)


def test_gradients_through_dispatch_and_combine_bitwise_equal_to_xla(mesh, seed):
    R = mesh.devices.size
    cfgs = _configs(R)
    rng = np.random.default_rng(seed)
    topk_idx = _routing(seed, R, 10.0, cfgs["xla"])
    x = rng.standard_normal((R * S, cfgs["xla"].hidden)).astype(jnp.bfloat16)
    topk_w = rng.random((R * S, K), np.float32)
    d_out = rng.standard_normal((R * S, cfgs["xla"].hidden)).astype(np.float32)

    def per_rank(topk_idx, x, topk_w, d_out):
        def loss(x, topk_w, cfg):
            out = _layer(x, topk_w, topk_idx, cfg, cfgs["xla"])
            return jnp.sum(out.astype(jnp.float32) * d_out)

        grads = {impl: jax.grad(loss, argnums=(0, 1))(x, topk_w, cfg)
                 for impl, cfg in cfgs.items()}
        return _stack(grads)

    grads = _per_rank(per_rank, mesh)(topk_idx, x, topk_w, d_out)
    for xla_grad, cuda_grad in zip(grads["xla"], grads["cuda"]):
        np.testing.assert_array_equal(np.asarray(cuda_grad), np.asarray(xla_grad))
    assert np.asarray(grads["cuda"][0], np.float32).any()


@functools.cache
def _hashing_step(cfg: moonep_jax.EPConfig, plan_cfg: moonep_jax.EPConfig, mesh):
    """One call: a fresh routing from (key, step), a layer, and the output folded into a hash."""

    def per_rank(step, x, digest):
        key = jax.random.fold_in(jax.random.key(7), step[0])
        key = jax.random.fold_in(key, lax.axis_index("ep"))
        topk_idx = jax.random.randint(key, (S, K), -1, E, jnp.int32)  # -1: dropped
        topk_w = jax.random.uniform(jax.random.fold_in(key, 1), (S, K), jnp.float32)
        out = _layer(x, topk_w, topk_idx, cfg, plan_cfg)
        bits = lax.bitcast_convert_type(out, jnp.uint16).astype(jnp.uint32)
        weights = jnp.arange(1, bits.size + 1, dtype=jnp.uint32).reshape(bits.shape)
        return digest * jnp.uint32(1000003) + jnp.sum(bits * weights, dtype=jnp.uint32)

    return _per_rank(per_rank, mesh)


def _hash_of_calls(cfg, plan_cfg, mesh, x, num_calls: int) -> np.ndarray:
    R = mesh.devices.size
    step_fn = _hashing_step(cfg, plan_cfg, mesh)
    digest = jnp.zeros(R, jnp.uint32)
    for step in range(num_calls):  # back to back: nothing waits for the device in between
        digest = step_fn(jnp.full(R, step, jnp.int32), x, digest)
    return np.asarray(digest)


def test_thousand_back_to_back_calls_hash_identically_across_runs(mesh, seed):
    R = mesh.devices.size
    cfgs = _configs(R)
    x = np.random.default_rng(seed).standard_normal((R * S, cfgs["xla"].hidden)).astype(
        jnp.bfloat16)
    first = _hash_of_calls(cfgs["cuda"], cfgs["xla"], mesh, x, 1000)
    second = _hash_of_calls(cfgs["cuda"], cfgs["xla"], mesh, x, 1000)
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(first, _hash_of_calls(cfgs["xla"], cfgs["xla"], mesh, x, 1000))


def test_layers_in_scan_forward_and_gradients_bitwise_equal_to_xla(mesh, seed):
    R = mesh.devices.size
    num_layers = 4
    cfgs = _configs(R)
    rng = np.random.default_rng(seed)
    topk_idx = np.stack([_routing(seed + layer, R, (0.2, 1.0, 10.0, 20.0)[layer], cfgs["xla"])
                         for layer in range(num_layers)], axis=1)  # [R * S, L, K]
    topk_w = rng.random((R * S, num_layers, K), np.float32)
    x = rng.standard_normal((R * S, cfgs["xla"].hidden)).astype(jnp.bfloat16)

    def per_rank(topk_idx, topk_w, x):
        def model(x, topk_w, cfg):
            def layer(x, inputs):
                idx, w = inputs
                return _layer(x, w, idx, cfg, cfgs["xla"]), None

            out, _ = lax.scan(layer, x, (jnp.swapaxes(topk_idx, 0, 1), jnp.swapaxes(topk_w, 0, 1)))
            return jnp.sum(out.astype(jnp.float32) ** 2), out

        results = {}
        for impl, cfg in cfgs.items():
            (_, out), grads = jax.value_and_grad(model, argnums=(0, 1), has_aux=True)(
                x, topk_w, cfg)
            results[impl] = (out, grads)
        return _stack(results)

    results = _per_rank(per_rank, mesh)(topk_idx, topk_w, x)
    leaves_xla = jax.tree.leaves(results["xla"])
    leaves_cuda = jax.tree.leaves(results["cuda"])
    for xla_leaf, cuda_leaf in zip(leaves_xla, leaves_cuda):
        np.testing.assert_array_equal(np.asarray(cuda_leaf), np.asarray(xla_leaf))
