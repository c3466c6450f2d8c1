// Constants that the C++ side shares with Python, in one place for every kernel and handler.
//
// Python keeps its own copies where it must run without the extension (moonep_jax/config.py:
// MAX_TOP_K, DROPPED) or at build time (kernels/cutedsl/grouped_matmul.py: KIND_*, TABLE_COLUMNS).
// The extension exports these values (xla_ffi/module.cc) and tests/test_constants.py requires the
// Python copies to equal them, so the two languages cannot drift apart silently.
#pragma once

#include <climits>
#include <cstdint>

namespace moonep {

// Largest top-k (EPConfig.top_k): per-token loops and masks assume K fits one warp.
constexpr int kMaxTopK = 32;

// Plan.dst of a dropped entry (expert id -1, or invalid). Duplicates are -(dest*NvS + row) - 1 >
// kDropped, so -v - 1 of any other negative dst cannot overflow.
constexpr int32_t kDropped = INT32_MIN;

// Grouped-GEMM tile-table kinds and columns, read by the CuTe DSL kernels. kKindOverflow is
// C++ only: it marks a segment of a peer's expert, which goes to the overflow table. An entry is
// (kind, row_start, row_end, mat, first item, N tiles per item): the tile's work items are the
// consecutive items from its first, each of that many N tiles (kernels/grouped_matmul.cu).
constexpr int32_t kKindLocal = 0, kKindSlot = 1, kKindZero = 2;
constexpr int32_t kKindOverflow = 3;
constexpr int32_t kTableFirstItem = 4, kTableItemNTiles = 5;
constexpr int kTableColumns = 6;
// Columns of the schedule row that follows the CuTe tile table: its used entries, the next work
// item, which the persistent CTAs take in turn, and the work items of all used entries.
constexpr int32_t kScheduleTiles = 0, kScheduleNextItem = 1, kScheduleItems = 2;
// dW's schedule [kDwScheduleSlots + B], which its setup kernel fills before each launch: the output
// matrices with work (every local expert's, then the listed slots'), the next work item, then the
// slots with work in ascending order (every slot when unused slots are zeroed, else those with
// rows). dW's work items are the (matrix, M tile, N tile) triples of those matrices.
constexpr int32_t kDwScheduleMats = 0, kDwScheduleNextItem = 1, kDwScheduleSlots = 2;

}  // namespace moonep
