"""CuTe DSL grouped GEMM for sm_90a (TMA + WGMMA, bf16 in, fp32 accumulation).

Three exported kernels share one CTA program (`GroupedMatmul`):

- `moonep_grouped_matmul`     `y [NvS, D1] = x [NvS, D0] . W_g`, rows grouped (ragged M);
- `moonep_grouped_matmul_dx`  `dx [NvS, D0] = dy [NvS, D1] . W_g^T`, rows grouped (ragged M);
- `moonep_grouped_matmul_dw`  `dW_g [D0, D1] = x_g^T . dy_g`, one output matrix per local expert
  and per slot (ragged K), accumulated in fp32 and stored in bf16 for the local experts no replica
  contributes to, in fp32 for the others (partials that reduce_grad completes) and the slots.

Ragged M: a tile table `[T, TABLE_COLUMNS] int32` (built on the device by
kernels/grouped_matmul.cu) gives, per M tile, `(kind, row_start, row_end, mat, first item, N tiles
per item)`: kind 0 multiplies rows `[row_start, row_end)` by `w_local[mat]`, kind 1 by
`w_slots[mat]`, kind 2 writes zeros (rows past `cu_seqlens[-1]`). Its schedule row says how many of
the T entries the plan uses (the rest are never read) and how many work items they have. A tile's
items are consecutive, from its first: each covers one N tile, or, in a tile whose group has at
most one 128-row chunk of rows left, `WIDE_N_TILES` of them (a wide item, see below). A tile loads,
with TMA, the 128-row chunks of its `TILE_M` rows from `row_start` that hold rows of its group (the
last one also rows of the next group, or zeros past the end), and its stores are masked to
`[row_start, row_end)`, so a tile only ever writes rows of its own group. Weights are never
concatenated: `w_local [epn, D0, D1]` and `w_slots [B, D0, D1]` are each one rank-3 TMA tensor
whose third mode is the matrix, so a K or N tile that runs past D0 or D1 reads zeros, never the
next matrix (which may be an unused slot holding anything, NaN included: moe_ffn leaves unused
slots unwritten).

Ragged K (dW): output matrix `j < epn` is local expert `home*epn + j` (group `home*epn + j`),
`j >= epn` is slot `j - epn` (group `E + j - epn`); the K loop runs over the group's rows. The
last K tile of a group also loads rows of the next group: they are zeroed in shared memory before
the WGMMAs read it. Local expert `j` goes to `dw_local[j]` (bf16, rounded from the fp32
accumulators) unless `replica_flags[j]` is set and `dw_partial` has matrices: then its fp32 sum
goes to `dw_partial[j]`, the first term of reduce_grad's fixed-order sum, and `dw_local[j]` is left
for reduce_grad to write. So an expert without replicas is written once, in bf16, and nothing
else in the step touches it. An empty group runs no K tile and writes zeros, except an empty slot
group when unused slots are not zeroed: it has no work items (moe_ffn never reads an unused slot's
gradient, and zeroing B = epn fp32 slot matrices costs more than the slots that hold rows). The
work items are those of the matrices with work, which the call's setup kernel lists in dW's
`schedule` (kernels/constants.h), with its counter.

The CTA program is persistent and warp-specialised: one CTA per SM walks the work items, taking
each next one from a counter (ragged M: in the tile table's schedule row; dW: in its schedule) and
handing it to its consumer warps through a shared-memory ring; warp 0 of warp group 0
(registers given back) issues the TMA loads of every item into a multi-stage mbarrier ring and
runs ahead into the next item, while warp groups 1 and 2 (alternate 64-row blocks of the tile
each, 64 x TILE_N WGMMAs) consume the stages and store the accumulators straight from registers
with row/column predicates, so one item's epilogue overlaps the next item's loads. In a ragged-M
tile a warp group issues WGMMAs only for its blocks that hold rows of the group (a separate K
loop per block count; an idle warp group only releases the stages), so a group's last tile costs
MMAs for its rows rounded up to 64.

Ragged-M tiles are 384 x 128 (M x N; each consumer warp group owns one 64-row block of each of the
three 128-row chunks, 192 fp32 accumulators per thread): a group of up to 384 rows is one M tile,
so its weights stream from memory once per N tile. Ragged M stages its operands in a ring of 16 KB
slots (14 in the shared memory), each one 128 x 64 tile: an A chunk or the B tile. A K tile takes a
slot per A chunk that holds rows of the group and one for B, so a tile of up to 128 rows keeps 7 K
tiles in flight (3.5 in its wide items, below) and a full one 3.5. With stages of a fixed 64 KB (3, A for 384 rows and B) a small
group's tile filled each stage only to 32 KB and waited on memory latency: at high skew every extra
tile cost ~19 us, half of what an average tile costs (bench_gemm, gate_up forward, fitted over the
groupings), while the SMs stayed busy (ncu: active 96 % of the time at maxvio 0.2 and 20) and the
tensor pipes fell from 81 % to 61 %. The ring against those stages (one H200, one call, R=2 maxvio
20): gate_up forward 8.46 against 8.72 ms, dX 8.66 against 9.23; down forward 4.69 against 4.87, dX
4.46 against 4.62; at maxvio 0.2 within the runs' spread. Still, a tile of up to 128 rows moved 2
slots per K tile for at most 2 of its 64-row MMA blocks, a full one 4 for 6, and a model of each
tile's time as the larger of its MMAs and its slots' bytes at ~48 B per clock and SM gave the split
of ncu's K-loop stall samples over 3-, 2- and 1-chunk tiles of the down forward at R=2 maxvio 20
(62 / 14 / 24 % against 62 / 15 / 23 %). So such a tile's items are wide: an item takes
WIDE_N_TILES N tiles, and per K tile its one A chunk and a B tile per N tile, 4 slots for up to 6
blocks, its N tiles' accumulators those of the chunks it does not have (ncu kernel times, one H100,
the bench_gemm plans: the forward and dX at R=2 maxvio 1 / 10 / 20 0.3-4.8 % faster, summed over
R=2 and R=8 1.6 %; at maxvio 0.2, 2 such tiles in 195, 0.7-1.1 % slower, which reading the search's
table entries an item ahead did not recover). The producer locates an item's tile in the table by
the entries' first items, a ballot over a warp of entries. The items are taken group by group;
dealing the single-tile groups' items evenly between the larger groups' instead, so that their
weight streams would overlap the full tiles' MMAs (a model of the items predicted 2 % at maxvio
20), was slower at every point (ab_gemm, one H200, new/base/base/new, R=2 maxvio 10 / 20: forward
and dX 0.3-2.6 %, summed 1.1 %). With 256-row tiles a real EP=2 plan's
~340-row groups took a full and a partial tile that each streamed the weights; the partial tile,
twice as fast through its MMAs, ran ahead of the full one, so both missed L2 (ncu, gate_up forward
at the R=2 maxvio 1 plan: 29 GB read from DRAM for 11 GB of weights, L2 hit rate 27 %, 62 % of
dense). Earlier, 128 x 256 tiles had taken two M tiles for the ~170-row groups of a 384-expert plan
(bench_gemm gate_up forward at maxvio 0.2: 45 % of dense, 52 % with 256 x 128, 64-68 % once a warp
group also skipped its empty 64-row blocks). dW tiles D0 by 256 (`DW_TILE_M`): its K is the group's
rows, taken 32 at a time (`DW_TILE_K`, see there why), and its epilogue stages a bf16 tile in
shared memory next to 6 pipeline stages. The two dW warp groups share every stage but not their
epilogues: each zeroes the K tail of the rows it reads and stores its own 64-row blocks (its own
barriers and TMA-store warp), and warp group 1 runs `DW_LAG_K_TILES` K tiles behind warp group 0,
so that one group's epilogue can overlap the other's last K tiles of an item (bench_gemm's dW
groupings, A/B in both process orders: gate_up 1-4 % faster at R <= 2 and 1 % at R = 8, down within
+-2 %). Tried and not kept: pingpong warp groups on 128 x 128 items of their own (17-25 % slower: a
third more operand bytes per FLOP through L2, the kernel ran at the same ~6 TB/s from L2 either
way), 256 x 192 or 256 x 160 tiles (fewer bytes per FLOP, fewer stages: within +-5 %), and, each
within +-3 % summed over bench_gemm's dW groupings: 2-CTA clusters taking adjacent N tiles with the
A tile multicast (a third fewer bytes from L2), 128 x 256 tiles of 64 x 256 WGMMAs (a sixth fewer
operand reads from shared memory), lags of 1 or 2 K tiles, 8 ring stages. At R = 2 the kernel is
bound by no one of these streams: left without its WGMMAs it still takes 78-90 % of its time,
without its output stores 88-92 % (README, grouped GEMM). What it is bound by is each warp group's
work per item, which only the other warp group's last DW_LAG_K_TILES K tiles of MMAs cover (ncu
stall samples at R = 2: ~3,600 cycles per item of index arithmetic, K-tail zeroing, epilogue and
accumulator zeroing, against ~2,800 of its own MMAs); so that work is kept short: the producer warp
decodes the items (coordinates, the group's rows, where the sum goes) and hands them over decoded,
the K tail is zeroed by a fixed set of predicated stores (`zero_columns`). Dealt with a grid stride
instead of taken from the counter, dW's items left the most loaded CTA 2-4.5 % above the mean for
down at maxvio >= 10 (a model of the items), and the consumers decoded each item themselves
(ab_gemm, dW, one call, new/base/base/new, R = 2 maxvio 0.2 / 1 / 10 / 20, R = 8 maxvio 1 / 20, R1
E192 maxvio 20: summed 1.5 % faster; at maxvio 20 4-11 % faster at every point, gate_up at R = 2
maxvio 0.2 / 1 1-6 % slower). Those slower points were the unused slots' items: taken from the
counter, each still cost its CTA an atomic and a decode (R = 2: ~190 unused slots, half of the
items); with the schedule listing only the matrices with work, the same A/B against that kernel:
summed 3.4 % faster, every R = 2 call 3-7 % faster, R = 8 and R = 1 (no slots) within -2 to +4 %.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

# M x N x K tiles. Ragged M (forward, dX) takes 384 rows: a real plan's groups hold ~S*K*R/E rows
# (~340 at EP=2), so one tile covers a whole group and its weights stream from memory once per N
# tile (see the module docstring). dW tiles D0 by 256 (its epilogue stages a tile in shared memory)
# and K by 32: its stages hold both operands, and 64-deep ones (48 KB) left room for 3 beside the
# epilogue's tile; 32-deep ones give 6 (bench_gemm, every grouping: dW 3-9 % faster; the ragged-M
# kernels, whose ring already holds 14 slots, ran 7-14 % slower with 32, so they keep 64).
TILE_M, DW_TILE_M, TILE_N, TILE_K, DW_TILE_K = 384, 256, 128, 64, 32
# Ragged M loads A in 128-row chunks, each into a slot of its own, and skips the chunks past the
# group's end: a tile of a small group would otherwise pull 384 rows of A through L2 for each K
# tile, and take the shared memory of a full tile.
A_CHUNK_M = 128
A_CHUNKS = TILE_M // A_CHUNK_M  # chunks of a ragged-M tile
# N tiles of a wide work item: that of a tile whose group has at most one chunk of rows left, which
# multiplies its chunk by this many B tiles into the accumulators the other chunks would use (the
# table kernel decides which items are wide: kernels/grouped_matmul.h holds the C++ copy).
WIDE_N_TILES = 3
ATOM_M = 64  # rows of one WGMMA; the two consumer warp groups own the two halves of a chunk
# Tile table columns and kinds (the C++ copies are in kernels/constants.h; tests/test_constants.py
# holds the two equal). An entry is (kind, row_start, row_end, mat, first item, N tiles per item).
KIND_LOCAL, KIND_SLOT, KIND_ZERO = 0, 1, 2
TABLE_FIRST_ITEM, TABLE_ITEM_N_TILES = 4, 5
TABLE_COLUMNS = 6
# Columns of the schedule row (after the table): the table's used entries, the next work item, the
# work items of the used entries.
SCHEDULE_TILES, SCHEDULE_NEXT_ITEM, SCHEDULE_ITEMS = 0, 1, 2
# dW's schedule: its matrices with work, the next work item, then the slots with work.
DW_SCHEDULE_MATS, DW_SCHEDULE_NEXT_ITEM, DW_SCHEDULE_SLOTS = 0, 1, 2
# Work items the producer warp hands its consumers ahead (shared-memory ring), and the int32
# words of one: ragged M hands its (table tile, first N tile), NO_TILE after the last; dW its
# decoded (matrix, M tile, N tile, rows, to_partial).
ITEM_STAGES = 4
ROWS_ITEM_WORDS, DW_ITEM_WORDS = 2, 5
NO_TILE = -1
# Each stride and dimension that TMA sees must be a multiple of 16 bytes = 8 bf16.
ALIGN_ELEMS = 8
# Warp specialisation: warp group 0 loads (one warp issues TMA), warp groups 1 and 2 compute.
THREADS_PER_GROUP = 128
WARPS_PER_GROUP = THREADS_PER_GROUP // cute.arch.WARP_SIZE
CONSUMER_GROUPS = 2
NUM_CONSUMER_THREADS = CONSUMER_GROUPS * THREADS_PER_GROUP
# Registers per thread of the producer and the consumer warp groups after setmaxnreg. The CTA
# starts with REGISTERS_PER_SM / 384 threads, rounded down to 8 (168 each), and the consumers can
# only take what the producer warp group gives back (a pool per CTA: a split of 32 / 240, 1024
# registers more than the CTA has, made the consumers' setmaxnreg wait forever), so the split must
# keep 128 * producer + 256 * consumer <= 384 * 168 (`GroupedMatmul` checks it).
PRODUCER_REGS, CONSUMER_REGS = 40, 232
REGISTERS_PER_SM = 65536
# Named barriers (0 is __syncthreads): dW's consumer warp group g synchronises its own threads on
# FIRST_GROUP_BARRIER + g; warp group 1 waits on LAG_BARRIER for warp group 0's head start.
FIRST_GROUP_BARRIER, LAG_BARRIER = 1, 3
# dW: warp group 1 multiplies this many K tiles behind warp group 0 (it starts once warp group 0
# has issued that many), so that one group's epilogue runs while the other still multiplies the
# item's last K tiles. Both read every stage, so the lag must stay below the ring's stages.
DW_LAG_K_TILES = 3
# dW's bf16 epilogue stages this many ATOM_M x TILE_N blocks in shared memory (a multiple of
# CONSUMER_GROUPS dividing DW_TILE_M // ATOM_M): the rest of the shared memory is the ring's. All
# four blocks of a tile leave 6 ring stages; one block per warp group (the second waiting for the
# first's store) leaves 8, and measured no faster (bench_gemm's dW at R = 2 and 8, in one call,
# both process orders: -3 to +3 % with DW_LAG_K_TILES 3 or 5).
DW_EPILOGUE_STAGES = 4


def rows_num_n_tiles(c: cute.Tensor):
    """N tiles of a ragged-M output `c [M, N]`."""
    return cute.ceil_div(cute.size(c, mode=[1]), TILE_N)


@cute.jit
def tile_chunks(row_start: cutlass.Int32, row_end: cutlass.Int32):
    """A_CHUNK_M-row chunks of a ragged-M tile that hold rows of its group: the slots of A its K
    tiles take (row_end is the group's end, which may lie past the tile)."""
    return cutlass.max(cutlass.min(cute.ceil_div(row_end - row_start, A_CHUNK_M), A_CHUNKS), 0)


def weight_grad_tiles(dw_local: cute.Tensor):
    """(M tiles, N tiles) of one dW output matrix."""
    return (cute.ceil_div(cute.size(dw_local, mode=[0]), DW_TILE_M),
            cute.ceil_div(cute.size(dw_local, mode=[1]), TILE_N))


def weight_grad_num_items(dw_local: cute.Tensor, num_mats):
    """Work items of dW: (output matrix, M tile, N tile) triples of `num_mats` matrices."""
    num_m_tiles, num_n_tiles = weight_grad_tiles(dw_local)
    return num_m_tiles * num_n_tiles * num_mats


def persistent_cta():
    """(first work item, item stride, warp-uniform warp index, thread index) of this CTA: CTA
    `b` of a grid of `g` starts with item b, then takes `g` plus the counter's next value."""
    first_item, _, _ = cute.arch.block_idx()
    item_stride, _, _ = cute.arch.grid_dim()
    tidx, _, _ = cute.arch.thread_idx()
    return first_item, item_stride, cute.arch.make_warp_uniform(cute.arch.warp_idx()), tidx


class GroupedMatmul:
    """One CTA program for the three grouped GEMMs: `rows` (forward, dX) and `weight_grad`."""

    def __init__(self):
        self.atom_layout_mnk = (2, 1, 1)  # two consumer warp groups, alternate 64-row blocks
        self.num_threads = THREADS_PER_GROUP + NUM_CONSUMER_THREADS
        launch_regs = REGISTERS_PER_SM // self.num_threads // 8 * 8  # a thread's share of the pool
        assert (THREADS_PER_GROUP * PRODUCER_REGS + NUM_CONSUMER_THREADS * CONSUMER_REGS
                <= self.num_threads * launch_regs), (
            f"PRODUCER_REGS / CONSUMER_REGS: the consumers would wait forever for registers the "
            f"CTA does not have ({launch_regs} a thread at launch)")
        self.acc_dtype = cutlass.Float32
        self.buffer_align_bytes = 1024

    def _setup(self, a: cute.Tensor, b: cute.Tensor, tile_mnk, stage_bytes: int,
               reserved_bytes: int = 0):
        """The tiled MMA and `num_stages` stages of `stage_bytes` in the shared memory left after
        `reserved_bytes`; `a_smem_staged` and `b_smem_staged` stage A and B tiles of `tile_mnk`
        (their bytes per stage need not be `stage_bytes`: ragged M views one buffer both ways)."""
        self.ab_dtype = a.element_type
        a_layout = utils.LayoutEnum.from_tensor(a)
        b_layout = utils.LayoutEnum.from_tensor(b)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, a_layout.sm90_mma_major_mode(),
            b_layout.sm90_mma_major_mode(), self.acc_dtype, self.atom_layout_mnk,
            tiler_mn=(ATOM_M, TILE_N))
        smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")
        self.stage_bytes = stage_bytes
        self.num_stages = (smem_capacity - 2048 - reserved_bytes) // stage_bytes
        self.a_smem_staged = sm90_utils.make_smem_layout_a(
            a_layout, tile_mnk, self.ab_dtype, self.num_stages)
        self.b_smem_staged = sm90_utils.make_smem_layout_b(
            b_layout, tile_mnk, self.ab_dtype, self.num_stages)

    def _tma_load(self, tensor: cute.Tensor, smem_staged, tile_shape):
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), tensor,
            cute.slice_(smem_staged, (None, None, 0)), tile_shape)

    def _shared_storage(self, item_words: int, **buffers):
        """Shared memory: the pipeline's barriers, the work-item ring of `item_words` int32 per
        item and its barriers, then one buffer per keyword, each as large as the cosize of the
        layout it is given."""
        self.item_words = item_words  # make_item_pipeline's view of the ring
        def buffer(layout):
            return cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(layout)], self.buffer_align_bytes]

        fields = {"pipeline_barriers": cute.struct.MemRange[cutlass.Int64, self.num_stages * 2],
                  "item_barriers": cute.struct.MemRange[cutlass.Int64, ITEM_STAGES * 2],
                  "items": cute.struct.MemRange[cutlass.Int32, ITEM_STAGES * item_words]}
        fields.update({name: buffer(layout) for name, layout in buffers.items()})
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ---- ragged M: forward and dX ------------------------------------------------------------

    @cute.jit
    def rows(self, a: cute.Tensor, b_local: cute.Tensor, b_slots: cute.Tensor, c: cute.Tensor,
             tile_table: cute.Tensor, schedule: cute.Tensor, num_ctas: cutlass.Int32,
             stream: cuda.CUstream):
        """`c[rows of tile] = a[rows] . B_mat^T` for every used tile of `tile_table`.

        `a [M, K]`, `b_* (N, K, mats)` (the weights in (N, K) orientation, one matrix per index
        of the last mode), `c [M, N]`; `schedule [TABLE_COLUMNS]` the table's schedule row (its
        used tiles, the item counter at 0, its work items); `num_ctas` persistent CTAs (one per
        SM) share the work items: each is one N tile of a table tile, or WIDE_N_TILES of them.
        """
        # Stage s of the ring is one slot: an A chunk (a_smem_staged's view of it) or a B tile
        # (b_smem_staged's), both A_CHUNK_M (= TILE_N) x TILE_K.
        assert TILE_N == A_CHUNK_M, "an A chunk and a B tile share one slot size"
        self._setup(a, b_local, (A_CHUNK_M, TILE_N, TILE_K),
                    stage_bytes=A_CHUNK_M * TILE_K * a.element_type.width // 8)
        # A warp group holds a K tile's slots while it waits for the next one's.
        assert self.num_stages >= 2 * (A_CHUNKS + 1), "the slot ring is too small"
        tma_a, tma_tensor_a = self._tma_load(a, self.a_smem_staged, (A_CHUNK_M, TILE_K))
        tma_b_local, tma_tensor_b_local = self._tma_load(
            b_local, self.b_smem_staged, (TILE_N, TILE_K))
        tma_b_slots, tma_tensor_b_slots = self._tma_load(
            b_slots, self.b_smem_staged, (TILE_N, TILE_K))
        self.shared_storage = self._shared_storage(ROWS_ITEM_WORDS, slots=self.a_smem_staged)
        # A wide item's N tiles take the accumulators of the tile's chunks.
        assert WIDE_N_TILES <= A_CHUNKS, "a wide item has an accumulator per N tile"
        # Work items at most: one per (table entry, N tile).
        num_items = rows_num_n_tiles(c) * cute.size(tile_table, mode=[0])
        self.rows_kernel(
            self.tiled_mma, tma_a, tma_tensor_a, tma_b_local, tma_tensor_b_local, tma_b_slots,
            tma_tensor_b_slots, c, tile_table, schedule, self.a_smem_staged, self.b_smem_staged,
        ).launch(grid=(cutlass.min(num_ctas, num_items), 1, 1), block=(self.num_threads, 1, 1),
                 stream=stream)

    @cute.jit
    def item_coords(self, item: cutlass.Int32, tile: cutlass.Int32, tile_table: cute.Tensor,
                    num_tiles: cutlass.Int32):
        """Producer warp: (table tile, first N tile) of work item `item`. The tile is the last
        used entry whose first item is at most `item`, searched forward from `tile` (a CTA's
        items ascend, so its last item's tile): each lane reads one entry's first item, and a
        ballot counts those at most `item`, a warp's worth of entries per step."""
        lane = cute.arch.lane_idx()
        ahead = cutlass.Int32(cute.arch.WARP_SIZE)
        first = cutlass.Int32(0)
        while ahead == cute.arch.WARP_SIZE:
            first = item + 1
            if tile + lane < num_tiles:
                first = tile_table[tile + lane, TABLE_FIRST_ITEM]
            ahead = cute.arch.popc(cute.arch.vote_ballot_sync(first <= item))
            tile = tile + ahead - 1
        first = cute.arch.shuffle_sync(first, ahead - 1)
        return tile, (item - first) * tile_table[tile, TABLE_ITEM_N_TILES]

    @cute.jit
    def rows_item(self, tile: cutlass.Int32, n_tile: cutlass.Int32, mA: cute.Tensor,
                  mB_local: cute.Tensor, mB_slots: cute.Tensor, mC: cute.Tensor,
                  tile_table: cute.Tensor):
        """Work item (table tile, first N tile) -> (kind, row_start, row_end, K tiles, the
        entry's N tiles per item, the item's N tiles, gA, gB_local, gB_slots); `gA` is
        (A_CHUNK_M, TILE_K, row chunk, K tile) from `row_start`, `gB_*` (TILE_N, TILE_K, N tile,
        K tile)."""
        kind = tile_table[tile, 0]
        row_start = tile_table[tile, 1]
        row_end = tile_table[tile, 2]
        mat = tile_table[tile, 3]
        item_n_tiles = tile_table[tile, TABLE_ITEM_N_TILES]
        n_tiles = cutlass.min(item_n_tiles, rows_num_n_tiles(mC) - n_tile)
        num_k_tiles = cute.ceil_div(cute.size(mA, mode=[1]), TILE_K)
        if kind == KIND_ZERO:
            num_k_tiles = 0
        gA = cute.local_tile(cute.domain_offset((row_start, 0), mA), (A_CHUNK_M, TILE_K),
                             (None, None))
        gB_local = cute.local_tile(mB_local[None, None, mat], (TILE_N, TILE_K), (None, None))
        gB_slots = cute.local_tile(mB_slots[None, None, mat], (TILE_N, TILE_K), (None, None))
        return (kind, row_start, row_end, num_k_tiles, item_n_tiles, n_tiles, gA, gB_local,
                gB_slots)

    @cute.kernel
    def rows_kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor,
                    tma_b_local: cute.CopyAtom, mB_local: cute.Tensor,
                    tma_b_slots: cute.CopyAtom, mB_slots: cute.Tensor, mC: cute.Tensor,
                    tile_table: cute.Tensor, schedule: cute.Tensor, a_slots: cute.ComposedLayout,
                    b_slots: cute.ComposedLayout):
        ab_pipeline, storage = self.make_pipeline()
        item_pipeline, sItems = self.make_item_pipeline(storage)
        sA = storage.slots.get_tensor(a_slots.outer, swizzle=a_slots.inner)
        sB = storage.slots.get_tensor(b_slots.outer, swizzle=b_slots.inner)
        # Only the table's used tiles have items: the unused entries past them cost no iteration.
        num_tiles = schedule[SCHEDULE_TILES]
        num_items = schedule[SCHEDULE_ITEMS]
        first_item, item_stride, warp_idx, tidx = persistent_cta()
        if warp_idx < WARPS_PER_GROUP:
            cute.arch.warpgroup_reg_dealloc(PRODUCER_REGS)
            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b_local)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b_slots)
                producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                        self.num_stages)
                item_producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                             ITEM_STAGES)
                # Items are taken, not dealt: after its first one a CTA takes the next untaken
                # one when its producer gets to it, so a CTA whose items were small takes more.
                # Dealt round-robin, the tiles of skewed plans (1 to 384 rows) left the most
                # loaded CTA 4-7 % above the mean (a model of the real plans' items, MMA time
                # per 128-row chunk; 1 % at maxvio 0.2). Items still start in order, so a table
                # tile's N tiles run side by side and share its A rows in L2.
                item = first_item
                tile = cutlass.Int32(0)
                while item < num_items:
                    next_item = self.taken_item(
                        self.take_item(schedule.iterator + SCHEDULE_NEXT_ITEM), item_stride)
                    tile, n_tile = self.item_coords(item, tile, tile_table, num_tiles)
                    item_producer = self.hand_item(item_pipeline, item_producer, sItems,
                                                   (tile, n_tile))
                    kind, row_start, row_end, num_k_tiles, _, n_tiles, gA, gB_local, gB_slots = (
                        self.rows_item(tile, n_tile, mA, mB_local, mB_slots, mC, tile_table))
                    a_chunks = tile_chunks(row_start, row_end)
                    if kind == KIND_SLOT:
                        producer = self.load_rows(ab_pipeline, producer, tma_a, gA, sA, a_chunks,
                                                  tma_b_slots, gB_slots, sB, n_tile, n_tiles,
                                                  num_k_tiles)
                    else:
                        producer = self.load_rows(ab_pipeline, producer, tma_a, gA, sA, a_chunks,
                                                  tma_b_local, gB_local, sB, n_tile, n_tiles,
                                                  num_k_tiles)
                    item = next_item
                item_producer = self.hand_item(item_pipeline, item_producer, sItems,
                                               (cutlass.Int32(NO_TILE), cutlass.Int32(0)))
                ab_pipeline.producer_tail(producer)
                item_pipeline.producer_tail(item_producer)
        else:
            cute.arch.warpgroup_reg_alloc(CONSUMER_REGS)
            thread = tidx - THREADS_PER_GROUP
            # This warp group's first row in a chunk (the warp groups take the two ATOM_M-row
            # halves of every chunk), from the warp-uniform warp index: ptxas serialises WGMMAs
            # under a branch it cannot prove uniform.
            first_row = (warp_idx // WARPS_PER_GROUP - 1) * ATOM_M
            # Accumulator i: this warp group's ATOM_M x TILE_N block of chunk i, or in a wide
            # item of N tile n_tile + i (of the one chunk).
            tCrA, tCrB, accumulators, read, release = self.consumer_setup(
                tiled_mma, sA, sB, thread, (A_CHUNK_M, TILE_N), A_CHUNKS)
            item_consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                         ITEM_STAGES)
            words, item_consumer = self.receive_item(item_pipeline, item_consumer, sItems)
            tile, n_tile = words
            while tile != NO_TILE:
                kind, row_start, row_end, num_k_tiles, item_n_tiles, n_tiles, _, _, _ = (
                    self.rows_item(tile, n_tile, mA, mB_local, mB_slots, mC, tile_table))
                read, release = self.consume_rows(
                    ab_pipeline, read, release, tiled_mma, tCrA, tCrB, accumulators,
                    num_k_tiles, tile_chunks(row_start, row_end), n_tiles,
                    row_end - row_start, first_row)
                # Store rows [row_start, row_end) and columns < N (and < D0 for dX): accumulator
                # i at chunk i of N tile n_tile, or in a wide item at chunk 0 of N tile
                # n_tile + i.
                chunk_step = cutlass.Int32(1)
                n_step = cutlass.Int32(0)
                if item_n_tiles > 1:
                    chunk_step = cutlass.Int32(0)
                    n_step = cutlass.Int32(1)
                for i in cutlass.range_constexpr(A_CHUNKS):
                    chunk = i * chunk_step
                    n = n_tile + i * n_step
                    gC = cute.local_tile(cute.domain_offset((row_start, 0), mC),
                                         (A_CHUNK_M, TILE_N), (chunk, n))
                    self.store_segments(tiled_mma, thread, accumulators[i], gC,
                                        row_end - row_start - chunk * A_CHUNK_M,
                                        cute.size(mC, mode=[1]) - n * TILE_N)
                words, item_consumer = self.receive_item(item_pipeline, item_consumer, sItems)
                tile, n_tile = words

    # ---- ragged K: dW -------------------------------------------------------------------------

    @cute.jit
    def weight_grad(self, a: cute.Tensor, b: cute.Tensor, dw_local: cute.Tensor,
                    dw_partial: cute.Tensor, dw_slots: cute.Tensor, replica_flags: cute.Tensor,
                    cu_seqlens: cute.Tensor, ep_rank: cute.Tensor, schedule: cute.Tensor,
                    num_ctas: cutlass.Int32, stream: cuda.CUstream):
        """`dw_*[j] = a[:, rows of group] . b[:, rows of group]^T` for every local expert and slot.

        `a [D0, NvS]` (x^T), `b [D1, NvS]` (dy^T), `dw_local [D0, D1, epn]` bf16,
        `dw_partial [D0, D1, P]` fp32 with P = epn or 0, `dw_slots [D0, D1, B']` fp32 with
        B' = B or 0; `replica_flags [epn]` int32 (local expert j's sum goes to `dw_partial[j]`
        when set and P > 0); `cu_seqlens [G]`; `ep_rank [1]` int32 (this rank, read on the
        device: local expert j is group `ep_rank * epn + j`); `schedule [DW_SCHEDULE_SLOTS + B']`
        int32, as the setup kernel leaves it: the matrices with work (every local expert's, then
        the listed slots'), the work-item counter at 0, the slots with work ascending (the
        others' matrices are left unwritten); `num_ctas` persistent CTAs share the (matrix,
        M tile, N tile) work items of the matrices with work.
        """
        self._setup(a, b, (DW_TILE_M, TILE_N, DW_TILE_K),
                    stage_bytes=(DW_TILE_M + TILE_N) * DW_TILE_K * a.element_type.width // 8,
                    reserved_bytes=(DW_EPILOGUE_STAGES * ATOM_M * TILE_N
                                    * a.element_type.width // 8))
        tma_a, tma_tensor_a = self._tma_load(a, self.a_smem_staged, (DW_TILE_M, DW_TILE_K))
        tma_b, tma_tensor_b = self._tma_load(b, self.b_smem_staged, (TILE_N, DW_TILE_K))
        # The bf16 tiles of dw_local leave through shared memory and a TMA store, so that the
        # consumers go on to the next tile's MMAs while the store drains (their register
        # stores used to stall them for every tile: a dW item's K is one group's ~340 rows).
        # Each warp group stages and stores its own ATOM_M-row blocks of the tile (stages g,
        # g + 2, ... are warp group g's), so neither waits for the other's epilogue.
        assert DW_LAG_K_TILES < self.num_stages, "warp group 0 would wait for warp group 1"
        # Each item counts as at least one K tile of the lag (consume), and warp group 1 reads
        # the item ring once it has started: the items before it must fit the ring.
        assert DW_LAG_K_TILES <= ITEM_STAGES, "warp group 0 would wait for warp group 1"
        assert DW_EPILOGUE_STAGES % CONSUMER_GROUPS == 0
        assert (DW_TILE_M // ATOM_M) % DW_EPILOGUE_STAGES == 0
        self.c_smem_staged = sm90_utils.make_smem_layout_epi(
            self.ab_dtype, utils.LayoutEnum.ROW_MAJOR, (ATOM_M, TILE_N), DW_EPILOGUE_STAGES)
        tma_c, tma_tensor_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), dw_local,
            cute.slice_(self.c_smem_staged, (None, None, 0)), (ATOM_M, TILE_N))
        # One warp group's MMA: its view of one block's accumulators.
        block_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, utils.LayoutEnum.from_tensor(a).sm90_mma_major_mode(),
            utils.LayoutEnum.from_tensor(b).sm90_mma_major_mode(), self.acc_dtype, (1, 1, 1),
            tiler_mn=(ATOM_M, TILE_N))
        self.shared_storage = self._shared_storage(DW_ITEM_WORDS, sA=self.a_smem_staged,
                                                   sB=self.b_smem_staged, sC=self.c_smem_staged)
        most_items = weight_grad_num_items(
            dw_local, cute.size(dw_local, mode=[2]) + cute.size(dw_slots, mode=[2]))
        self.weight_grad_kernel(
            self.tiled_mma, block_mma, tma_a, tma_tensor_a, tma_b, tma_tensor_b, tma_c, tma_tensor_c,
            dw_local, dw_partial, dw_slots, replica_flags, cu_seqlens, ep_rank, schedule,
            self.a_smem_staged, self.b_smem_staged, self.c_smem_staged,
        ).launch(grid=(cutlass.min(num_ctas, most_items), 1, 1), block=(self.num_threads, 1, 1),
                 stream=stream)

    @cute.jit
    def weight_grad_coords(self, item: cutlass.Int32, dw_local: cute.Tensor,
                           schedule: cute.Tensor, num_work_mats: cutlass.Int32):
        """Work item -> (mat, m_tile, n_tile), N tiles fastest, of the schedule's matrices with
        work (the producer warp's divisions: in the consumer warps, ~10 % of their time at R = 2,
        ncu stall samples). An item past the last (the one after a CTA's last, which the
        producer decodes an item ahead) gives the last matrix, so that its decode reads in
        bounds."""
        num_m_tiles, num_n_tiles = weight_grad_tiles(dw_local)
        num_local = cute.size(dw_local, mode=[2])
        listed = cutlass.min(item // (num_n_tiles * num_m_tiles), num_work_mats - 1)
        mat = listed
        if listed >= num_local:
            mat = num_local + schedule[DW_SCHEDULE_SLOTS + listed - num_local]
        return mat, (item // num_n_tiles) % num_m_tiles, item % num_n_tiles

    @cute.jit
    def weight_grad_item(self, mat: cutlass.Int32, dw_local: cute.Tensor,
                         dw_partial: cute.Tensor, dw_slots: cute.Tensor,
                         replica_flags: cute.Tensor, cu_seqlens: cute.Tensor,
                         first_local_group: cutlass.Int32):
        """Output matrix -> (row_start, rows, to_partial): its group's rows, and whether a local
        expert's fp32 sum goes to `dw_partial`."""
        num_local = cute.size(dw_local, mode=[2])
        num_slots = cute.size(dw_slots, mode=[2])
        num_experts = cute.size(cu_seqlens, mode=[0]) - num_slots
        group = first_local_group + mat
        if mat >= num_local:
            group = num_experts + mat - num_local
        row_start = 0
        if group > 0:
            row_start = cu_seqlens[group - 1]
        num_rows = cu_seqlens[group] - row_start
        to_partial = cutlass.Int32(0)
        if cute.size(dw_partial, mode=[2]) > 0:
            if mat < num_local:
                to_partial = replica_flags[mat]
        return row_start, num_rows, to_partial

    @cute.kernel
    def weight_grad_kernel(self, tiled_mma: cute.TiledMma, block_mma: cute.TiledMma,
                           tma_a: cute.CopyAtom, mA: cute.Tensor,
                           tma_b: cute.CopyAtom, mB: cute.Tensor, tma_c: cute.CopyAtom,
                           mC: cute.Tensor, dw_local: cute.Tensor, dw_partial: cute.Tensor,
                           dw_slots: cute.Tensor, replica_flags: cute.Tensor,
                           cu_seqlens: cute.Tensor, ep_rank: cute.Tensor, schedule: cute.Tensor,
                           a_smem_staged: cute.ComposedLayout,
                           b_smem_staged: cute.ComposedLayout,
                           c_smem_staged: cute.ComposedLayout):
        ab_pipeline, storage = self.make_pipeline()
        item_pipeline, sItems = self.make_item_pipeline(storage)
        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sC = storage.sC.get_tensor(c_smem_staged.outer, swizzle=c_smem_staged.inner)
        num_local = cute.size(dw_local, mode=[2])
        num_mats = num_local + cute.size(dw_slots, mode=[2])
        first_item, item_stride, warp_idx, tidx = persistent_cta()
        if warp_idx < WARPS_PER_GROUP:
            cute.arch.warpgroup_reg_dealloc(PRODUCER_REGS)
            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
                producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                        self.num_stages)
                item_producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                             ITEM_STAGES)
                first_local_group = ep_rank[0] * num_local
                num_work_mats = schedule[DW_SCHEDULE_MATS]
                num_items = weight_grad_num_items(dw_local, num_work_mats)
                # Items are taken, not dealt, and only the schedule's matrices have items (module
                # docstring). The producer decodes each item and hands the consumers what they
                # need, so that their per-item work, which only the other warp group's MMAs
                # cover, holds no index arithmetic and no loads. It runs an item ahead: it takes and decodes item i + 1 (the atomic taken
                # while item i - 1 loaded, the decode's loads in flight) before it loads item i.
                item_args = (dw_local, dw_partial, dw_slots, replica_flags, cu_seqlens,
                             first_local_group)
                counter = schedule.iterator + DW_SCHEDULE_NEXT_ITEM
                item = first_item
                mat, m_tile, n_tile = self.weight_grad_coords(item, dw_local, schedule,
                                                              num_work_mats)
                decoded = self.weight_grad_item(mat, *item_args)
                taken = self.take_item(counter)
                while item < num_items:
                    following = self.taken_item(taken, item_stride)
                    taken = self.take_item(counter)
                    next_mat, next_m_tile, next_n_tile = self.weight_grad_coords(
                        following, dw_local, schedule, num_work_mats)
                    next_decoded = self.weight_grad_item(next_mat, *item_args)
                    row_start, num_rows, to_partial = decoded
                    item_producer = self.hand_item(item_pipeline, item_producer, sItems,
                                                   (mat, m_tile, n_tile, num_rows, to_partial))
                    gA = cute.local_tile(cute.domain_offset((0, row_start), mA),
                                         (DW_TILE_M, DW_TILE_K), (m_tile, None))
                    gB = cute.local_tile(cute.domain_offset((0, row_start), mB),
                                         (TILE_N, DW_TILE_K), (n_tile, None))
                    producer = self.load(ab_pipeline, producer, tma_a, gA, sA, tma_b, gB, sB,
                                         cute.ceil_div(num_rows, DW_TILE_K))
                    item, mat, m_tile, n_tile = following, next_mat, next_m_tile, next_n_tile
                    decoded = next_decoded
                # A matrix past the last tells the consumers to stop.
                item_producer = self.hand_item(item_pipeline, item_producer, sItems,
                                               (num_mats, 0, 0, 0, 0))
                ab_pipeline.producer_tail(producer)
                item_pipeline.producer_tail(item_producer)
        else:
            cute.arch.warpgroup_reg_alloc(CONSUMER_REGS)
            thread = tidx - THREADS_PER_GROUP
            group = warp_idx // WARPS_PER_GROUP - 1
            tCrA, tCrB, (accumulators,), read, release = self.consumer_setup(
                tiled_mma, sA, sB, thread, (DW_TILE_M, TILE_N), 1)
            d0 = cute.size(dw_local, mode=[0])
            d1 = cute.size(dw_local, mode=[1])
            # The first warp of each warp group issues its TMA stores; bulk-store groups belong
            # to the threads that commit them, so the same warp waits for them.
            storer = warp_idx % WARPS_PER_GROUP == 0
            c_stores = pipeline.PipelineTmaStore.create(
                num_stages=1, producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, THREADS_PER_GROUP))
            # K tiles warp group 0 issues before warp group 1 starts (0 for warp group 1).
            lag_left = cutlass.Int32(0)
            if group == 0:
                lag_left = cutlass.Int32(DW_LAG_K_TILES)
            else:
                cute.arch.barrier(barrier_id=LAG_BARRIER, number_of_threads=NUM_CONSUMER_THREADS)
            item_consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                         ITEM_STAGES)
            words, item_consumer = self.receive_item(item_pipeline, item_consumer, sItems)
            mat, m_tile, n_tile, num_rows, to_partial = words
            while mat < num_mats:
                read, release, lag_left = self.consume(
                    ab_pipeline, read, release, tiled_mma, tCrA, tCrB, accumulators, sA, sB,
                    cute.ceil_div(num_rows, DW_TILE_K), num_rows, group, lag_left)
                cC = cute.local_tile(cute.make_identity_tensor((d0, d1)), (DW_TILE_M, TILE_N),
                                     (m_tile, n_tile))
                if mat < num_local:
                    if to_partial != 0:
                        gC = cute.local_tile(dw_partial[None, None, mat], (DW_TILE_M, TILE_N),
                                             (m_tile, n_tile))
                        self.store(tiled_mma, thread, accumulators, gC, cC, d0, d1)
                    else:
                        gC = cute.local_tile(mC[None, None, mat], (DW_TILE_M, TILE_N),
                                             (m_tile, n_tile))
                        self.store_through_shared(block_mma, thread, accumulators, tma_c,
                                                  c_stores, storer, sC, group, gC)
                else:
                    gC = cute.local_tile(dw_slots[None, None, mat - num_local],
                                         (DW_TILE_M, TILE_N), (m_tile, n_tile))
                    self.store(tiled_mma, thread, accumulators, gC, cC, d0, d1)
                words, item_consumer = self.receive_item(item_pipeline, item_consumer, sItems)
                mat, m_tile, n_tile, num_rows, to_partial = words
            # A CTA with fewer K tiles than the lag still lets warp group 1 go.
            if lag_left > 0:
                cute.arch.barrier_arrive(barrier_id=LAG_BARRIER,
                                         number_of_threads=NUM_CONSUMER_THREADS)
            if storer:
                c_stores.producer_tail()

    # ---- shared pieces ------------------------------------------------------------------------

    @cute.jit
    def make_pipeline(self):
        """Shared memory and the TMA -> consumer pipeline of `num_stages` stages of
        `stage_bytes` (every thread; ends with a CTA sync)."""
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.pipeline_barriers.data_ptr(),
            num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # One arrive per consumer warp (its lane 0) releases a stage.
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     NUM_CONSUMER_THREADS // 32),
            tx_count=self.stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        return ab_pipeline, storage

    @cute.jit
    def make_item_pipeline(self, storage):
        """The ring in which the producer warp hands the consumer warp groups their work items
        (its 32 lanes fill a stage, every consumer thread releases it), and its items `[item_words,
        ITEM_STAGES]` int32 in shared memory."""
        item_pipeline = pipeline.PipelineAsync.create(
            barrier_storage=storage.item_barriers.data_ptr(), num_stages=ITEM_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     NUM_CONSUMER_THREADS))
        return item_pipeline, storage.items.get_tensor(
            cute.make_layout((self.item_words, ITEM_STAGES)))

    @cute.jit
    def take_item(self, counter):
        """Producer warp: lane 0 takes the counter's next value (the other lanes hold 0). Apart
        from `taken_item`, so that the warp may issue loads while the atomic is in flight."""
        taken = cutlass.Int32(0)
        if cute.arch.lane_idx() == 0:
            taken = cute.arch.atomic_add(counter, cutlass.Int32(1), sem="relaxed", scope="gpu")
        return taken

    @cute.jit
    def taken_item(self, taken: cutlass.Int32, item_stride: cutlass.Int32):
        """Producer warp: the work item that `take_item` took, the counter's value plus the grid
        (every CTA's first item is its index)."""
        return cute.arch.shuffle_sync(taken, 0) + item_stride

    @cute.jit
    def hand_item(self, item_pipeline, state, sItems: cute.Tensor, words):
        """Producer warp: put one item's `words` in the next stage of the item ring."""
        item_pipeline.producer_acquire(state)
        for w in cutlass.range_constexpr(len(words)):
            sItems[w, state.index] = words[w]
        item_pipeline.producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def receive_item(self, item_pipeline, state, sItems: cute.Tensor):
        """Consumer thread: the words of the next work item from the item ring."""
        item_pipeline.consumer_wait(state)
        words = []
        for w in cutlass.range_constexpr(cute.size(sItems, mode=[0])):
            words.append(sItems[w, state.index])
        item_pipeline.consumer_release(state)
        state.advance()
        return tuple(words), state

    @cute.jit
    def load(self, ab_pipeline, producer, tma_a: cute.CopyAtom, gA: cute.Tensor,
             sA: cute.Tensor, tma_b: cute.CopyAtom, gB: cute.Tensor, sB: cute.Tensor,
             num_k_tiles: cutlass.Int32):
        """Producer warp: TMA-load the `num_k_tiles` K tiles of one work item into the ring."""
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        for k_tile in cutlass.range(num_k_tiles, unroll=1):
            ab_pipeline.producer_acquire(producer)
            barrier = ab_pipeline.producer_get_barrier(producer)
            cute.copy(tma_a, tAgA[(None, k_tile)], tAsA[(None, producer.index)],
                      tma_bar_ptr=barrier)
            cute.copy(tma_b, tBgB[(None, k_tile)], tBsB[(None, producer.index)],
                      tma_bar_ptr=barrier)
            ab_pipeline.producer_commit(producer)
            producer.advance()
        return producer

    @cute.jit
    def load_rows(self, ab_pipeline, producer, tma_a: cute.CopyAtom, gA: cute.Tensor,
                  sA: cute.Tensor, a_chunks: cutlass.Int32, tma_b: cute.CopyAtom,
                  gB: cute.Tensor, sB: cute.Tensor, n_tile: cutlass.Int32,
                  n_tiles: cutlass.Int32, num_k_tiles: cutlass.Int32):
        """Producer warp, ragged M: each K tile of one work item takes `a_chunks` slots of the
        ring for the A chunks that hold the group's rows (a warp group multiplies only 64-row
        blocks that start below the group's end, and such a block lies in a loaded chunk), then
        one per B tile of its `n_tiles` N tiles from `n_tile`."""
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        for k_tile in cutlass.range(num_k_tiles, unroll=1):
            for chunk in cutlass.range(a_chunks, unroll=1):
                ab_pipeline.producer_acquire(producer)
                cute.copy(tma_a, tAgA[(None, chunk, k_tile)], tAsA[(None, producer.index)],
                          tma_bar_ptr=ab_pipeline.producer_get_barrier(producer))
                producer.advance()
            for n in cutlass.range(n_tiles, unroll=1):
                ab_pipeline.producer_acquire(producer)
                cute.copy(tma_b, tBgB[(None, n_tile + n, k_tile)], tBsB[(None, producer.index)],
                          tma_bar_ptr=ab_pipeline.producer_get_barrier(producer))
                producer.advance()
        return producer

    @cute.jit
    def consumer_setup(self, tiled_mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor,
                       thread: cutlass.Int32, tile_mn, num_accumulators: cutlass.Constexpr[int]):
        """A consumer thread's WGMMA operand fragments, `num_accumulators` accumulators of its
        share of a `tile_mn` tile, and pipeline states."""
        thr_mma = tiled_mma.get_slice((thread // THREADS_PER_GROUP) * THREADS_PER_GROUP)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        accumulators = [cute.make_rmem_tensor(thr_mma.partition_shape_C(tile_mn), self.acc_dtype)
                        for _ in range(num_accumulators)]
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.num_stages)
        return tCrA, tCrB, accumulators, read, release

    @cute.jit
    def consume(self, ab_pipeline, read, release, tiled_mma: cute.TiledMma, tCrA: cute.Tensor,
                tCrB: cute.Tensor, accumulators: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor,
                num_k_tiles: cutlass.Int32, valid_k: cutlass.Int32, group: cutlass.Int32,
                lag_left: cutlass.Int32):
        """Consumer warp group `group`, dW: `accumulators = sum over the item's K tiles` (fp32
        registers). K indices `>= valid_k` (the rows of the next group) are zeroed in shared
        memory before the WGMMAs read them. Every stage read is released once its WGMMAs are
        done, the last one included, so the producer runs ahead into the next work item while
        this one is stored. Warp group 0 lets warp group 1 start once it has issued its first
        DW_LAG_K_TILES K tiles (`lag_left` counts them down; returned)."""
        accumulators.fill(0.0)
        num_k_blocks = cute.size(tCrA, mode=[2])
        for k_tile in cutlass.range(num_k_tiles, unroll=1):
            ab_pipeline.consumer_wait(read)
            if (k_tile + 1) * DW_TILE_K > valid_k:
                self.zero_k_tail(sA, sB, read.index, valid_k - k_tile * DW_TILE_K, group)
            cute.nvgpu.warpgroup.fence()
            for k_block in cutlass.range_constexpr(num_k_blocks):
                coord = (None, None, k_block, read.index)
                cute.gemm(tiled_mma, accumulators, tCrA[coord], tCrB[coord], accumulators)
            cute.nvgpu.warpgroup.commit_group()
            lag_left = self.lag_step(lag_left)
            # Keep one K tile of WGMMAs in flight: the one before it is done with its stage.
            cute.nvgpu.warpgroup.wait_group(1)
            if k_tile > 0:
                ab_pipeline.consumer_release(release)
                release.advance()
            read.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        if num_k_tiles > 0:
            ab_pipeline.consumer_release(release)
            release.advance()
        else:
            # An item without K tiles counts as one: warp group 1 reads the item ring only once
            # it has started, and warp group 0, ITEM_STAGES items ahead of it, would wait for it.
            lag_left = self.lag_step(lag_left)
        return read, release, lag_left

    @cute.jit
    def lag_step(self, lag_left: cutlass.Int32):
        """Warp group 0, dW: one K tile less before warp group 1 starts; at the last, let it."""
        if lag_left > 0:
            lag_left -= 1
            if lag_left == 0:
                cute.arch.barrier_arrive(barrier_id=LAG_BARRIER,
                                         number_of_threads=NUM_CONSUMER_THREADS)
        return lag_left

    @cute.jit
    def consume_rows(self, ab_pipeline, read, release, tiled_mma: cute.TiledMma,
                     tCrA: cute.Tensor, tCrB: cute.Tensor, accumulators,
                     num_k_tiles: cutlass.Int32, a_chunks: cutlass.Int32, n_tiles: cutlass.Int32,
                     valid_rows: cutlass.Int32, first_row: cutlass.Int32):
        """Consumer warp groups, ragged M: `accumulators[i]` (this warp group's block of chunk i,
        or of N tile i of a wide item) `= sum over the item's K tiles`. A warp group issues
        WGMMAs only for its blocks (rows `first_row + A_CHUNK_M * c`) that hold a row below
        `valid_rows`: the other rows are never stored, so a group's last tile costs MMAs for its
        rows rounded up to 64. Both warp groups wait for and release every slot of the item (the
        `a_chunks` A chunks and `n_tiles` B tiles of each K tile; an item of several N tiles has
        one chunk)."""
        for acc in accumulators:
            acc.fill(0.0)
        blocks = cutlass.Int32(0)
        rows_left = valid_rows - first_row
        if rows_left > 0:
            blocks = cutlass.min(cute.ceil_div(rows_left, A_CHUNK_M), A_CHUNKS)
        # A branch per (blocks, N tiles): no WGMMA may sit under a branch whose count is not
        # known at compile time (ptxas would serialise every WGMMA).
        args = (ab_pipeline, read, release, tiled_mma, tCrA, tCrB, accumulators, num_k_tiles,
                a_chunks, n_tiles)
        if blocks == 0:
            read, release = self.multiply_rows(*args, 0, 0)
        elif n_tiles == 3:
            read, release = self.multiply_rows(*args, 1, 3)
        elif n_tiles == 2:
            read, release = self.multiply_rows(*args, 1, 2)
        elif blocks == 3:
            read, release = self.multiply_rows(*args, 3, 1)
        elif blocks == 2:
            read, release = self.multiply_rows(*args, 2, 1)
        else:
            read, release = self.multiply_rows(*args, 1, 1)
        return read, release

    @cute.jit
    def multiply_rows(self, ab_pipeline, read, release, tiled_mma: cute.TiledMma,
                      tCrA: cute.Tensor, tCrB: cute.Tensor, accumulators,
                      num_k_tiles: cutlass.Int32, a_chunks: cutlass.Int32, n_tiles: cutlass.Int32,
                      m_blocks: cutlass.Constexpr[int], n_blocks: cutlass.Constexpr[int]):
        """The K loop of one warp group, ragged M: per K tile, wait for its slots (A chunks in
        order, then the B tiles), WGMMAs of its first `m_blocks` chunks by the first `n_blocks`
        B tiles (one of the two is 1) into accumulator `c * n_blocks + n`, and release the
        previous K tile's slots once its WGMMAs are done."""
        assert m_blocks <= 1 or n_blocks <= 1
        num_k_blocks = cute.size(tCrA, mode=[2])
        slots = a_chunks + n_tiles
        for k_tile in cutlass.range(num_k_tiles, unroll=1):
            first_slot = read.index
            for _ in cutlass.range(slots, unroll=1):
                ab_pipeline.consumer_wait(read)
                read.advance()
            # A warp group without rows only passes the slots on: an empty WGMMA group would
            # still cost a dummy HGMMA and a wait.
            if cutlass.const_expr(m_blocks > 0):
                cute.nvgpu.warpgroup.fence()
                for k_block in cutlass.range_constexpr(num_k_blocks):
                    for c in cutlass.range_constexpr(m_blocks):
                        a_slot = (first_slot + c) % self.num_stages
                        for n in cutlass.range_constexpr(n_blocks):
                            b_slot = (first_slot + a_chunks + n) % self.num_stages
                            acc = accumulators[c * n_blocks + n]
                            cute.gemm(tiled_mma, acc, tCrA[(None, None, k_block, a_slot)],
                                      tCrB[(None, None, k_block, b_slot)], acc)
                cute.nvgpu.warpgroup.commit_group()
                # Keep one K tile of WGMMAs in flight: the one before it is done with its slots.
                cute.nvgpu.warpgroup.wait_group(1)
            if k_tile > 0:
                for _ in cutlass.range(slots, unroll=1):
                    ab_pipeline.consumer_release(release)
                    release.advance()
        if cutlass.const_expr(m_blocks > 0):
            cute.nvgpu.warpgroup.wait_group(0)
        if num_k_tiles > 0:
            for _ in cutlass.range(slots, unroll=1):
                ab_pipeline.consumer_release(release)
                release.advance()
        return read, release

    @cute.jit
    def zero_k_tail(self, sA: cute.Tensor, sB: cute.Tensor, stage: cutlass.Int32,
                    first_invalid_k: cutlass.Int32, group: cutlass.Int32):
        """Consumer warp group `group`: zero K columns `>= first_invalid_k` of stage `stage` in
        the rows its WGMMAs read, its ATOM_M-row blocks of A and all of B. Both groups zero B:
        each reads it only after its own zeros, and the other's writes store the same zeros, so
        neither waits for the other."""
        thread = cute.arch.thread_idx()[0] % THREADS_PER_GROUP
        for m in cutlass.range_constexpr(DW_TILE_M // (CONSUMER_GROUPS * ATOM_M)):
            self.zero_columns(sA, (CONSUMER_GROUPS * m + group) * ATOM_M, ATOM_M, stage,
                              first_invalid_k, thread)
        self.zero_columns(sB, 0, TILE_N, stage, first_invalid_k, thread)
        # The WGMMAs read shared memory through the async proxy.
        cute.arch.fence_proxy("async.shared", space="cta")
        self.group_barrier(group)

    @cute.jit
    def group_barrier(self, group: cutlass.Int32):
        """Synchronise the threads of consumer warp group `group`."""
        cute.arch.barrier(barrier_id=FIRST_GROUP_BARRIER + group,
                          number_of_threads=THREADS_PER_GROUP)

    @cute.jit
    def zero_columns(self, s: cute.Tensor, first_row: cutlass.Int32, rows: cutlass.Constexpr[int],
                     stage: cutlass.Int32, first_invalid_k: cutlass.Int32,
                     thread: cutlass.Int32):
        """Zero columns `>= first_invalid_k` of rows `[first_row, first_row + rows)` of an MN-major
        `[., DW_TILE_K]` stage (one warp group's threads), 16 bytes per store: the 128-byte
        swizzle permutes whole 16-byte chunks, so 8 consecutive rows of one column stay one
        aligned chunk (a scalar store per element cost ~2 us per dW item). A thread owns one
        chunk row and every `columns_per_pass`-th column, a store per column predicated on
        its K: an unrolled loop of fixed length, whose addresses hang on the thread and the
        stage alone (a loop over the invalid columns alone spent ~30 instructions of
        address arithmetic per store: ~8 % of the consumer warps' time in dW at R = 2, ncu)."""
        vector = 128 // self.ab_dtype.width
        chunks = cute.zipped_divide(s[None, None, stage], (vector, 1))  # ((vector,1), (r/v, K))
        zeros = cute.make_rmem_tensor(cute.make_layout(((vector, 1),)), self.ab_dtype)
        zeros.fill(0.0)
        chunk_store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.ab_dtype,
                                          num_bits_per_copy=128)
        chunks_per_column = rows // vector
        columns_per_pass = THREADS_PER_GROUP // chunks_per_column
        assert THREADS_PER_GROUP % chunks_per_column == 0
        assert DW_TILE_K % columns_per_pass == 0
        chunk = first_row // vector + thread % chunks_per_column
        first_column = thread // chunks_per_column
        for p in cutlass.range_constexpr(DW_TILE_K // columns_per_pass):
            k = first_column + p * columns_per_pass
            if k >= first_invalid_k:
                cute.copy(chunk_store, zeros, chunks[(None, (chunk, k))])

    @cute.jit
    def store(self, tiled_mma: cute.TiledMma, thread: cutlass.Int32, accumulators: cute.Tensor,
              gC: cute.Tensor, cC: cute.Tensor, row_limit: cutlass.Int32,
              col_limit: cutlass.Int32):
        """Store the accumulators to `gC` where the coordinate in `cC` is below the limits (dW:
        absolute coordinates and the matrix shape, or the staged tile's own).

        Pair stores (`pair_store_atom`) are aligned and never straddle a limit: every column
        limit and row stride is a multiple of 8 elements (`ALIGN_ELEMS`, checked by the
        launchers), and a pair starts at an even column.
        """
        thr_mma = tiled_mma.get_slice(thread)
        tCgC = cute.zipped_divide(thr_mma.partition_C(gC), (2,))  # ((pair), (pairs))
        tCcC = cute.zipped_divide(thr_mma.partition_C(cC), (2,))
        tCrC = cute.zipped_divide(self.rounded(accumulators, gC.element_type), (2,))
        pair_store = self.pair_store_atom(gC.element_type)
        for j in cutlass.range_constexpr(cute.size(tCgC, mode=[1])):
            row, col = tCcC[(0, j)]
            if row < row_limit and col < col_limit:
                cute.copy(pair_store, tCrC[(None, j)], tCgC[(None, j)])

    @cute.jit
    def store_segments(self, tiled_mma: cute.TiledMma, thread: cutlass.Int32,
                       accumulators: cute.Tensor, gC: cute.Tensor, row_limit: cutlass.Int32,
                       col_limit: cutlass.Int32):
        """Ragged M: store a chunk's accumulators, rounded to bf16, to its `[A_CHUNK_M, TILE_N]`
        tile `gC` where the tile-relative row and column are below the limits, 16 bytes per store.

        A thread's WGMMA accumulators hold, per row, one pair of adjacent columns in each 8-column
        block (`2 * (lane % 4)` into it), so a row's 16-byte segment is spread over a quad of
        lanes. Per row and 4 consecutive blocks the quad transposes its 4 x 4 bf16 pairs (lane c
        gathers block c), and each lane stores one whole segment: a quarter of the store
        instructions of pair stores (whose issue kept the tensor cores idle in the epilogue:
        11-13 % of the forward's stall samples, ncu; bench_gemm: forward and dX 1-5 % faster).
        A segment never straddles a limit: column limits are multiples of 8 elements
        (`ALIGN_ELEMS`, checked by the launchers). dW's staged bf16 tile goes into its swizzled
        shared memory by stmatrix instead (`store_through_shared`): segments there made dW 1-9 %
        slower than pair stores. The same path for ragged M's whole blocks, its stages taken from
        the slot ring, measured no faster: what it saved full tiles, the shallower ring cost the
        small ones (README, grouped GEMM).
        """
        thr_mma = tiled_mma.get_slice(thread)
        # Pairs of the thread: pair v + 2 * b is row half v (rows 8 apart) of column block b (the
        # register order of a WGMMA accumulator).
        tCcC = cute.zipped_divide(
            thr_mma.partition_C(cute.make_identity_tensor((A_CHUNK_M, TILE_N))), (2,))
        pairs = cute.recast_tensor(self.rounded(accumulators, gC.element_type), cutlass.Int32)
        segment_elems = 128 // gC.element_type.width
        blocks = TILE_N // segment_elems
        assert cute.size(pairs) == 2 * blocks, "one ATOM_M-row block per warp group and chunk"
        segments = cute.zipped_divide(gC, (1, segment_elems))  # ((1, 8), (rows, segments))
        segment = cute.make_rmem_tensor(cute.make_layout(((1, segment_elems),)), gC.element_type)
        segment_pairs = cute.recast_tensor(segment, cutlass.Int32)
        segment_store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), gC.element_type,
                                            num_bits_per_copy=128)
        quad_lane = thread % QUAD
        for half in cutlass.range_constexpr(2):
            for quarter in cutlass.range_constexpr(blocks // QUAD):
                first_pair = half + 2 * QUAD * quarter
                gathered = quad_transpose(
                    [pairs[first_pair + 2 * block] for block in range(QUAD)], quad_lane)
                for i in cutlass.range_constexpr(QUAD):
                    segment_pairs[i] = gathered[i]
                row, col = tCcC[(0, first_pair)]
                # Lane c's pair sat 2c into its block; its segment is block c of the four.
                col = col + (segment_elems - 2) * quad_lane
                if row < row_limit and col < col_limit:
                    cute.copy(segment_store, segment,
                              segments[(None, (row, col // segment_elems))])

    @cute.jit
    def store_through_shared(self, block_mma: cute.TiledMma, thread: cutlass.Int32,
                             accumulators: cute.Tensor, tma_c: cute.CopyAtom, c_stores, storer,
                             sC: cute.Tensor, group: cutlass.Int32, gC: cute.Tensor):
        """Consumer warp group `group`: store its accumulators (one ATOM_M-row block of the tile
        per MMA row, block `2m + group` for row m) to the tile `gC` of a TMA tensor: registers ->
        its stages of `sC` (stages `group`, `group + 2`, ...; `block_mma` is one warp group's view
        of a block) by stmatrix, four 8 x 8 bf16 matrices a warp per instruction (16 a block
        where pair stores took 64: the epilogue is work only the other warp group's MMAs cover),
        then one TMA store per block that runs while the group goes on. Before its
        stages are written again, the group's previous stores must have read them: with a stage
        per block that wait falls one item later, normally already over; with fewer, the next
        blocks of the item wait for the first ones' stores. TMA clips at the tensor's bounds."""
        matrix_store = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), sC.element_type),
            block_mma)
        thr_store = matrix_store.get_slice(thread % THREADS_PER_GROUP)
        values = self.rounded(accumulators, sC.element_type)
        block_values = thr_store.retile(values)
        blocks = cute.size(values, mode=[1])
        stages = DW_EPILOGUE_STAGES // CONSUMER_GROUPS  # of this warp group
        sC_for_tma, gC_for_tma = cute.nvgpu.cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
            cute.zipped_divide(gC, (ATOM_M, TILE_N)))
        for first in cutlass.range_constexpr(0, blocks, stages):
            if storer:
                c_stores.producer_acquire()
            self.group_barrier(group)
            for m in cutlass.range_constexpr(first, first + stages):
                cute.copy(matrix_store, block_values[None, m, None],
                          thr_store.partition_D(
                              sC[None, None, CONSUMER_GROUPS * (m - first) + group])[
                                  None, None, 0])
            # The TMA unit reads shared memory through the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            self.group_barrier(group)
            if storer:
                for m in cutlass.range_constexpr(first, first + stages):
                    cute.copy(tma_c, sC_for_tma[(None, CONSUMER_GROUPS * (m - first) + group)],
                              gC_for_tma[(None, CONSUMER_GROUPS * m + group)])
                c_stores.producer_commit()

    @staticmethod
    def rounded(accumulators: cute.Tensor, dtype):
        """The accumulators rounded to `dtype`, in registers of the same layout."""
        values = cute.make_rmem_tensor(accumulators.shape, dtype)
        values.store(accumulators.load().to(dtype))
        return values

    @staticmethod
    def pair_store_atom(dtype):
        """A store of a pair of adjacent accumulator columns: a thread's WGMMA accumulators come
        in such pairs, and one vector store (64-bit fp32, 32-bit bf16) replaces two scalar ones
        (16-byte segments, as store_segments stores, made dW's staged bf16 stores 1-9 % slower
        than these; they use stmatrix now)."""
        return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype,
                                   num_bits_per_copy=2 * dtype.width)


