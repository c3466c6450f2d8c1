"""Planning: where every routed entry goes so that every EP rank computes exactly its share.

`plan(topk_idx, cfg)` is the public entry point. `_plan_xla` is the pure-JAX reference planner: the
generation-1 MoonEP plan of `moonep_algorithm.md` §3, run replicated on every rank from the
all-gathered `[R, E]` expert counts (no rank centralises the balancing), with static shapes, no
host callbacks, and only `all_gather` / `all_to_all` over the EP axis. The CUDA planner
(`moonep_jax._cuda.plan.plan`) must produce bit-identical plans.

Phases, each a small function below:
  A  `_gather_counts`    per-rank expert histogram, all-gathered to `[R, E]`.
  B2 `_rank_transfers`   rank-level transfer matrix `z [R, R]` (argmax donor fills argmin receiver).
  B3 `_split_experts`    per-expert split `alloc [E, R]` (largest quota first, hottest expert first).
  C  `_layout`           per-destination group layout: `cu_seqlens`, `zero_fill`, `experts_to_copy`,
                         expert offsets.
  D  `_destinations`     destination rank and row of every local entry.
     `_mark_duplicates`  the lowest k per (token, destination rank) is the primary.
     `_receiver_side`    `recv_src` / `recv_primary` of this rank's rows, via one `all_to_all`.

Entries whose expert id is outside `[0, E)` are dropped: they get no slot, are not counted in the
balancing, and their `dst` is `config.DROPPED`. -1 is the documented "drop this entry"; any other id
outside `[-1, E)` is invalid, dropped the same way and counted in `Plan.num_invalid_ids`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify

from moonep_jax import _checks
from moonep_jax.config import DROPPED, EPConfig
from moonep_jax.plan_types import Plan

_I32 = jnp.int32
_OP = "moonep_jax.plan"


def plan(topk_idx: jax.Array, cfg: EPConfig) -> Plan:
    """Plans one layer call: call inside `jax.shard_map` over `cfg.axis_name`, per EP rank.

    Args:
      topk_idx: `[S, K] int32`, this rank's routed expert ids (row-major entry `i = t*K + k`).
        Duplicate ids within a token are allowed; -1 drops the entry. Ids outside `[-1, E)` are
        invalid: dropped like -1 and counted in `Plan.num_invalid_ids`.
      cfg: the layer's `EPConfig`.

    Returns:
      This rank's `Plan` (see `moonep_jax.Plan` for every field's encoding).

    Raises:
      TypeError / ValueError: at trace time, for a wrong `cfg`, `topk_idx` shape or dtype, or when
        not traced inside `jax.shard_map` over an axis `cfg.axis_name` of size `cfg.num_ranks`.
      checkify.JaxRuntimeError: with `cfg.check_expert_ids`, from `.throw()` of the error that
        `checkify.checkify` returns, when some entry has an invalid id (the message names the EP
        rank and the count).
    """
    _checks.check_config(_OP, cfg)
    _checks.check_array(_OP, "topk_idx", topk_idx, "[S, K]", [cfg.tokens_per_rank, cfg.top_k],
                        jnp.int32)
    _checks.check_ep_axis(_OP, cfg)
    result = _checks.implementation(cfg).plan(topk_idx, cfg)
    if cfg.check_expert_ids:
        _check_expert_ids(result.num_invalid_ids, cfg)
    return result


def _check_expert_ids(num_invalid_ids: jax.Array, cfg: EPConfig) -> None:
    """The opt-in run-time check of `EPConfig.check_expert_ids` (a `checkify` user check).

    Not a host callback that raises: the raising rank would stop while its peers wait for it in
    the next collective.
    """
    checkify.check(
        num_invalid_ids[0] == 0,
        f"`{_OP}`: `topk_idx` of EP rank {{rank}} has {{count}} expert ids outside "
        f"[-1, E) = [-1, {cfg.num_experts}); they were dropped like -1 "
        "(`EPConfig.check_expert_ids=True`).",
        rank=lax.axis_index(cfg.axis_name), count=num_invalid_ids[0])


# ---- the reference planner ----------------------------------------------------------------------


class _Layout(NamedTuple):
    """Phase C for every destination rank `d` (rows of each array)."""

    cu_seqlens: jax.Array       # [R, G] inclusive padded end offset of each group
    zero_fill: jax.Array        # [R, G, 2] (first padding row, padding rows) or (0, 0)
    experts_to_copy: jax.Array  # [R, B] global expert id per slot, -1 unused
    expert_off: jax.Array       # [R, E] first row of expert e's group on d (stale if empty)


def _plan_xla(topk_idx: jax.Array, cfg: EPConfig) -> Plan:
    """The pure-JAX planner (per rank, inside `shard_map`; no validation, see `plan`)."""
    n = cfg.num_entries
    rank = lax.axis_index(cfg.axis_name)
    flat = topk_idx.reshape(n)
    valid = (flat >= 0) & (flat < cfg.num_experts)
    expert = jnp.where(valid, flat, 0)
    num_invalid_ids = jnp.sum(~valid & (flat != -1), dtype=_I32).reshape(1)

    tokens_per_expert = _gather_counts(expert, valid, cfg)
    counts = tokens_per_expert.sum(axis=0)
    z = _rank_transfers(counts, _caps(counts.sum(), cfg.num_ranks), cfg)
    alloc = _split_experts(counts, z, cfg)
    layout = _layout(alloc, cfg)

    dest, row = _destinations(expert, valid, rank, tokens_per_expert, alloc, layout.expert_off, cfg)
    shape_sk = (cfg.tokens_per_rank, cfg.top_k)
    duplicate, primary_row = _mark_duplicates(
        dest.reshape(shape_sk), row.reshape(shape_sk), valid.reshape(shape_sk))
    duplicate, primary_row = duplicate.reshape(n), primary_row.reshape(n)

    encoded = dest * cfg.nvs + row
    dst = jnp.where(valid, jnp.where(duplicate, -encoded - 1, encoded), DROPPED).astype(_I32)
    recv_src, recv_primary = _receiver_side(dest, row, primary_row, valid, rank, cfg)
    return Plan(
        dst=dst,
        cu_seqlens=layout.cu_seqlens[rank],
        zero_fill=layout.zero_fill[rank],
        experts_to_copy=layout.experts_to_copy,
        recv_src=recv_src,
        recv_primary=recv_primary,
        num_invalid_ids=num_invalid_ids,
    )


def _gather_counts(expert: jax.Array, valid: jax.Array, cfg: EPConfig) -> jax.Array:
    """Phase A: every rank's expert histogram.

    Args:
      expert: `[N] int32` expert id of each local entry (any value where not `valid`).
      valid: `[N] bool`, False for dropped entries, which are not counted.

    Returns:
      `[R, E] int32` `tokens_per_expert[r, e]`, identical on every rank.
    """
    local = jnp.zeros(cfg.num_experts, _I32).at[expert].add(valid.astype(_I32))
    return lax.all_gather(local, cfg.axis_name)


def _caps(total: jax.Array, num_ranks: int) -> jax.Array:
    """`[R] int32` entries each destination computes: `T//R`, plus one for the first `T%R` ranks."""
    extra = jnp.arange(num_ranks, dtype=_I32) < total % num_ranks
    return total // num_ranks + extra.astype(_I32)


def _rank_transfers(counts: jax.Array, caps: jax.Array, cfg: EPConfig) -> jax.Array:
    """Phase B1-B2: how many entries each home rank hands to each other rank.

    The most overloaded rank (argmax of balance, ties to the smallest index) fills the most
    underloaded one (argmin, ties to the smallest index) completely in one move; the donor may
    overshoot and become a receiver later. Each receiver therefore has exactly one donor, and the
    loop runs at most R-1 times.

    Args:
      counts: `[E] int32` global count of every expert.
      caps: `[R] int32` entries each rank must compute.

    Returns:
      `z [R, R] int32`, `z[h, u]` = entries of home group `h` computed on rank `u`.
    """
    group_tokens = counts.reshape(cfg.num_ranks, cfg.epn).sum(axis=1)
    balance = group_tokens - caps

    def unbalanced(state):
        balance, _ = state
        return balance.max() > 0

    def fill_one_receiver(state):
        balance, z = state
        donor, receiver = jnp.argmax(balance), jnp.argmin(balance)
        move = -balance[receiver]
        z = z.at[donor, receiver].set(move)
        balance = balance.at[donor].add(-move).at[receiver].set(0)
        return balance, z

    # zeros_like keeps the shard_map "varying over the mesh axes" type of the loop carry.
    z = jnp.zeros_like(balance, shape=(cfg.num_ranks, cfg.num_ranks))
    _, z = lax.while_loop(unbalanced, fill_one_receiver, (balance, z))
    return z


def _split_experts(counts: jax.Array, z: jax.Array, cfg: EPConfig) -> jax.Array:
    """Phase B3: which destination computes how many entries of each expert.

    Per home rank `h` (vectorised over `h`): while some quota `z[h, d]` is left, serve the largest
    quota (ties to the smallest `d`) from the expert with the most entries left (ties to the
    smallest local index), moving `min(remaining, quota)` entries. Everything not moved stays home.

    Args:
      counts: `[E] int32` global count of every expert.
      z: `[R, R] int32` rank-level transfers from `_rank_transfers`.

    Returns:
      `alloc [E, R] int32`, `alloc[e, d]` entries of expert `e` computed on rank `d`; each row sums
      to `counts[e]`.
    """
    num_ranks, epn = cfg.num_ranks, cfg.epn

    def split_home(remaining, quota):
        def quota_left(state):
            remaining, quota, _ = state
            # A donor never sheds more than it owns (§3.12); the second test only bounds the loop.
            return (quota.max() > 0) & (remaining.max() > 0)

        def serve_largest_quota(state):
            remaining, quota, moved = state
            d, le = jnp.argmax(quota), jnp.argmax(remaining)
            take = jnp.minimum(remaining[le], quota[d])
            return (remaining.at[le].add(-take), quota.at[d].add(-take),
                    moved.at[le, d].add(take))

        moved = jnp.zeros_like(remaining, shape=(epn, num_ranks))
        return lax.while_loop(quota_left, serve_largest_quota, (remaining, quota, moved))[2]

    # One loop per home, not a vmap: a vmapped while loop is one batched loop that checkify
    # (EPConfig.check_expert_ids) cannot transform. R is small and the loops are independent.
    per_home = counts.reshape(num_ranks, epn)
    moved = jnp.concatenate([split_home(per_home[h], z[h]) for h in range(num_ranks)])
    home = jnp.arange(cfg.num_experts) // epn
    stays_home = counts - moved.sum(axis=1)
    return moved.at[jnp.arange(cfg.num_experts), home].add(stays_home)


def _layout(alloc: jax.Array, cfg: EPConfig) -> _Layout:
    """Phase C, generation 1: the group layout of every destination rank.

    Group `g < E` is global expert `g`; group `E + b` is slot `b`. Slots hold the top-B remote
    experts of the destination by (count desc, id desc); a slotted expert's global row is empty.
    Remote experts beyond B (inference overflow) stay in their global row. Each non-empty group is
    padded to a multiple of `tp`; groups are laid out back to back in group order.

    Args:
      alloc: `[E, R] int32` from `_split_experts`.

    Returns:
      `_Layout` with one row per destination rank.
    """
    E, B, tp = cfg.num_experts, cfg.num_slots, cfg.token_padding
    expert_ids = jnp.arange(E, dtype=_I32)

    def layout_of(d, count):  # count: [E] entries of each expert that d computes
        remote = (expert_ids // cfg.epn != d) & (count > 0)
        # Lexicographic sort on (-count, -id): remote experts first, larger count then larger id.
        sort_count, sort_neg_id = lax.sort((jnp.where(remote, -count, 1), -expert_ids), num_keys=2)
        slot_used = sort_count[:B] < 0
        slot_expert = jnp.where(slot_used, -sort_neg_id[:B], -1)
        slot_row_of_expert = jnp.where(slot_used, slot_expert, E)  # E: out of bounds, dropped

        in_slot = jnp.zeros(E, bool).at[slot_row_of_expert].set(True, mode="drop")
        group_count = jnp.concatenate([
            jnp.where(in_slot, 0, count),
            jnp.where(slot_used, count[jnp.maximum(slot_expert, 0)], 0),
        ])
        padded = -(-group_count // tp) * tp
        end = jnp.cumsum(padded, dtype=_I32)
        start = end - padded
        has_padding = padded > group_count
        zero_fill = jnp.where(has_padding[:, None],
                              jnp.stack([start + group_count, padded - group_count], axis=1), 0)
        expert_off = start[:E].at[slot_row_of_expert].set(start[E:], mode="drop")
        return end, zero_fill.astype(_I32), slot_expert, expert_off

    cu_seqlens, zero_fill, experts_to_copy, expert_off = jax.vmap(layout_of)(
        jnp.arange(cfg.num_ranks, dtype=_I32), alloc.T)
    return _Layout(cu_seqlens, zero_fill, experts_to_copy, expert_off)


def _destinations(expert, valid, rank, tokens_per_expert, alloc, expert_off, cfg: EPConfig):
    """Phase D: the destination rank and row of every local entry.

    An expert's entries in global order (source rank, then flat index `i`) are cut into
    consecutive chunks in destination-rank order, chunk `d` holding `alloc[e, d]` entries. Laying
    all experts end to end, the chunk (e, d) is the interval ending at `cumsum(alloc.ravel())[e*R+d]`
    of that expert-major global sequence, so one `searchsorted` finds the chunk of each entry.

    Args:
      expert: `[N] int32` expert id of each local entry (any value where not `valid`).
      valid: `[N] bool`.
      rank: this EP rank.
      tokens_per_expert: `[R, E] int32` from `_gather_counts`.
      alloc: `[E, R] int32` from `_split_experts`.
      expert_off: `[R, E] int32` first row of each expert's group per destination.

    Returns:
      `(dest, row)`, both `[N] int32`; meaningless where not `valid`.
    """
    num_ranks = cfg.num_ranks
    counts = tokens_per_expert.sum(axis=0)
    before_rank = jnp.cumsum(tokens_per_expert, axis=0) - tokens_per_expert  # [R, E] exclusive
    before_expert = jnp.cumsum(counts) - counts                              # [E] exclusive

    global_pos = before_expert[expert] + before_rank[rank, expert] + _rank_within_expert(
        expert, valid, tokens_per_expert[rank], cfg)
    global_pos = jnp.where(valid, global_pos, 0)

    chunk_end = jnp.cumsum(alloc.reshape(-1), dtype=_I32)  # [E*R]
    chunk = jnp.searchsorted(chunk_end, global_pos, side="right").astype(_I32)
    chunk = jnp.minimum(chunk, chunk_end.shape[0] - 1)  # only dropped entries can land past the end
    dest = chunk - expert * num_ranks
    pos_in_chunk = global_pos - (chunk_end[chunk] - alloc.reshape(-1)[chunk])
    row = expert_off[dest.clip(0, num_ranks - 1), expert] + pos_in_chunk
    return dest, row


def _rank_within_expert(expert, valid, local_counts, cfg: EPConfig) -> jax.Array:
    """`[N] int32`: how many earlier local entries (smaller `i`) route to the same expert.

    Sorting by the key pair (expert, i) groups the entries by expert in ascending `i` (the order
    the GPU's stable counting sort produces); an entry's sorted position minus its expert's first
    position is its rank within the expert. O(N log N), no [N, E] mask.
    """
    n = cfg.num_entries
    key = jnp.where(valid, expert, cfg.num_experts)
    sorted_key, order = lax.sort((key, jnp.arange(n, dtype=_I32)), num_keys=2)
    first_pos = jnp.cumsum(local_counts) - local_counts
    pos = jnp.arange(n, dtype=_I32)
    rank_sorted = pos - first_pos[jnp.minimum(sorted_key, cfg.num_experts - 1)]
    return jnp.zeros(n, _I32).at[order].set(rank_sorted)


def _mark_duplicates(dest, row, valid):
    """Duplicate canonicalisation: per (token, destination rank), the lowest k is the primary.

    Args:
      dest, row: `[S, K] int32` from `_destinations`.
      valid: `[S, K] bool`; dropped entries neither are nor have duplicates.

    Returns:
      `(duplicate [S, K] bool, primary_row [S, K] int32)`: whether a lower k of the token goes to
      the same rank, and the row of that token's primary entry on `dest` (its own row for a
      primary).
    """
    K = dest.shape[1]
    same_rank = (valid[:, :, None] & valid[:, None, :]
                 & (dest[:, :, None] == dest[:, None, :]))            # [S, K, K']
    earlier = jnp.arange(K)[None, None, :] < jnp.arange(K)[None, :, None]  # [1, K, K']: k' < k
    duplicate = (same_rank & earlier).any(axis=-1)
    primary_k = jnp.argmax(same_rank, axis=-1)                        # first k' on the same rank
    primary_row = jnp.take_along_axis(row, primary_k, axis=1)
    return duplicate, primary_row


def _receiver_side(dest, row, primary_row, valid, rank, cfg: EPConfig):
    """`recv_src` and `recv_primary` of this rank's receive rows.

    Every rank scatters `(src_rank*N + i, primary row)` of each of its entries into a `[R, NvS]`
    buffer per destination and exchanges it with one `all_to_all`. Each real row is written by
    exactly one source (the plan is a bijection), every other source leaves -1 there, so the
    maximum over sources picks the writer.

    Args:
      dest, row, primary_row: `[N] int32`.
      valid: `[N] bool`.
      rank: this EP rank.

    Returns:
      `(recv_src [NvS] int32, recv_primary [NvS] int32)`, -1 for rows nobody writes.
    """
    n, nvs, num_ranks = cfg.num_entries, cfg.nvs, cfg.num_ranks
    source_id = rank * n + jnp.arange(n, dtype=_I32)
    send = jnp.full((num_ranks, nvs, 2), -1, _I32).at[
        jnp.where(valid, dest, num_ranks), row].set(
            jnp.stack([source_id, primary_row], axis=1), mode="drop")
    received = lax.all_to_all(send, cfg.axis_name, 0, 0)  # [R source ranks, NvS, 2]
    recv = received.max(axis=0)
    return recv[:, 0], recv[:, 1]
