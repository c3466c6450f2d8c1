"""The MoonEP plan: the static-shape routing metadata shared by every op of one layer call."""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """Where every routed entry of this rank goes, and what this rank receives (per EP rank).

    All leaves are int32 arrays with static shapes; the plan is cheap to save as a residual.
    Every implementation ("xla", "cuda") produces bit-identical plans for the same `topk_idx`.

    Attributes:
      dst: `[N] int32`, N = S*K, entry `i = t*K + k`. `dest*NvS + row` for the entry that owns
        row `row` of rank `dest`; `-(dest*NvS + row) - 1` for a duplicate (a lower k of the same
        token already goes to `dest`: its hidden row crosses the link once, and the receiver
        writes the duplicate row from that same read); `config.DROPPED` for a dropped entry:
        expert id -1, or an invalid id outside `[-1, E)`.
      cu_seqlens: `[G] int32`, G = E + B: inclusive padded end offset of each group's rows. Group
        `g < E` is global expert `g` (this rank's own experts, and overflow experts in inference),
        group `E + b` is replica slot `b`. Empty groups repeat the previous value.
      zero_fill: `[G, 2] int32`: `(first padding row, number of padding rows)` of each group, or
        `(0, 0)` when the group has no padding.
      experts_to_copy: `[R, B] int32`: global expert id replicated into slot `b` of rank `r`, or -1
        for an unused slot. The full table (every rank's slots) is on every rank.
      recv_src: `[NvS] int32`: for each receive row of this rank, `src_rank*N + i` of the entry
        that owns it; -1 for padding rows and rows past `cu_seqlens[-1]`.
      recv_primary: `[NvS] int32`: for each receive row, the row of this rank holding the primary
        (lowest k) entry of the same `(src_rank, token)`: the row itself for a primary, another
        row for a duplicate; -1 where `recv_src` is -1.
      num_invalid_ids: `[1] int32`: how many of this rank's `topk_idx` entries have an expert id
        outside `[-1, E)` (E, 1000, -2, ...). Such an entry is a caller bug; it is dropped exactly
        like -1 (so every other field equals the plan of the same routing with those ids set to
        -1) and counted here, so that it is never silent (`EPConfig.check_expert_ids` raises).
    """

    dst: jax.Array
    cu_seqlens: jax.Array
    zero_fill: jax.Array
    experts_to_copy: jax.Array
    recv_src: jax.Array
    recv_primary: jax.Array
    num_invalid_ids: jax.Array
