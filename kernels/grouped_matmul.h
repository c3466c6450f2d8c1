// Launchers of the CuTe DSL grouped GEMMs (kernels/cutedsl/grouped_matmul.py), bf16 with fp32
// accumulation, for one EP rank. Rows of `[NvS, .]` activations are grouped by `cu_seqlens [G]`
// (inclusive ends, G = E + B); group g < E uses the home rank's `w_local[g - home*epn]` (this
// rank's own, or in inference overflow a peer's, read in place over NVLink), group g >= E uses
// `w_slots[g - E]`. Weights are never concatenated.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/transport.cuh"

namespace moonep {

// Rows per M tile of the ragged-M CuTe kernels (TILE_M in grouped_matmul.py) and of the inference
// overflow kernel (its own CTA tile).
constexpr int32_t kGroupedMatmulTileM = 384;
constexpr int32_t kGroupedMatmulOverflowTileM = 128;
// The ragged-M CuTe kernels' N tile and A chunk (TILE_N, A_CHUNK_M), and the N tiles of one work
// item of a tile whose group has at most one chunk of rows left (WIDE_N_TILES): such an item
// multiplies its one A chunk by that many B tiles (the accumulators of the other chunks hold them).
constexpr int32_t kGroupedMatmulTileN = 128;
constexpr int32_t kGroupedMatmulChunkM = 128;
constexpr int32_t kGroupedMatmulWideNTiles = 3;

// Tile-table entries needed at most with `tile_m`-row tiles: ceil(NvS / tile_m) full tiles, plus
// one partial tile per group, plus the zero tail past cu_seqlens[G-1].
inline int32_t grouped_matmul_max_tiles(int32_t num_rows, int32_t num_groups,
                                        int32_t tile_m = kGroupedMatmulTileM) {
  return (num_rows + tile_m - 1) / tile_m + num_groups + 1;
}

// Rows of the `[rows, kTableColumns]` int32 tile-table scratch of the ragged-M kernels: the CuTe
// tile table, its schedule row (kernels/constants.h), then, when overflow groups are possible, the
// overflow table (a count row, then one entry per overflow tile of kGroupedMatmulOverflowTileM
// rows). Python reads it from the extension (moonep_jax/_cuda/grouped_matmul.py), so the two
// never disagree.
inline int32_t grouped_matmul_table_rows(int32_t num_rows, int32_t num_groups, bool overflow) {
  const int32_t rows = grouped_matmul_max_tiles(num_rows, num_groups) + 1;
  return overflow ? rows + 1 +
                        grouped_matmul_max_tiles(num_rows, num_groups, kGroupedMatmulOverflowTileM)
                  : rows;
}

enum class GroupedMatmulOp { kForward, kDx };

// forward: out [NvS, D1] = in [NvS, D0] . W_g;  dX: out [NvS, D0] = in [NvS, D1] . W_g^T.
// Rows past cu_seqlens[G-1] are written zero.
//
// Inference overflow (`overflow`, decided statically: B < epn): a non-empty group g < E of another
// rank's expert multiplies by the home rank's `w_local[g % epn]`, read in place. The launch then
// publishes `w_local`'s address to the group and barriers (kOpGroupedMatmul), runs the CuTe kernel
// on the local/slot tiles and a second kernel on the overflow tiles (peer weights through the
// published addresses), and barriers again so that no peer frees its w_local while it is read.
// Without `overflow` (training, B == epn) there is no barrier, and a non-empty foreign group (bad
// plan data) gets zero rows.
struct GroupedMatmulParams {
  GroupedMatmulOp op;
  int32_t device;             // CUDA ordinal of the stream's device
  const void* in;             // [num_rows, D0 (fwd) | D1 (dX)] bf16
  const void* w_local;        // [epn, D0, D1] bf16
  const void* w_slots;        // [B, D0, D1] bf16
  void* out;                  // [num_rows, D1 (fwd) | D0 (dX)] bf16
  const int32_t* cu_seqlens;  // [G] inclusive ends
  const int32_t* ep_rank;     // [1] this rank's position on the EP axis (device)
  int32_t* tile_table;        // [grouped_matmul_table_rows(num_rows, G, overflow), kTableColumns]
  int32_t num_rows;           // NvS
  int32_t d0, d1;             // D0, D1; both multiples of 8 (TMA strides)
  int32_t num_local;          // epn
  int32_t num_slots;          // B
  int32_t num_groups;         // G = E + B
  bool overflow;              // B < epn: foreign groups g < E read their weights from peers
  GroupView group;            // this rank's EP group; used only with `overflow`
};

// dW of one rank's groups, accumulated in fp32: for g = rank*epn + j, local expert j's
// x_g^T . dy_g goes to dw_local[j] in bf16, or, when `num_partials` > 0 (= epn) and some entry of
// `experts_to_copy` names that expert (a replica's gradient will be added to it), in fp32 to
// dw_partial[j] and dw_local[j] is left for reduce_grad. Slot b's (g = E + b) goes to dw_slots[b]
// in fp32. Empty groups give zeros, except unused slots with !zero_unused_slots (left unwritten).
struct GroupedMatmulDwParams {
  int32_t device;                  // CUDA ordinal of the stream's device
  const void* x;                   // [num_rows, D0] bf16
  const void* dy;                  // [num_rows, D1] bf16
  void* dw_local;                  // [epn, D0, D1] bf16
  float* dw_partial;               // [num_partials, D0, D1]
  float* dw_slots;                 // [num_slots, D0, D1]
  int32_t* replica_flags;          // [epn] scratch: local expert j receives a replica gradient
  int32_t* schedule;               // [kDwScheduleSlots + num_slots] scratch (kernels/constants.h)
  const int32_t* experts_to_copy;  // [num_copies] = [R, B] flattened
  const int32_t* cu_seqlens;       // [G]
  const int32_t* ep_rank;          // [1]
  int32_t num_rows, d0, d1, num_local;
  int32_t num_partials;  // epn, or 0: every local expert's gradient is written in bf16
  int32_t num_slots;     // B, or 0: no slot gradients (R = 1: no slot can be used)
  int32_t num_copies, num_groups;
  bool zero_unused_slots;  // else the matrices of slots without rows are left unwritten
};

// Loads the three exported kernels on every device (once per process). Call at bootstrap.
cudaError_t load_grouped_matmul();

// Return cudaErrorInvalidValue for shapes the kernels do not support (D0 or D1 not a multiple
// of 8, non-positive sizes, with `overflow`: G - B != R * epn; dW: num_partials not 0 or epn).
cudaError_t launch_grouped_matmul(const GroupedMatmulParams& params, cudaStream_t stream);
cudaError_t launch_grouped_matmul_dw(const GroupedMatmulDwParams& params, cudaStream_t stream);

// Test support (kernels/grouped_matmul_capture.cu): on the current device, each launcher (forward,
// dX, dW) captured into a CUDA graph as XLA's command buffers capture it; *forward, *dx, *dw: the
// graph's replays write exactly what a direct launch writes. Errors: the first CUDA error, e.g.
// a call that stream capture refuses.
cudaError_t grouped_matmul_replays_equal(bool* forward, bool* dx, bool* dw);

}  // namespace moonep