QUAD = 4  # lanes of a WGMMA accumulator row (each holds 2 of every 8 columns)


@cute.jit
def quad_transpose(m, quad_lane: cutlass.Int32):
    """Transpose a 4 x 4 matrix of 32-bit values held by the 4 lanes of each quad, lane c holding
    row c as `m`: lane c returns column c. Two butterfly stages (lane bit 2, then 1), each
    swapping that bit between lane and position: a lane sends the entry whose position bit
    differs from its lane bit and takes its partner's in its place."""
    m = list(m)
    for lane_bit in (2, 1):
        upper = (quad_lane & lane_bit) != 0
        for lo in [p for p in range(QUAD) if p & lane_bit == 0]:
            hi = lo + lane_bit
            sent = cutlass.Int32(cutlass.select_(upper, m[lo], m[hi]))
            got = cute.arch.shuffle_sync_bfly(sent, offset=lane_bit)
            m[lo] = cutlass.Int32(cutlass.select_(upper, got, m[lo]))
            m[hi] = cutlass.Int32(cutlass.select_(upper, m[hi], got))
    return m


# ---- ahead-of-time compilation ------------------------------------------------------------------

def _dim():
    return cute.sym_int32()


def _aligned_dim():
    return cute.sym_int32(divisibility=ALIGN_ELEMS)


