// Device side of the transport: the per-device symmetric area and the primitives every
// communicating kernel uses (epochs, address mailboxes, bounded cross-GPU barriers).
//
// Each device of an EP group owns one `PeerArea` (plugin `cudaMalloc` memory, zeroed at
// creation); every kernel receives a `GroupView` by value holding the addresses of all R areas
// as this process sees them. Ranks driven by this process are reached with plain UVA pointers
// over NVLink; a rank of another process through this process's mapping of its area (CUDA IPC)
// and of its whole XLA memory pool (VMM, mapped once at bootstrap): a peer publishes its own
// addresses, and `peer_address` moves them into the mapping (base + offset), so the same kernels
// serve both. Nothing here knows XLA or JAX; the host side lives in xla_ffi/transport.{h,cc}.
//
// NOTE: every cross-GPU wait in the project goes through `barrier`, so it is the only place that
// spins, and it is bounded by `GroupView::timeout_ns`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace moonep {

// Largest EP group. The barrier arrives with one thread per peer inside the first warp, and the
// planner keeps per-rank values in warp lanes, so this must stay <= 32; 8 covers one NVLink node.
constexpr int kMaxRanks = 8;
static_assert(kMaxRanks <= 32, "barrier/planner use one lane per rank of a single warp");

// Ops that communicate. Each op owns kBarriersPerOp barrier slots, kMailboxesPerOp mailbox slots
// and one epoch counter, so ops never share a slot by accident.
enum OpSlot : int {
  kOpPlan = 0,
  kOpDispatch = 1,
  kOpCombine = 2,
  kOpCombineWeights = 3,
  kOpPrefetch = 4,
  kOpReduceGrad = 5,
  kOpGroupedMatmul = 6,  // inference overflow: peers' w_local read in place
  kNumOpSlots = 8,       // room for one more op
};
constexpr int kBarriersPerOp = 4;
constexpr int kMailboxesPerOp = 4;
constexpr int kMaxBarrierSlots = kNumOpSlots * kBarriersPerOp;
constexpr int kMaxMailboxSlots = kNumOpSlots * kMailboxesPerOp;

__host__ __device__ constexpr int barrier_slot(int op_slot, int i) {
  return op_slot * kBarriersPerOp + i;
}
__host__ __device__ constexpr int mailbox_slot(int op_slot, int i) {
  return op_slot * kMailboxesPerOp + i;
}

// Largest E the planner supports (sizes the counts exchange and the planner scratch).
constexpr int kMaxExperts = 2048;
// Counts row of one rank in the planner's exchange: its E expert counts.
constexpr int kCountsRowInts = kMaxExperts;
// Planner-private scratch (per-CTA histograms, alloc prefix sums, layouts); plan.cu asserts fit.
constexpr int kPlanScratchInts = 160 * 1024;
// Scratch for the other ops' kernels (grid counters and the like); local to this rank's stream.
constexpr int kOpScratchInts = 16 * 1024;

constexpr uint64_t kDefaultTimeoutNs = 10ull * 1000 * 1000 * 1000;

// The host names these codes in xla_ffi/transport.cc (error_code_name); keep the two together.
enum ErrorCode : uint32_t {
  kErrNone = 0,
  kErrTimeout = 1,         // a barrier wait expired
  kErrBadPlanData = 4,     // plan data decoded out of range; the entry/row was skipped
  kErrPeerAddress = 5,     // a peer process published an address outside its mapped XLA pool
};

// First error seen on this device's area (later errors do not overwrite it). The kernel that
// keeps it also copies it to the area's mirror in mapped pinned host memory
// (`GroupView::error_mirror`), which the host reads with plain loads at
// `moonep_jax.check_transport_errors()`: no CUDA call, no sync per call, and still readable after
// a trap has lost the CUDA context. Kernels that trap also print the same fields.
struct ErrorRecord {
  uint32_t code;
  int32_t rank;
  uint32_t epoch;
  int32_t slot;     // barrier slot for timeouts, -1 otherwise
  int64_t detail;   // timeouts: arrivals seen
  char what[40];
};

// The symmetric area of one device. Peers write only `mailbox`, `barrier_arrivals` and `counts`;
// everything else is touched only by kernels running on the owning device's stream.
struct alignas(128) PeerArea {
  uint64_t mailbox[kMaxMailboxSlots][kMaxRanks];  // [slot][publishing rank] buffer addresses
  uint32_t barrier_arrivals[kMaxBarrierSlots];    // monotonic, +1 per rank per barrier use
  uint32_t barrier_uses[kMaxBarrierSlots];        // how often this rank has used the slot
  uint32_t epoch[kNumOpSlots];                    // monotonic call counter per op
  ErrorRecord error;
  alignas(16) int32_t counts[kMaxRanks][kCountsRowInts];  // [source rank][E]
  alignas(16) int32_t plan_scratch[kPlanScratchInts];
  alignas(16) int32_t op_scratch[kOpScratchInts];
};

