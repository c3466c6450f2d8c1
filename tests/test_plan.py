"""The reference planner against a loop-based NumPy oracle and the plan invariants.

The oracle follows `moonep_algorithm.md` §3.9 line by line (generation 1, caps
`T//R + (d < T%R)`, -1 dropped) and is compared with `np.array_equal` on every `Plan` field. The
invariant checks use only the plan and the routing, so they hold whatever the oracle says.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from jax.sharding import PartitionSpec as P

import moonep_jax
from moonep_jax import DROPPED
from moonep_jax.plan import plan

from _routings import SHAPES, Shape, make_routing, routing_cases

PLAN_FIELDS = ("dst", "cu_seqlens", "zero_fill", "experts_to_copy", "recv_src", "recv_primary",
               "num_invalid_ids")


# ---- running the planner on R simulated devices -------------------------------------------------


@functools.cache
def _compiled_planner(cfg: moonep_jax.EPConfig, mesh):
    def per_rank(topk_idx):
        return jax.tree.map(lambda leaf: leaf[None], plan(topk_idx, cfg))

    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def run_planner(topk_idx: np.ndarray, cfg: moonep_jax.EPConfig, mesh) -> dict[str, np.ndarray]:
    """Every rank's plan for the global `topk_idx [R, S, K]`, each field stacked on a rank axis."""
    R, S, K = topk_idx.shape
    stacked = _compiled_planner(cfg, mesh)(topk_idx.reshape(R * S, K))
    return {name: np.asarray(getattr(stacked, name)) for name in PLAN_FIELDS}


# ---- the NumPy oracle (moonep_algorithm.md §3.9) --------------------------------------------------


