"""The CuTe DSL grouped GEMM kernels (forward / dX / dW) against fp32 references, on one GPU."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moonep_jax import _ffi

pytestmark = pytest.mark.gpu


NUM_EXPERTS, NUM_RANKS, RANK = 8, 2, 1
EPN = NUM_EXPERTS // NUM_RANKS
NUM_GROUPS = NUM_EXPERTS + EPN  # B = epn (training)


def _group_sizes(rng, case, num_rows):
    """Sizes of the G groups; only this rank's experts and the slots are non-empty."""
    active = [g for g in range(NUM_GROUPS)
              if RANK * EPN <= g < (RANK + 1) * EPN or g >= NUM_EXPERTS]
    sizes = np.zeros(NUM_GROUPS, np.int64)
    if case == "random":
        sizes[active] = rng.integers(0, 2 * num_rows // len(active), len(active))
        sizes[active[1]] = 0
        # The first and the last slot empty: used slots follow an unused one, and dW's items
        # must run to the last used slot, not to the number of used ones.
        sizes[active[EPN]] = 0
        sizes[active[-1]] = 0
    elif case == "giant":
        sizes[active[2]] = num_rows - 5  # one group, tail of 5 zero rows
    elif case == "one_row":
        sizes[active] = 1
    scale = min(1.0, (num_rows - 3) / max(sizes.sum(), 1))  # leave overflow rows at the end
    return np.floor(sizes * scale).astype(np.int64)


def _group_of_rows(cu_seqlens, num_rows):
    return np.searchsorted(cu_seqlens, np.arange(num_rows), side="right")


def _weight_of_group(g, w_local, w_slots):
    return w_slots[g - NUM_EXPERTS] if g >= NUM_EXPERTS else w_local[g - RANK * EPN]


def _assert_bf16_close(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    rms = np.sqrt(np.mean(ref ** 2)) + 1e-30
    assert np.linalg.norm(out - ref) / (np.linalg.norm(ref) + 1e-30) < 1e-2
    assert (np.abs(out - ref) <= 0.02 * np.abs(ref) + 0.05 * rms).all()


def _inputs(seed, case, num_rows, d0, d1):
    """Rows, weights and groups; the weights of every empty group are NaN, which the kernels must
    never read (moe_ffn leaves unused slots unwritten), also where a K tile runs past D0."""
    rng = np.random.default_rng(seed)
    sizes = _group_sizes(rng, case, num_rows)
    cu_seqlens = np.cumsum(sizes).astype(np.int32)
    bf16 = lambda shape: rng.standard_normal(shape).astype(jnp.bfloat16)  # noqa: E731
    w_local, w_slots = bf16((EPN, d0, d1)), bf16((EPN, d0, d1))
    w_local[sizes[RANK * EPN:(RANK + 1) * EPN] == 0] = np.nan
    w_slots[sizes[NUM_EXPERTS:] == 0] = np.nan
    return cu_seqlens, bf16((num_rows, d0)), bf16((num_rows, d1)), w_local, w_slots


# (300, 40, 72): D0 below one K tile, so every K tile runs past the matrix.
SHAPES = [(1000, 256, 512), (777, 136, 264), (300, 40, 72), (4096, 1024, 2048)]
CASES = ["random", "giant", "one_row"]


@pytest.mark.parametrize("num_rows,d0,d1", SHAPES)
@pytest.mark.parametrize("case", CASES)
def test_grouped_matmul_forward_and_dx_match_fp32_reference(seed, case, num_rows, d0, d1):
    from moonep_jax._cuda.grouped_matmul import (grouped_matmul_dx_of_groups,
                                                 grouped_matmul_of_groups)

    cu_seqlens, x, dy, w_local, w_slots = _inputs(seed, case, num_rows, d0, d1)
    rank = np.array([RANK], np.int32)
    y, dx = jax.jit(lambda *a: (grouped_matmul_of_groups(a[0], a[2], a[3], a[4], a[5]),
                                grouped_matmul_dx_of_groups(a[1], a[2], a[3], a[4], a[5])))(
        x, dy, w_local, w_slots, cu_seqlens, rank)
    y, dx = np.asarray(y, np.float32), np.asarray(dx, np.float32)
    groups = _group_of_rows(cu_seqlens, num_rows)
    y_ref = np.zeros((num_rows, d1), np.float32)
    dx_ref = np.zeros((num_rows, d0), np.float32)
    for r in range(cu_seqlens[-1]):
        w = _weight_of_group(groups[r], w_local, w_slots).astype(np.float32)
        y_ref[r] = x[r].astype(np.float32) @ w
        dx_ref[r] = w @ dy[r].astype(np.float32)
    assert cu_seqlens[-1] < num_rows
    assert (y[cu_seqlens[-1]:] == 0).all() and (dx[cu_seqlens[-1]:] == 0).all()
    _assert_bf16_close(y, y_ref)
    _assert_bf16_close(dx, dx_ref)


def _expected_tile_table(cu_seqlens, num_rows, num_n_tiles, kinds):
    """The used entries of the ragged-M tile table, as kernels/grouped_matmul.cu defines them: per
    segment (each group, then the rows past cu_seqlens[-1]) one (kind, row_start, row_end, mat,
    first item, N tiles per item) per TILE_M rows; a group of another rank's expert (bad plan data
    without overflow) is zeroed. A tile's items follow the previous tile's; each covers one N tile,
    or WIDE_N_TILES when the group has at most one A chunk of rows from the tile's start and is
    multiplied. Returns the entries and the items."""
    lib = _ffi.lib()
    tile_m, chunk_m = lib.GROUPED_MATMUL_TILE_M, lib.GROUPED_MATMUL_CHUNK_M
    entries, items = [], 0
    ends = list(cu_seqlens) + [num_rows]
    for s, end in enumerate(ends):
        start = 0 if s == 0 else ends[s - 1]
        if s >= NUM_EXPERTS and s < NUM_GROUPS:
            kind, mat = kinds["KIND_SLOT"], s - NUM_EXPERTS
        elif RANK * EPN <= s < (RANK + 1) * EPN:
            kind, mat = kinds["KIND_LOCAL"], s - RANK * EPN
        else:
            kind, mat = kinds["KIND_ZERO"], 0
        for row in range(start, end, tile_m):
            wide = kind != kinds["KIND_ZERO"] and end - row <= chunk_m
            n_tiles = lib.GROUPED_MATMUL_WIDE_N_TILES if wide else 1
            entries.append((kind, row, end, mat, items, n_tiles))
            items += -(-num_n_tiles // n_tiles)
    return np.array(entries, np.int32).reshape(-1, kinds["TABLE_COLUMNS"]), items


@pytest.mark.parametrize("d1", [384, 640])
def test_tile_table_lists_the_plans_tiles_and_every_work_item_is_taken_once(seed, d1):
    """The forward's tile-table scratch: its used entries are the plan's tiles with their first
    work items, and its schedule row holds their count, their items, and the work-item counter
    after the launch, which every CTA's producer takes from until it runs past the last item: it
    ends at exactly the items (an item taken twice, or one lost, would move it), also after a
    second launch into a fresh table. N = 384 and 640: 3 and 5 N tiles, so wide items cover
    every N tile of a tile, or the last one fewer."""
    from moonep_jax._cuda.grouped_matmul import _NO_TRANSPORT, table_rows

    lib = _ffi.lib()
    rng = np.random.default_rng(seed)
    num_rows, d0 = 6000, 64
    sizes = _group_sizes(rng, "random", num_rows)
    sizes[RANK * EPN] += 2 * lib.GROUPED_MATMUL_TILE_M + 5   # a group over three M tiles
    sizes[RANK * EPN + 2] = 100                             # one chunk: a wide tile
    sizes[0] = 7                                            # rows of another rank's expert: zeroed
    sizes = np.floor(sizes * min(1.0, (num_rows - 3) / sizes.sum())).astype(np.int64)
    cu_seqlens = np.cumsum(sizes).astype(np.int32)
    kinds = lib.GROUPED_MATMUL_TABLE_CONSTANTS
    rows = table_rows(num_rows, NUM_GROUPS, False)
    bf16 = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    x, w_local, w_slots = bf16((num_rows, d0)), bf16((EPN, d0, d1)), bf16((EPN, d0, d1))
    call = jax.jit(lambda *a: jax.ffi.ffi_call("moonep_grouped_matmul", (
        jax.ShapeDtypeStruct((num_rows, d1), jnp.bfloat16),
        jax.ShapeDtypeStruct((rows, kinds["TABLE_COLUMNS"]), jnp.int32)))(
            *a, **_NO_TRANSPORT))
    expected, items = _expected_tile_table(
        cu_seqlens, num_rows, -(-d1 // lib.GROUPED_MATMUL_TILE_N), kinds)
    wide = expected[:, kinds["TABLE_ITEM_N_TILES"]] > 1
    assert wide.any() and not wide.all()
    for _ in range(2):
        _, table = call(x, w_local, w_slots, cu_seqlens, np.array([RANK], np.int32))
        table = np.asarray(table)
        schedule = table[rows - 1]
        assert schedule[kinds["SCHEDULE_TILES"]] == len(expected)
        assert schedule[kinds["SCHEDULE_ITEMS"]] == items
        np.testing.assert_array_equal(table[:len(expected)], expected)
        assert schedule[kinds["SCHEDULE_NEXT_ITEM"]] == items


@pytest.mark.parametrize("zero_unused_slots", [False, True])
def test_dw_schedule_lists_the_matrices_with_work_and_every_item_is_taken_once(
        seed, zero_unused_slots):
    """dW's schedule scratch after the launch: its matrices with work (every local expert's, then
    the slots' with rows, listed ascending, or every slot's when unused ones are zeroed), and
    its counter, from which each CTA's producer takes once before its first item (the CTA's
    index) and once per item: it ends at the items plus the grid (an item taken twice, or lost,
    or one of an unused slot would move it)."""
    from test_constants import REPO, module_constants

    dsl = module_constants(REPO / "kernels" / "cutedsl" / "grouped_matmul.py")
    kinds = _ffi.lib().GROUPED_MATMUL_TABLE_CONSTANTS
    rng = np.random.default_rng(seed)
    num_rows, d0, d1 = 3000, 1024, 1024
    sizes = _group_sizes(rng, "random", num_rows)  # the first and the last slot empty
    cu_seqlens = np.cumsum(sizes).astype(np.int32)
    bf16 = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    x, dy = bf16((num_rows, d0)), bf16((num_rows, d1))
    first_slot = kinds["DW_SCHEDULE_SLOTS"]
    call = jax.jit(lambda *a: jax.ffi.ffi_call("moonep_grouped_matmul_dw", (
        jax.ShapeDtypeStruct((EPN, d0, d1), jnp.bfloat16),
        jax.ShapeDtypeStruct((0, d0, d1), jnp.float32),
        jax.ShapeDtypeStruct((EPN, d0, d1), jnp.float32),
        jax.ShapeDtypeStruct((EPN,), jnp.int32),
        jax.ShapeDtypeStruct((first_slot + EPN,), jnp.int32)))(
            *a, zero_unused_slots=np.int32(zero_unused_slots)))
    no_copies = np.full((NUM_RANKS, EPN), -1, np.int32)
    *_, schedule = call(x, dy, cu_seqlens, np.array([RANK], np.int32), no_copies)
    schedule = np.asarray(schedule)
    slot_rows = sizes[NUM_EXPERTS:]
    listed = np.arange(EPN) if zero_unused_slots else np.flatnonzero(slot_rows)
    assert zero_unused_slots or 0 < len(listed) < EPN
    num_mats = EPN + len(listed)
    assert schedule[kinds["DW_SCHEDULE_MATS"]] == num_mats
    np.testing.assert_array_equal(schedule[first_slot:first_slot + len(listed)], listed)
    items_per_mat = -(-d0 // dsl["DW_TILE_M"]) * -(-d1 // dsl["TILE_N"])
    grid = min(jax.devices()[0].core_count, 2 * EPN * items_per_mat)
    assert num_mats * items_per_mat >= grid
    assert schedule[kinds["DW_SCHEDULE_NEXT_ITEM"]] == num_mats * items_per_mat + grid


def _experts_to_copy(rng, replicated):
    """An `[R, B]` table whose slots on the other rank name exactly this rank's local experts
    `replicated`, and whose slots on this rank name another rank's expert (which must not
    count); -1 elsewhere, in shuffled slot order."""
    table = np.full((NUM_RANKS, EPN), -1, np.int32)
    table[1 - RANK, :len(replicated)] = RANK * EPN + np.asarray(replicated, np.int32)
    table[RANK, 0] = (1 - RANK) * EPN
    return np.stack([row[rng.permutation(EPN)] for row in table])


@pytest.mark.parametrize("num_rows,d0,d1", SHAPES)
@pytest.mark.parametrize("case", CASES)
def test_grouped_matmul_dw_matches_fp32_reference(seed, case, num_rows, d0, d1):
    """dW in its three layouts: fp32 partials of every local expert (all replicated) against an
    fp32 reference; then the public layout (every local expert in bf16) and moe_ffn's (bf16 for
    the experts nobody replicates, fp32 partials for the others, R = 1: no slots) must hold the
    same accumulators, rounded once, bit for bit."""
    from moonep_jax._cuda.grouped_matmul import grouped_matmul_dw_of_groups

    rng = np.random.default_rng(seed + 1)
    cu_seqlens, x, dy, _, _ = _inputs(seed, case, num_rows, d0, d1)
    rank = np.array([RANK], np.int32)
    dw = jax.jit(grouped_matmul_dw_of_groups, static_argnums=(5, 6, 7),
                 static_argnames="zero_unused_slots")
    every = _experts_to_copy(rng, np.arange(EPN))
    _, partial_all, slots = dw(x, dy, cu_seqlens, rank, every, EPN, EPN, EPN)
    partial_all, slots = np.asarray(partial_all), np.asarray(slots)
    starts = np.concatenate([[0], cu_seqlens[:-1]])
    xf, dyf = x.astype(np.float32), dy.astype(np.float32)
    ref = lambda g: xf[starts[g]:cu_seqlens[g]].T @ dyf[starts[g]:cu_seqlens[g]]  # noqa: E731
    for j in range(EPN):
        for out, g in ((partial_all[j], RANK * EPN + j), (slots[j], NUM_EXPERTS + j)):
            expected = ref(g)
            if cu_seqlens[g] == starts[g]:
                assert (out == 0).all(), f"empty group {g} must give zeros"
                continue
            scale = np.sqrt(np.mean(expected ** 2)) + 1e-30
            rows = cu_seqlens[g] - starts[g]
            assert np.abs(out - expected).max() <= 1e-3 * scale * max(1, rows) ** 0.5, g
    rounded = partial_all.astype(jnp.bfloat16)

    public_local, no_partials, public_slots = dw(x, dy, cu_seqlens, rank, every, EPN, 0, EPN)
    assert no_partials.shape == (0, d0, d1) and public_local.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(public_local), rounded)
    np.testing.assert_array_equal(np.asarray(public_slots), slots)

    replicated = np.sort(rng.choice(EPN, size=int(rng.integers(1, EPN)), replace=False))
    others = np.setdiff1d(np.arange(EPN), replicated)
    table = _experts_to_copy(rng, replicated)
    local, partial, used_slots = dw(x, dy, cu_seqlens, rank, table, EPN, EPN, EPN,
                                    zero_unused_slots=False)
    np.testing.assert_array_equal(np.asarray(local)[others], rounded[others])
    np.testing.assert_array_equal(np.asarray(partial)[replicated], partial_all[replicated])
    slot_rows = cu_seqlens[NUM_EXPERTS:] - starts[NUM_EXPERTS:]
    np.testing.assert_array_equal(np.asarray(used_slots)[slot_rows > 0], slots[slot_rows > 0])

    local_only, none_partial, none_slots = dw(x, dy, cu_seqlens, rank, table, EPN, 0, 0)
    assert none_partial.shape[0] == 0 and none_slots.shape[0] == 0
    np.testing.assert_array_equal(np.asarray(local_only), rounded)


@pytest.mark.parametrize("num_local,num_slots", [(3, 3), (3, 0), (5, 2)])
def test_grouped_matmul_dw_covers_every_matrix_of_any_count(seed, num_local, num_slots):
    """dW with other counts of local experts and slots than the layout above (odd ones, and
    fewer slots than local experts): every local expert and slot gets its own group's gradient
    (the items run over the schedule's matrices, matrix after matrix)."""
    from moonep_jax._cuda.grouped_matmul import grouped_matmul_dw_of_groups

    rng = np.random.default_rng(seed)
    num_rows, d0, d1, rank = 2000, 136, 264, 1
    num_experts = 2 * num_local
    # The plan's B slot groups: num_slots, or with no slot gradients (num_slots = 0) epn of them.
    slot_groups = num_slots or num_local
    num_groups = num_experts + slot_groups
    sizes = np.zeros(num_groups, np.int64)
    active = [*range(rank * num_local, (rank + 1) * num_local), *range(num_experts, num_groups)]
    sizes[active] = rng.integers(1, num_rows // len(active), len(active))
    cu_seqlens = np.cumsum(sizes).astype(np.int32)
    x = rng.standard_normal((num_rows, d0)).astype(jnp.bfloat16)
    dy = rng.standard_normal((num_rows, d1)).astype(jnp.bfloat16)
    every = np.full((2, slot_groups), -1, np.int32)
    local, partial, slots = jax.jit(grouped_matmul_dw_of_groups, static_argnums=(5, 6, 7))(
        x, dy, cu_seqlens, np.array([rank], np.int32), every, num_local, 0, num_slots)
    assert partial.shape[0] == 0 and slots.shape[0] == num_slots
    starts = np.concatenate([[0], cu_seqlens[:-1]])
    xf, dyf = x.astype(np.float32), dy.astype(np.float32)
    outputs = [(np.asarray(local[j], np.float32), rank * num_local + j) for j in range(num_local)]
    outputs += [(np.asarray(slots[j]), num_experts + j) for j in range(num_slots)]
    for out, g in outputs:
        expected = xf[starts[g]:cu_seqlens[g]].T @ dyf[starts[g]:cu_seqlens[g]]
        _assert_bf16_close(out, expected)


def test_launchers_captured_into_a_cuda_graph_replay_what_a_direct_launch_writes():
    """Capture safety of the handlers marked kCmdBufferCompatible: forward, dX and dW launches,
    captured into a CUDA graph as XLA's command buffers capture them (no call that capture
    refuses, nothing loaded or allocated on the way), replay twice over poisoned outputs and
    write exactly the direct launch's bytes (a full and a partial M tile, an empty group, a
    used slot, rows of no group)."""
    assert _ffi.lib().grouped_matmul_replays_equal() == (True, True, True)


def test_grouped_matmul_dw_refuses_inference_overflow_configs():
    from moonep_jax import EPConfig
    from moonep_jax._cuda.grouped_matmul import grouped_matmul_dw

    cfg = EPConfig(num_experts=8, top_k=2, tokens_per_rank=16, hidden=64, ffn_hidden=64,
                   num_ranks=2, prefetch_slots=2)
    with pytest.raises(ValueError, match="gradients need prefetch_slots == epn"):
        grouped_matmul_dw(None, None, None, cfg)


def test_grouped_matmul_overflow_needs_the_transport():
    from moonep_jax._cuda.grouped_matmul import grouped_matmul_of_groups

    x = jnp.zeros((16, 64), jnp.bfloat16)
    w_local, w_slots = jnp.zeros((4, 64, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="B = 2 < epn = 4"):
        jax.eval_shape(grouped_matmul_of_groups, x, w_local, w_slots, jnp.zeros(10, jnp.int32),
                       jnp.zeros(1, jnp.int32))


# ---- inference overflow: groups of peers' experts, weights read in place ------------------------

OVERFLOW_EPN, OVERFLOW_B = 4, 2


def _overflow_inputs(rng, R, num_rows, d0, d1):
    """Per rank: group sizes over all G = R*epn + B groups (foreign experts included), rows."""
    from moonep_jax._cuda.grouped_matmul import tile_m

    E = R * OVERFLOW_EPN
    G = E + OVERFLOW_B
    sizes = rng.integers(0, 2 * num_rows // G, (R, G))
    sizes[:, rng.integers(0, G)] = 0                  # an empty group
    sizes[:, rng.integers(0, G)] += tile_m() + 3     # a group over more than one M tile
    scale = np.minimum(1.0, (num_rows - 3) / sizes.sum(axis=1, keepdims=True))
    cu_seqlens = np.cumsum(np.floor(sizes * scale), axis=1).astype(np.int32)
    bf16 = lambda shape: rng.standard_normal(shape).astype(jnp.bfloat16)  # noqa: E731
    return (cu_seqlens, bf16((R, num_rows, d0)), bf16((R, num_rows, d1)),
            bf16((E, d0, d1)), bf16((R * OVERFLOW_B, d0, d1)))


@pytest.mark.parametrize("num_rows,d0,d1", [(1000, 256, 512), (777, 136, 264)])
@pytest.mark.parametrize("R", [1, 2])
def test_grouped_matmul_overflow_forward_and_dx_read_peer_weights(mesh_factory, seed, R, num_rows, d0, d1):
    """B < epn: every group g < E has rows on every rank, so with R = 2 half of them multiply by
    the peer's w_local, read in place; R = 1 runs the same rendezvous with a group of one."""
    from jax.sharding import PartitionSpec as P

    from moonep_jax import EPConfig
    from moonep_jax._cuda import transport
    from moonep_jax._cuda.grouped_matmul import (grouped_matmul_dx_of_groups,
                                                 grouped_matmul_of_groups, transport_attrs)

    mesh = mesh_factory(R)
    transport.bootstrap(mesh, "ep")
    rng = np.random.default_rng(seed)
    cu_seqlens, x, dy, w_all, w_slots = _overflow_inputs(rng, R, num_rows, d0, d1)
    E = R * OVERFLOW_EPN
    cfg = EPConfig(num_experts=E, top_k=1, tokens_per_rank=num_rows, hidden=d0, ffn_hidden=d1,
                   num_ranks=R, prefetch_slots=OVERFLOW_B)

    def per_rank(x, dy, w_local, w_slots, cu_seqlens):
        rank = jax.lax.axis_index("ep").astype(jnp.int32).reshape(1)
        attrs = transport_attrs(cfg)
        y = grouped_matmul_of_groups(x[0], w_local, w_slots, cu_seqlens[0], rank, attrs)
        dx = grouped_matmul_dx_of_groups(dy[0], w_local, w_slots, cu_seqlens[0], rank, attrs)
        return y[None], dx[None]

    y, dx = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
        x, dy, w_all, w_slots, cu_seqlens)
    y, dx = np.asarray(y, np.float32), np.asarray(dx, np.float32)
    for r in range(R):
        end = cu_seqlens[r, -1]
        groups = _group_of_rows(cu_seqlens[r], num_rows)
        y_ref = np.zeros((num_rows, d1), np.float32)
        dx_ref = np.zeros((num_rows, d0), np.float32)
        for row in range(end):
            g = groups[row]
            w = (w_all[g] if g < E else w_slots[r * OVERFLOW_B + g - E]).astype(np.float32)
            y_ref[row] = x[r, row].astype(np.float32) @ w
            dx_ref[row] = w @ dy[r, row].astype(np.float32)
        assert end < num_rows
        assert (y[r, end:] == 0).all() and (dx[r, end:] == 0).all()
        _assert_bf16_close(y[r], y_ref)
        _assert_bf16_close(dx[r], dx_ref)