// What a kernel needs to talk to its group; built on the host by `group_view`, passed by value.
struct GroupView {
  int rank;                       // position on the EP mesh axis
  int num_ranks;                  // R
  PeerArea* areas[kMaxRanks];     // every rank's area, as this process addresses it
  uint64_t timeout_ns;            // bound of every barrier wait
  // Per rank of another process: its XLA pool [pool_base, pool_base + pool_size) in that process,
  // mapped here at pool_mapped. pool_size == 0: the rank shares this process's address space.
  uint64_t pool_base[kMaxRanks];
  uint64_t pool_size[kMaxRanks];
  uint64_t pool_mapped[kMaxRanks];
  ErrorRecord* error_mirror;      // host-mapped mirror of this rank's error record (may be null)
};

// Registers a kernel so that every transport context loads it on each device of its group when
// the context is created: lazily loading a module while a peer spins in a barrier can deadlock.
// Defined in xla_ffi/transport.cc. Use through MOONEP_PRELOAD_KERNEL at namespace scope.
int register_kernel_for_preload(const void* kernel);
#define MOONEP_PRELOAD_KERNEL(kernel)                  \
  [[maybe_unused]] static const int kPreload_##kernel = \
      ::moonep::register_kernel_for_preload(reinterpret_cast<const void*>(&kernel))

// Likewise for kernel modules loaded by a function (the CuTe DSL objects exported ahead of time):
// the first transport context calls every registered loader, which loads on all devices.
using ModuleLoader = cudaError_t (*)();
int register_module_loader_for_preload(ModuleLoader loader);
#define MOONEP_PRELOAD_MODULE(loader)                         \
  [[maybe_unused]] static const int kPreloadModule_##loader = \
      ::moonep::register_module_loader_for_preload(&loader)

#ifdef __CUDACC__

// ---- memory-model helpers (system scope: peers are other GPUs) ---------------------------------

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_release_sys_add(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t atom_add_acq_rel_gpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ PeerArea* own_area(const GroupView& g) { return g.areas[g.rank]; }

// ---- error reporting -------------------------------------------------------------------------

// Records the first error of this device; returns whether this call's record was the one kept.
__device__ inline bool record_error(const GroupView& g, uint32_t code, uint32_t epoch, int slot,
                                    int64_t detail, const char* what) {
  ErrorRecord* e = &own_area(g)->error;
  if (atomicCAS(&e->code, kErrNone, code) != kErrNone) return false;
  e->rank = g.rank;
  e->epoch = epoch;
  e->slot = slot;
  e->detail = detail;
  int n = 0;
  for (; what != nullptr && what[n] != '\0' && n < int(sizeof(e->what)) - 1; ++n) e->what[n] = what[n];
  e->what[n] = '\0';
  if (volatile ErrorRecord* m = g.error_mirror) {  // fields first, the code last
    m->rank = g.rank;
    m->epoch = epoch;
    m->slot = slot;
    m->detail = detail;
    for (int i = 0; i <= n; ++i) m->what[i] = e->what[i];
    __threadfence_system();
    m->code = code;
  }
  __threadfence_system();
  return true;
}

// ---- epochs ----------------------------------------------------------------------------------

// Advances and returns this rank's call counter of `op_slot` (1 on the first call). Call it from
// ONE thread of the op's first kernel; later kernels of the same call read `current_epoch`.
// Epochs live in device memory, so CUDA-graph replays advance them like eager launches.
__device__ inline uint32_t next_epoch(const GroupView& g, int op_slot) {
  return atomicAdd(&own_area(g)->epoch[op_slot], 1u) + 1u;
}

__device__ inline uint32_t current_epoch(const GroupView& g, int op_slot) {
  return *reinterpret_cast<volatile uint32_t*>(&own_area(g)->epoch[op_slot]);
}

// ---- address mailboxes ------------------------------------------------------------------------

// Stores this rank's buffer address into mailbox[slot][rank] of every rank of the group (itself
// included). Call from ONE thread, before the barrier that makes the addresses visible.
__device__ inline void publish(const GroupView& g, int mailbox_slot, const void* ptr) {
  for (int p = 0; p < g.num_ranks; ++p) {
    st_release_sys(&g.areas[p]->mailbox[mailbox_slot][g.rank], reinterpret_cast<uint64_t>(ptr));
  }
}

// The address `peer` published into `mailbox_slot` for the current call, as this process reaches
// it (a peer process's address moved into this process's mapping of its pool). Valid after the
// barrier that follows the publish, until the op's exit barrier. An address outside a peer
// process's pool (not an XLA buffer of the pool mapped at bootstrap) is recorded, printed and
// traps: it cannot be reached, and guessing would be a wild write.
__device__ inline const void* peer_address(const GroupView& g, int mailbox_slot, int peer) {
  const uint64_t published = ld_relaxed_sys(&own_area(g)->mailbox[mailbox_slot][peer]);
  if (g.pool_size[peer] == 0) return reinterpret_cast<const void*>(published);
  const uint64_t offset = published - g.pool_base[peer];
  if (offset >= g.pool_size[peer]) {
    record_error(g, kErrPeerAddress, 0, mailbox_slot, int64_t(published),
                 "a peer's buffer lies outside its mapped XLA pool");
    printf("moonep: rank %d: rank %d published %#llx (mailbox %d), outside its XLA pool mapped at "
           "bootstrap [%#llx, +%llu)\n", g.rank, peer, static_cast<unsigned long long>(published),
           mailbox_slot, static_cast<unsigned long long>(g.pool_base[peer]),
           static_cast<unsigned long long>(g.pool_size[peer]));
    __trap();
  }
  return reinterpret_cast<const void*>(g.pool_mapped[peer] + offset);
}

// ---- the last CTA of a grid ---------------------------------------------------------------

// Called by every thread of every CTA of the grid: whether this CTA is the last one to get here.
// The last CTA resets the ticket: no CTA of this grid takes one any more, and the next call's
// kernels start after this grid has ended.
//
// With peers (`system_scope`), every thread's earlier writes, peer stores included, are fenced at
// system scope before its CTA takes the ticket, so the last CTA sees them, and a barrier it then
// passes publishes them to the peers (`barrier` below). A group of one writes only
// to this GPU: __syncthreads orders the CTA's writes before thread 0's gpu-scope acq_rel ticket,
// and thread 0's acquire and the __syncthreads after it order the last CTA's reads, the pattern
// of cooperative groups' grid sync, so no thread needs a fence of its own.
__device__ inline bool last_cta_done(int32_t* ticket, bool system_scope) {
  __shared__ bool last;
  if (system_scope) __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t* t = reinterpret_cast<uint32_t*>(ticket);
    last = atom_add_acq_rel_gpu(t, 1u) + 1u == gridDim.x;
    if (last) *t = 0;
  }
  __syncthreads();
  // With peers, every thread of the last CTA also fences before it reads (after the acquire).
  if (last && system_scope) __threadfence();
  return last;
}