def _bf16(shape, stride_order):
    return make_fake_compact_tensor(cutlass.BFloat16, shape, stride_order=stride_order,
                                    assumed_align=16)


def _table():
    return make_fake_compact_tensor(cutlass.Int32, (_dim(), TABLE_COLUMNS), stride_order=(1, 0),
                                    assumed_align=16)


def _compile_rows(options: str, weight_stride_order):
    """A ragged-M kernel: `a [M, K]`, `w_* (N, K, mats)` with `weight_stride_order`, `c [M, N]`."""
    gemm = GroupedMatmul()
    a = _bf16((_dim(), _aligned_dim()), (1, 0))
    w_local = _bf16((_aligned_dim(), _aligned_dim(), _dim()), weight_stride_order)
    w_slots = _bf16((_aligned_dim(), _aligned_dim(), _dim()), weight_stride_order)
    c = _bf16((_dim(), _aligned_dim()), (1, 0))
    # The schedule is the row after the table's max_tiles rows of TABLE_COLUMNS int32, so it is
    # aligned to its int32 only: asserting 16 bytes would let the compiler load adjacent columns
    # as one vector, a misaligned address whenever max_tiles is odd.
    schedule = make_fake_compact_tensor(cutlass.Int32, (TABLE_COLUMNS,), assumed_align=4)
    return cute.compile(gemm.rows, a, w_local, w_slots, c, _table(), schedule, cutlass.Int32(1),
                        make_fake_stream(), options=options)