def oracle_plan(topk_idx: np.ndarray, cfg: moonep_jax.EPConfig) -> dict[str, np.ndarray]:
    R, E, epn, B, tp, nvs = (cfg.num_ranks, cfg.num_experts, cfg.epn, cfg.num_slots,
                             cfg.token_padding, cfg.nvs)
    K, N, G = cfg.top_k, cfg.num_entries, cfg.num_groups
    flat = topk_idx.reshape(R, N)

    # A: per-rank histograms, valid entries only.
    tpe = np.zeros((R, E), np.int64)
    for r in range(R):
        for e in flat[r]:
            if 0 <= e < E:
                tpe[r, e] += 1
    total = int(tpe.sum())
    cap = np.array([total // R + (1 if d < total % R else 0) for d in range(R)])
    cnt = tpe.sum(axis=0)

    # B2: the most overloaded rank fills the most underloaded one, in one shot.
    balance = np.array([cnt[h * epn:(h + 1) * epn].sum() for h in range(R)]) - cap
    z = np.zeros((R, R), np.int64)
    while balance.max() > 0:
        h, u = int(np.argmax(balance)), int(np.argmin(balance))
        z[h, u] = -balance[u]
        balance[h] += balance[u]
        balance[u] = 0

    # B3: largest quota first, hottest expert first.
    alloc = np.zeros((E, R), np.int64)
    for e in range(E):
        alloc[e, e // epn] = cnt[e]
    for h in range(R):
        remaining, quota = cnt[h * epn:(h + 1) * epn].copy(), z[h].copy()
        while quota.max() > 0:
            d, le = int(np.argmax(quota)), int(np.argmax(remaining))
            take = min(remaining[le], quota[d])
            alloc[h * epn + le, d] += take
            alloc[h * epn + le, h] -= take
            remaining[le] -= take
            quota[d] -= take
    alloc_cumsum = np.cumsum(alloc, axis=1)

    # C: generation-1 layout of every destination.
    cu_seqlens = np.zeros((R, G), np.int64)
    zero_fill = np.zeros((R, G, 2), np.int64)
    experts_to_copy = np.full((R, B), -1, np.int64)
    expert_off = {}
    for d in range(R):
        remote = [e for e in range(E) if e // epn != d and alloc[e, d] > 0]
        slots = sorted(remote, key=lambda e: (alloc[e, d], e), reverse=True)[:B]
        experts_to_copy[d, :len(slots)] = slots
        group_expert = list(range(E)) + list(experts_to_copy[d])
        start = 0
        for g, e in enumerate(group_expert):
            in_this_group = e >= 0 and (g >= E or e not in slots)
            c = alloc[e, d] if in_this_group else 0
            p = -(-c // tp) * tp
            if c > 0:
                expert_off[d, e] = start
            cu_seqlens[d, g] = start + p
            if p > c:
                zero_fill[d, g] = (start + c, p - c)
            start += p

    # D: destination of every entry, then duplicates and the receiver side.
    dst = np.zeros((R, N), np.int64)
    for r in range(R):
        seen = np.zeros(E, np.int64)
        for i in range(N):
            e = flat[r, i]
            if not 0 <= e < E:
                dst[r, i] = DROPPED
                continue
            global_rank = tpe[:r, e].sum() + seen[e]
            seen[e] += 1
            dest = sum(1 for d in range(R) if alloc_cumsum[e, d] <= global_rank)
            seg_pos = global_rank - (alloc_cumsum[e, dest - 1] if dest > 0 else 0)
            dst[r, i] = dest * nvs + expert_off[dest, e] + seg_pos

    recv_src = np.full((R, nvs), -1, np.int64)
    recv_primary = np.full((R, nvs), -1, np.int64)
    for r in range(R):
        for t in range(cfg.tokens_per_rank):
            primary_row_on = {}
            for k in range(K):
                i = t * K + k
                if dst[r, i] == DROPPED:
                    continue
                dest, row = divmod(int(dst[r, i]), nvs)
                if dest in primary_row_on:
                    dst[r, i] = -dst[r, i] - 1
                else:
                    primary_row_on[dest] = row
                recv_src[dest, row] = r * N + i
                recv_primary[dest, row] = primary_row_on[dest]

    num_invalid_ids = np.array([[sum(1 for e in flat[r] if not -1 <= e < E)] for r in range(R)])
    return dict(dst=dst, cu_seqlens=cu_seqlens, zero_fill=zero_fill,
                experts_to_copy=np.broadcast_to(experts_to_copy, (R, R, B)),
                recv_src=recv_src, recv_primary=recv_primary, num_invalid_ids=num_invalid_ids)


def assert_equals_oracle(plans, topk_idx, cfg):
    expected = oracle_plan(topk_idx, cfg)
    for name in PLAN_FIELDS:
        assert plans[name].dtype == np.int32, name
        assert np.array_equal(plans[name], expected[name]), (
            f"{name} differs from the oracle:\n{plans[name]}\nexpected\n{expected[name]}")


# ---- invariants, from the plan and the routing only ----------------------------------------------


def _decode(value, nvs):
    raw = value if value >= 0 else -value - 1
    return divmod(int(raw), nvs)


def assert_plan_invariants(plans, topk_idx, cfg):
    R, E, nvs = cfg.num_ranks, cfg.num_experts, cfg.nvs
    K, N = cfg.top_k, cfg.num_entries
    flat = topk_idx.reshape(R, N)
    dst = plans["dst"]
    etc = plans["experts_to_copy"][0]
    assert (plans["experts_to_copy"] == etc).all(), "experts_to_copy differs between ranks"
    assert ((etc >= -1) & (etc < E)).all()

    # Dropped entries, and where every valid entry lands: (dest, row) -> (src, i).
    valid = (flat >= 0) & (flat < E)
    assert np.array_equal(dst == DROPPED, ~valid), "DROPPED must mark exactly the -1 entries"
    owner = {}
    for r in range(R):
        for i in np.flatnonzero(valid[r]):
            dest, row = _decode(dst[r, i], nvs)
            assert 0 <= dest < R and 0 <= row < nvs
            assert (dest, row) not in owner, "two entries share a row"
            owner[dest, row] = (r, i)

    # Exact caps: floor/ceil(T/R), the first T%R ranks take the extra entry.
    total = int(valid.sum())
    for d in range(R):
        received = sum(1 for (dest, _) in owner if dest == d)
        assert received == total // R + (d < total % R), f"rank {d} receives {received}"

    for d in range(R):
        _assert_destination_layout(d, plans, owner, flat, cfg)

    # Duplicates: negative exactly when a lower k of the token goes to the same rank.
    for r in range(R):
        for t in range(cfg.tokens_per_rank):
            dests = [(_decode(dst[r, t * K + k], nvs)[0] if valid[r, t * K + k] else None)
                     for k in range(K)]
            for k in range(K):
                if dests[k] is not None:
                    assert (dst[r, t * K + k] < 0) == (dests[k] in dests[:k])

    # Receiver side: recv_src names the owner, recv_primary the lowest-k row of the same token.
    for d in range(R):
        for row in range(nvs):
            src, primary = plans["recv_src"][d, row], plans["recv_primary"][d, row]
            if (d, row) not in owner:
                assert src == -1 and primary == -1
                continue
            r, i = owner[d, row]
            assert src == r * N + i
            t = i // K
            lowest_k = next(k for k in range(K) if valid[r, t * K + k]
                            and _decode(dst[r, t * K + k], nvs)[0] == d)
            assert primary == _decode(dst[r, t * K + lowest_k], nvs)[1]
    assert_slots_ranked(plans, owner, flat, cfg)


def _assert_destination_layout(d, plans, owner, flat, cfg):
    """Groups of destination d: bounds, padding, contents, order, donors and slots."""
    E, epn, tp, nvs = cfg.num_experts, cfg.epn, cfg.token_padding, cfg.nvs
    cu = plans["cu_seqlens"][d]
    etc = plans["experts_to_copy"][d][d]
    ends = cu.astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    sizes = ends - starts
    assert (sizes >= 0).all() and (sizes % tp == 0).all(), f"rank {d}: cu_seqlens {cu}"
    assert cu[-1] <= nvs
    assert np.count_nonzero(sizes) <= 2 * epn
    used = etc >= 0
    assert not (used[1:] & ~used[:-1]).any(), "used slots must come first"
    assert len(set(etc[used].tolist())) == used.sum()
    assert all(e // epn != d for e in etc[used]), "a slot holds a local expert"

    remote_homes = set()
    for g in range(cfg.num_groups):
        expert = g if g < E else etc[g - E]
        rows = [row for row in range(starts[g], ends[g]) if (d, row) in owner]
        count = len(rows)
        assert rows == list(range(starts[g], starts[g] + count)), "real rows come first"
        assert sizes[g] == -(-count // tp) * tp
        pad = sizes[g] - count
        expected_fill = (starts[g] + count, pad) if pad > 0 else (0, 0)
        assert tuple(plans["zero_fill"][d, g]) == expected_fill
        sources = [owner[d, row] for row in rows]
        assert all(flat[r, i] == expert for r, i in sources), f"group {g} holds another expert"
        assert sources == sorted(sources), "a group's rows must be in global (rank, i) order"
        if count and expert // epn != d:
            remote_homes.add(expert // epn)
            if g < E:  # overflow stays in its global row only when every slot is taken
                assert used.all() and expert not in etc
        if g >= E and used[g - E]:
            assert count > 0, "a used slot must receive entries"
    assert len(remote_homes) <= 1, f"rank {d} receives from homes {remote_homes}"
    assert all((d, row) not in owner for row in range(int(cu[-1]), nvs))


def assert_slots_ranked(plans, owner, flat, cfg):
    """Slots hold the top-B remote experts by (count desc, id desc); B = epn never overflows."""
    counts = {}
    for (d, _), (r, i) in owner.items():
        e = int(flat[r, i])
        counts[d, e] = counts.get((d, e), 0) + 1
    for d in range(cfg.num_ranks):
        remote = [e for (dd, e) in counts if dd == d and e // cfg.epn != d]
        ranked = sorted(remote, key=lambda e: (counts[d, e], e), reverse=True)[:cfg.num_slots]
        etc = plans["experts_to_copy"][d][d]
        assert etc[etc >= 0].tolist() == ranked
        if cfg.trainable:
            assert len(remote) <= cfg.num_slots


# ---- routings of the worked examples -----------------------------------------------------------


def routing_with_counts(counts, R, S, rng):
    """`[R, S, 1]` routing (K = 1) whose global expert histogram is `counts` (sum R*S)."""
    ids = np.repeat(np.arange(len(counts)), counts)
    assert ids.size == R * S
    return rng.permutation(ids).astype(np.int32).reshape(R, S, 1)


# ---- tests ----------------------------------------------------------------------------------------


def test_worked_example_1(mesh_factory, seed):
    """moonep_algorithm.md §3.10 Example 1: R=4, epn=2, K=1, tp=4, B=epn=2."""
    cfg = Shape(R=4, S=8, K=1, E=8, tp=4).config()
    topk_idx = routing_with_counts([14, 6, 4, 4, 2, 1, 1, 0], 4, 8, np.random.default_rng(seed))
    plans = run_planner(topk_idx, cfg, mesh_factory(4))

    assert plans["cu_seqlens"][2].tolist() == [0, 0, 0, 0, 4, 8, 8, 8, 16, 16]
    expected_fill = np.zeros((10, 2), int)
    expected_fill[[4, 5, 8]] = [(2, 2), (5, 3), (13, 3)]
    assert np.array_equal(plans["zero_fill"][2], expected_fill)
    assert plans["experts_to_copy"][0].tolist() == [[-1, -1], [-1, -1], [0, -1], [0, -1]]
    # e0 in global order (rank, i): 2 stay home, the next 5 go to rank 2, the last 7 to rank 3.
    e0_dest = [plans["dst"][r, i] // cfg.nvs for r in range(4) for i in range(8)
               if topk_idx[r, i, 0] == 0]
    assert e0_dest == [0] * 2 + [2] * 5 + [3] * 7
    assert_plan_invariants(plans, topk_idx, cfg)
    assert_equals_oracle(plans, topk_idx, cfg)


def test_worked_example_2_overflow(mesh_factory, seed):
    """§3.10 Example 2: R=2, epn=3, B=1; e1 overflows and stays in its global row on rank 1."""
    cfg = Shape(R=2, S=9, K=1, E=6, B=1).config()
    topk_idx = routing_with_counts([5, 5, 5, 1, 1, 1], 2, 9, np.random.default_rng(seed))
    plans = run_planner(topk_idx, cfg, mesh_factory(2))

    assert plans["cu_seqlens"][1].tolist() == [0, 1, 1, 2, 3, 4, 9]
    assert plans["cu_seqlens"][0].tolist() == [0, 4, 9, 9, 9, 9, 9]  # rank 0 computes no e0
    assert plans["experts_to_copy"][1].tolist() == [[-1], [0]]
    assert_plan_invariants(plans, topk_idx, cfg)
    assert_equals_oracle(plans, topk_idx, cfg)


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=routing_cases())
def test_random_routings_match_oracle_and_invariants(mesh_factory, case):
    cfg = case.shape.config()
    plans = run_planner(case.topk_idx, cfg, mesh_factory(cfg.num_ranks))
    assert_plan_invariants(plans, case.topk_idx, cfg)
    assert_equals_oracle(plans, case.topk_idx, cfg)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("pattern", ["one_hot_expert", "hot_rank", "few_experts"])
def test_heavy_skew_is_exactly_balanced(mesh_factory, seed, shape, pattern):
    topk_idx = make_routing(shape, pattern, np.random.default_rng(seed))
    cfg = shape.config()
    plans = run_planner(topk_idx, cfg, mesh_factory(shape.R))
    assert_plan_invariants(plans, topk_idx, cfg)
    assert_equals_oracle(plans, topk_idx, cfg)


def test_slot_ties_go_to_the_larger_id(mesh_factory, seed):
    """Rank 1 takes 2 entries each of e0 and e1 (equal counts): slot order is e1, e0."""
    cfg = Shape(R=2, S=4, K=1, E=8).config()
    topk_idx = routing_with_counts([2, 2, 2, 2, 0, 0, 0, 0], 2, 4, np.random.default_rng(seed))
    plans = run_planner(topk_idx, cfg, mesh_factory(2))
    assert plans["experts_to_copy"][0].tolist() == [[-1, -1, -1, -1], [1, 0, -1, -1]]
    assert_plan_invariants(plans, topk_idx, cfg)
    assert_equals_oracle(plans, topk_idx, cfg)


def test_single_hot_expert_is_split_over_every_rank(mesh_factory, seed):
    shape = SHAPES[7]  # R=8, S=16, K=4, E=32, tp=2
    cfg = shape.config()
    hot = np.random.default_rng(seed).integers(shape.E)
    topk_idx = np.full((shape.R, shape.S, shape.K), hot, np.int32)
    plans = run_planner(topk_idx, cfg, mesh_factory(shape.R))
    home = hot // cfg.epn
    for d in range(shape.R):
        assert plans["cu_seqlens"][d][-1] == 64  # 64 entries per rank, already multiples of tp
        expected_slots = [-1] * 4 if d == home else [hot, -1, -1, -1]
        assert plans["experts_to_copy"][0][d].tolist() == expected_slots
    assert_plan_invariants(plans, topk_idx, cfg)


def test_all_local_balanced_routing_moves_nothing(mesh_factory, seed):
    shape = SHAPES[4]  # R=4, S=12, K=5 > epn=4, E=16, B=2, tp=3
    cfg = shape.config()
    topk_idx = make_routing(shape, "all_local", np.random.default_rng(seed))
    plans = run_planner(topk_idx, cfg, mesh_factory(4))
    assert (plans["experts_to_copy"] == -1).all()
    dest = np.where(plans["dst"] >= 0, plans["dst"], -plans["dst"] - 1) // cfg.nvs
    assert np.array_equal(dest, np.repeat(np.arange(4)[:, None], cfg.num_entries, axis=1))
    assert_equals_oracle(plans, topk_idx, cfg)


def test_repeated_ids_within_a_token(mesh_factory, seed):
    """K = 4 copies of one id per token."""
    shape = SHAPES[2]  # R=2, S=16, K=4, E=8, tp=4
    cfg = shape.config()
    rng = np.random.default_rng(seed)
    topk_idx = np.repeat(rng.integers(0, 8, (2, 16, 1)), 4, axis=2).astype(np.int32)
    plans = run_planner(topk_idx, cfg, mesh_factory(2))
    dst = plans["dst"].reshape(2, 16, 4)
    assert (dst[:, :, 0] >= 0).all()
    assert_plan_invariants(plans, topk_idx, cfg)
    assert_equals_oracle(plans, topk_idx, cfg)


def test_every_entry_dropped(mesh_factory):
    cfg = SHAPES[4].config()  # R=4, S=12, K=5, E=16, B=2, tp=3
    topk_idx = np.full((4, 12, 5), -1, np.int32)
    plans = run_planner(topk_idx, cfg, mesh_factory(4))
    assert (plans["dst"] == DROPPED).all()
    assert (plans["cu_seqlens"] == 0).all() and (plans["zero_fill"] == 0).all()
    assert (plans["experts_to_copy"] == -1).all()
    assert (plans["recv_src"] == -1).all() and (plans["recv_primary"] == -1).all()


def test_dropped_entries_shrink_caps(mesh_factory, seed):
    """T = 13 valid entries over R = 4: caps (4, 3, 3, 3)."""
    rng = np.random.default_rng(seed)
    shape = SHAPES[3]  # R=4, S=7, K=2, E=8
    cfg = shape.config()
    topk_idx = make_routing(shape, "with_replacement", rng)
    flat = topk_idx.reshape(-1)
    flat[rng.permutation(flat.size)[:flat.size - 13]] = -1
    plans = run_planner(topk_idx, cfg, mesh_factory(4))
    assert plans["cu_seqlens"][:, -1].tolist() == [4, 3, 3, 3]
    assert_plan_invariants(plans, topk_idx, cfg)
    assert_equals_oracle(plans, topk_idx, cfg)


def with_invalid_ids(topk_idx: np.ndarray, E: int, rng: np.random.Generator, fraction: float):
    """A copy of `topk_idx` with about `fraction` of its entries set to ids outside `[-1, E)`
    (E itself, far above, just below -1, INT32 extremes), and the mask of those entries."""
    invalid = rng.random(topk_idx.shape) < fraction
    choices = np.array([E, E + 1, 1000, 2**31 - 1, -2, -7, -(2**31)], np.int64)
    bad = topk_idx.copy()
    bad[invalid] = rng.choice(choices, size=int(invalid.sum())).astype(np.int32)
    return bad, invalid


def test_out_of_range_ids_are_dropped(mesh_factory, seed):
    shape = SHAPES[1]  # R=2, S=8, K=3, E=6, B=1
    cfg = shape.config()
    topk_idx = make_routing(shape, "uniform", np.random.default_rng(seed))
    bad = topk_idx.copy()
    bad[0, 1, 0], bad[1, 3, 1] = 6, -7
    plans = run_planner(bad, cfg, mesh_factory(2))
    assert plans["dst"][0, 3] == DROPPED and plans["dst"][1, 10] == DROPPED
    assert plans["num_invalid_ids"].tolist() == [[1], [1]]
    dropped = topk_idx.copy()
    dropped[0, 1, 0], dropped[1, 3, 1] = -1, -1
    for name, value in run_planner(dropped, cfg, mesh_factory(2)).items():
        if name != "num_invalid_ids":
            assert np.array_equal(plans[name], value), name


@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[7]], ids=str)
@pytest.mark.parametrize("pattern", ["lognormal", "one_hot_expert"])
def test_invalid_ids_are_dropped_like_minus_one_and_counted(mesh_factory, seed, shape, pattern):
    """Random invalid ids in a skewed routing (with -1 entries too): the count per rank is exact
    and every other field equals the plan of the same routing with those ids set to -1."""
    rng = np.random.default_rng(seed)
    cfg = shape.config()
    topk_idx = make_routing(shape, pattern, rng)
    topk_idx[rng.random(topk_idx.shape) < 0.1] = -1
    bad, invalid = with_invalid_ids(topk_idx, shape.E, rng, 0.15)
    assert invalid.any()
    plans = run_planner(bad, cfg, mesh_factory(shape.R))
    assert plans["num_invalid_ids"][:, 0].tolist() == invalid.reshape(shape.R, -1).sum(1).tolist()
    as_dropped = np.where(invalid, -1, bad)
    reference = run_planner(as_dropped, cfg, mesh_factory(shape.R))
    assert not reference["num_invalid_ids"].any()
    for name in PLAN_FIELDS:
        if name != "num_invalid_ids":
            assert np.array_equal(plans[name], reference[name]), name
    assert_equals_oracle(plans, bad, cfg)


def test_single_rank(mesh_factory, seed):
    shape = SHAPES[0]  # R=1, S=5, K=2, E=4
    cfg = shape.config()
    topk_idx = make_routing(shape, "lognormal", np.random.default_rng(seed), sigma=2.0)
    plans = run_planner(topk_idx, cfg, mesh_factory(1))
    assert (plans["experts_to_copy"] == -1).all()
    assert_plan_invariants(plans, topk_idx, cfg)
    assert_equals_oracle(plans, topk_idx, cfg)


def test_plan_on_a_data_by_ep_mesh(mesh_factory, seed):
    """Each data-parallel replica plans its own EP group."""
    shape = SHAPES[3]  # R=4, S=7, K=2, E=8
    cfg = shape.config()
    mesh = mesh_factory((2, 4), ("data", "ep"))
    rng = np.random.default_rng(seed)
    topk_idx = np.stack([make_routing(shape, "lognormal", rng, sigma=2.0) for _ in range(2)])

    def per_rank(t):
        return jax.tree.map(lambda leaf: leaf[None], plan(t, cfg))

    replica_major = P(("data", "ep"))
    run = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=replica_major,
                                out_specs=replica_major))
    stacked = run(topk_idx.reshape(2 * 4 * 7, 2))
    for replica in range(2):
        plans = {name: np.asarray(getattr(stacked, name))[4 * replica:4 * replica + 4]
                 for name in PLAN_FIELDS}
        assert_equals_oracle(plans, topk_idx[replica], cfg)


def test_plan_has_no_host_callbacks(mesh_factory):
    cfg = SHAPES[3].config()
    jaxpr = jax.make_jaxpr(_compiled_planner(cfg, mesh_factory(cfg.num_ranks)))(
        np.zeros((cfg.num_ranks * cfg.tokens_per_rank, cfg.top_k), np.int32))
    assert "callback" not in str(jaxpr)


# ---- errors ---------------------------------------------------------------------------------------


def _trace_plan(mesh, cfg, topk_idx):
    run = jax.shard_map(lambda t: plan(t, cfg), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    return jax.eval_shape(run, topk_idx)


def test_wrong_topk_shape_is_rejected(mesh_factory):
    cfg = Shape(R=2, S=8, K=2, E=4).config()
    with pytest.raises(ValueError, match=r"`topk_idx` must have shape \[S, K\] = \[8, 2\].*got \[8, 3\]"):
        _trace_plan(mesh_factory(2), cfg, jax.ShapeDtypeStruct((16, 3), np.int32))


def test_wrong_topk_dtype_is_rejected(mesh_factory):
    cfg = Shape(R=2, S=8, K=2, E=4).config()
    with pytest.raises(TypeError, match="`topk_idx` must have dtype int32; got float32"):
        _trace_plan(mesh_factory(2), cfg, jax.ShapeDtypeStruct((16, 2), np.float32))


def test_missing_ep_axis_is_rejected():
    cfg = Shape(R=2, S=8, K=2, E=4).config()
    with pytest.raises(ValueError, match=r"EP axis `ep`.*not bound \(no mesh axis is bound here\)"):
        plan(np.zeros((8, 2), np.int32), cfg)


def test_wrongly_named_axis_is_rejected(mesh_factory):
    cfg = Shape(R=2, S=8, K=2, E=4).config(axis_name="experts")
    with pytest.raises(ValueError, match=r"EP axis `experts`.*not bound \(the mesh here has "
                                         r"axes \('ep',\)\)"):
        _trace_plan(mesh_factory(2), cfg, jax.ShapeDtypeStruct((16, 2), np.int32))


def test_axis_of_the_wrong_size_is_rejected(mesh_factory):
    cfg = Shape(R=4, S=8, K=2, E=4).config()
    with pytest.raises(ValueError, match="must have size `EPConfig.num_ranks` = 4; got 2"):
        _trace_plan(mesh_factory(2), cfg, jax.ShapeDtypeStruct((16, 2), np.int32))


def test_config_type_is_checked():
    with pytest.raises(TypeError, match="`cfg` must be a moonep_jax.EPConfig"):
        plan(np.zeros((8, 2), np.int32), {"num_experts": 4})