// ---- cross-GPU barrier -------------------------------------------------------------------------

// Barrier of the whole group. Called by EVERY thread of exactly ONE CTA per rank (the same role on
// every rank); each rank must call the same sequence of barrier slots. Writes made before the call
// by this CTA, or by earlier kernels on the stream whose writing threads ran __threadfence_system(),
// are visible to every peer after it returns.
//
// Arrival counters are monotonic (never reset): use number n of a slot on this rank waits until its
// own counter reaches n*R (wrap-safe), so a barrier needs no reset phase. A peer can arrive at use
// n+1 only after use n completed everywhere, so an early arrival never releases a rank before its
// peers' use-n writes are visible (release/acquire is transitive). Counting uses per slot, rather
// than comparing with epoch*R, keeps a slot correct even if some calls of an op skip it.
// `epoch` and `what` only label the error report.
//
// On timeout: writes {rank, epoch, slot, what} into this device's error record, prints
//   "moonep: rank %d timed out after %llu ns in %s (epoch %u, barrier slot %d)"
// and traps (the CUDA context is lost; no silent hang).
__device__ inline void barrier(const GroupView& g, int barrier_slot, uint32_t epoch,
                               const char* what = "barrier") {
  // A group of one has no peer to wait for or to publish to: its own writes are ordered by the
  // CTA's __syncthreads and the kernel boundary.
  if (g.num_ranks == 1) {
    __syncthreads();
    return;
  }
  __shared__ uint32_t target;
  PeerArea* me = own_area(g);
  __threadfence_system();  // every thread's prior peer writes are performed before the arrival
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t uses = me->barrier_uses[barrier_slot] + 1u;
    me->barrier_uses[barrier_slot] = uses;
    target = uses * uint32_t(g.num_ranks);
  }
  if (threadIdx.x < g.num_ranks) {
    red_release_sys_add(&g.areas[threadIdx.x]->barrier_arrivals[barrier_slot], 1u);
  }
  if (threadIdx.x == 0) {
    const uint64_t start = global_timer_ns();
    uint32_t seen;
    while (int32_t((seen = ld_acquire_sys(&me->barrier_arrivals[barrier_slot])) - target) < 0) {
      const uint64_t waited = global_timer_ns() - start;
      if (waited > g.timeout_ns) {
        record_error(g, kErrTimeout, epoch, barrier_slot, int64_t(seen), what);
        printf("moonep: rank %d timed out after %llu ns in %s (epoch %u, barrier slot %d)\n",
               g.rank, static_cast<unsigned long long>(waited), what, epoch, barrier_slot);
        __trap();
      }
    }
  }
  __syncthreads();
  __threadfence_system();
}

#endif  // __CUDACC__

}  // namespace moonep