def compile_forward(options: str):
    """`x [M, D0]`, `w_* (D1, D0, mats)` N-major (row-major `[mats, D0, D1]` memory)."""
    return _compile_rows(options, (0, 1, 2))


def compile_dx(options: str):
    """`dy [M, D1]`, `w_* (D0, D1, mats)` K-major (row-major `[mats, D0, D1]` memory)."""
    return _compile_rows(options, (1, 0, 2))


def compile_dw(options: str):
    """`x^T (D0, M)` and `dy^T (D1, M)` M/N-major views; `dw_local (D0, D1, mats)` bf16 and
    `dw_partial`, `dw_slots (D0, D1, mats)` fp32, all row-major `[mats, D0, D1]` memory."""
    gemm = GroupedMatmul()
    x_t = _bf16((_aligned_dim(), _dim()), (0, 1))
    dy_t = _bf16((_aligned_dim(), _dim()), (0, 1))

    # D1 (the row stride) divisible by 8: the epilogue's pair stores are aligned.
    def matrices(dtype):
        return make_fake_compact_tensor(dtype, (_dim(), _aligned_dim(), _dim()),
                                        stride_order=(1, 0, 2), assumed_align=16)

    def vector():
        return make_fake_compact_tensor(cutlass.Int32, (_dim(),), assumed_align=4)

    ep_rank = make_fake_compact_tensor(cutlass.Int32, (1,), assumed_align=4)
    return cute.compile(gemm.weight_grad, x_t, dy_t, matrices(cutlass.BFloat16),
                        matrices(cutlass.Float32), matrices(cutlass.Float32), vector(), vector(),
                        ep_rank, vector(), cutlass.Int32(1), make_fake_stream(), options=options)


EXPORTS = {
    "moonep_grouped_matmul": compile_forward,
    "moonep_grouped_matmul_dx": compile_dx,
    "moonep_grouped_matmul_dw": compile_dw,
}
